"""Operational routes: `GET /health` for load balancers and `GET /metrics` for Prometheus.

`/health` is 200 only while the engine accepts requests, so an orchestrator
never routes traffic to a worker that is still loading or draining.
"""

from __future__ import annotations

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

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    return router
