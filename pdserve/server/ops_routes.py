"""Operational routes: liveness, readiness, load and Prometheus metrics.

`/health` and `/ready` are 200 only while the engine accepts requests, so an
orchestrator never routes traffic to a worker that is loading or draining;
`/live` is 200 as long as the process serves HTTP (a loading or draining
worker must not be restarted). `/load` is what routing proxies poll.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pdserve.server.context import ServingContext


def build_ops_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if ctx.engine.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @router.get("/ready")
    async def ready() -> Response:
        return await health()

    @router.get("/live")
    async def live() -> Response:
        return JSONResponse({"status": "alive"})

    @router.get("/load")
    async def load() -> Response:
        report = ctx.engine.load_report()
        return JSONResponse({"ready": ctx.engine.is_ready(), **dataclasses.asdict(report)})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    return router
