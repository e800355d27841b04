"""`create_app` and `create_internal_app`: the two FastAPI applications of one worker.

The serving app (the OpenAI API, tokenize, ops) is what clients and sidecars reach; the
internal app carries the /internal/* routes (KV handshake, release, routing info, KV events,
prefix-cache reset) on a listener of its own. Invariant: no /internal/ route is ever mounted
on the serving app, so the serving port answers 404 for every one of them. Factories, never
module-level apps: every app (and every test) gets its own routes and error handlers.
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

INTERNAL_PREFIX = "/internal/"

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient


def create_app(
    engine: "EngineClient",
    metrics: Metrics,
    config: ServerConfig,
    *,
    limits: LimitsConfig = LimitsConfig(),
) -> FastAPI:
    """Build the worker's serving app: the OpenAI routes, tokenize and ops; nothing internal."""
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
    return app


def create_internal_app(metrics: Metrics, routers: Sequence[APIRouter]) -> FastAPI:
    """Build the worker's internal app from the routers of the subsystems that serve peers (KV hand-off,
    KV events); each route checks the internal token itself. Refuses a route outside /internal/, so that
    nothing a client needs ends up off the serving port by mistake."""
    app = FastAPI(title="pdserve internal", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app, metrics.request)
    for router in routers:
        paths = [getattr(route, "path", None) for route in router.routes]  # a nested router has none: refused
        stray = [path for path in paths if path is None or not path.startswith(INTERNAL_PREFIX)]
        if stray:
            raise ValueError(f"the internal listener serves only {INTERNAL_PREFIX} routes, not {stray}")
        app.include_router(router)
    return app
