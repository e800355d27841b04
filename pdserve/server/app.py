"""`create_app`: the FastAPI application of one worker, built from an engine, metrics and config.

A factory, never a module-level app: every app (and every test) gets its own
routes, error handlers and request-id registry around the objects passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from pdserve.api.config import LimitsConfig, ServerConfig
from pdserve.api.openapi import OPENAPI_PATH, PROTOCOL_VERSION_LABEL, openapi_document
from pdserve.metrics import Metrics
from pdserve.server.context import ServingContext
from pdserve.server.errors import install_error_handlers
from pdserve.server.openai_routes import build_openai_router
from pdserve.server.ops_routes import build_ops_router
from pdserve.server.tokenize_routes import build_tokenize_router

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient


def create_app(
    engine: "EngineClient",
    metrics: Metrics,
    config: ServerConfig,
    *,
    extra_routers: Sequence[APIRouter] = (),
    limits: LimitsConfig = LimitsConfig(),
) -> FastAPI:
    """Build the worker's app; `extra_routers` lets other subsystems (KV hand-off) mount their routes."""
    ctx = ServingContext(engine=engine, metrics=metrics, config=config, limits=limits)
    # The generation routes parse raw bodies themselves, so FastAPI's own schema would be
    # empty and misleading: the one served is built from the wire models (pdserve/api/openapi.py).
    app = FastAPI(title="pdserve", openapi_url=None, docs_url=None, redoc_url=None)
    document = openapi_document("pdserve worker", PROTOCOL_VERSION_LABEL)
    app.add_api_route(OPENAPI_PATH, lambda: JSONResponse(document), methods=["GET"], include_in_schema=False)
    app.state.serving = ctx
    install_error_handlers(app, metrics.request)
    app.include_router(build_openai_router(ctx))
    app.include_router(build_tokenize_router(ctx))
    app.include_router(build_ops_router(ctx))
    for router in extra_routers:
        app.include_router(router)
    return app
