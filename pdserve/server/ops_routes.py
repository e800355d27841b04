"""Operational routes: liveness, readiness, load and Prometheus metrics.

`/health` and `/ready` are 200 only while the engine accepts requests, so an
orchestrator never routes traffic to a worker that is loading or draining;
`/live` is 200 while the worker can still serve (a loading or draining
worker must not be restarted) and 503 once its engine loop died or its model
failed to load, so an orchestrator restarts it. `/load` is what routing proxies poll; it also
names the port of the worker's internal listener (`internal_port`), where a proxy reaches the
/internal/* routes (routing info, KV events, release): the serving port has none of them.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE

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
        if ctx.engine.is_alive():
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "dead", "reason": "the engine stopped; restart this worker"}, status_code=503)

    @router.get("/load")
    async def load() -> Response:
        report = ctx.engine.load_report()
        return JSONResponse({"ready": ctx.engine.is_ready(), **dataclasses.asdict(report),
                             "internal_port": ctx.config.internal_listen_port})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(ctx.metrics.render_openmetrics(), media_type=OPENMETRICS_CONTENT_TYPE)
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    return router
