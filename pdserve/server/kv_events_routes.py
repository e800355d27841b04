"""Internal routes for KV-aware routing: the event stream, the routing info, a prefix-cache reset.

All three need the shared internal token when one is configured: the stream
reveals which prompts this worker has seen, the info its tokenizer, and the
reset changes its state. Without a token they are open only on a loopback
address (or with --insecure-no-token): a colocated worker serving the OpenAI
API on a public address keeps them shut. Built for every role (a colocated
worker's cache is worth routing to as well).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.api.errors import EngineNotReady, Unauthorized
from pdserve.kv.hashing import HASH_SCHEME
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.routing_info import (EVENTS_PATH, RESET_PREFIX_CACHE_PATH, ROUTING_INFO_PATH, RoutingInfo,
                                     describe_groups)
from pdserve.metrics import Metrics
from pdserve.server.errors import check_internal_token
from pdserve.server.kv_events import KVEventHub, KVEventMetrics, KVEventSource, run_on_engine_thread

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.kv.events import KVEventRecorder
    from pdserve.models.loader import LoadedModel
    from pdserve.models.tokenizer import Tokenizer

NDJSON = "application/x-ndjson"


class BuiltEngine(Protocol):
    """What these routes read of a worker's assembled engine (`pdserve.app.engine_factory.BuiltEngine`;
    the server never imports the composition root)."""

    engine: "AsyncEngine"
    loaded: "LoadedModel"
    kv_manager: KVCacheManager
    kv_events: "KVEventRecorder"
    epoch: str


def routing_info(tokenizer: "Tokenizer", model: str, epoch: str, kv_manager: KVCacheManager) -> RoutingInfo:
    """Everything a proxy needs to hash this worker's prompt blocks itself."""
    return RoutingInfo(
        model=model, epoch=epoch, hash_scheme=HASH_SCHEME, block_size=kv_manager.block_size,
        prefix_caching=kv_manager.enable_prefix_caching, groups=describe_groups(kv_manager.plan),
        tokenizer_json=tokenizer.backend.to_str(), chat_template=tokenizer.chat_template,
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
    )


class _KVEventsService:
    """Lazily bound to the engine once it has loaded (the server answers before that)."""

    def __init__(self, engine: "EngineClient", built: Callable[[], Optional["BuiltEngine"]], metrics: KVEventMetrics):
        self._engine = engine
        self._built = built
        self._metrics = metrics
        self._hub: Optional[KVEventHub] = None
        self._info: Optional[bytes] = None

    def loaded(self) -> "BuiltEngine":
        built = self._built()
        if built is None or not self._engine.is_ready():
            raise EngineNotReady("the engine is not serving (loading, draining or stopped)")
        return built

    def hub(self) -> KVEventHub:
        built = self.loaded()
        if self._hub is None:
            loop = built.engine.engine_loop
            source = KVEventSource(built.kv_events, built.kv_manager, loop.call_soon, built.epoch,
                                   built.kv_manager.block_size, self._engine.is_ready)
            self._hub = KVEventHub(source, self._metrics)
        return self._hub

    async def info(self) -> bytes:
        if self._info is None:
            built = self.loaded()
            # Serializing a tokenizer takes tens of milliseconds: not on the event loop.
            def build() -> bytes:
                info = routing_info(built.loaded.tokenizer, built.engine.model_name, built.epoch, built.kv_manager)
                return info.model_dump_json().encode()

            self._info = await asyncio.to_thread(build)
        return self._info

    async def reset_prefix_cache(self) -> int:
        built = self.loaded()
        return await run_on_engine_thread(built.engine.engine_loop.call_soon, built.kv_manager.clear_prefix_cache)


def create_kv_events_router(engine: "EngineClient", built: Callable[[], Optional["BuiltEngine"]], metrics: Metrics,
                            internal_token: Optional[str], *, open_without_token: bool = True) -> APIRouter:
    """`open_without_token`: whether, with no token configured, the routes answer at all (loopback only)."""
    router = APIRouter()
    service = _KVEventsService(engine, built, KVEventMetrics(metrics.registry))

    def check_access(request: Request) -> None:
        if internal_token is None and not open_without_token:
            raise Unauthorized("this worker listens on a non-loopback address without an internal token, so its "
                               "internal endpoints are shut (set $PDSERVE_INTERNAL_TOKEN, or --insecure-no-token)")
        check_internal_token(request, internal_token)

    @router.get(EVENTS_PATH)
    async def kv_events(request: Request) -> Response:
        check_access(request)
        hub = service.hub()
        hub.check_capacity()
        return StreamingResponse(hub.stream(), media_type=NDJSON)

    @router.get(ROUTING_INFO_PATH)
    async def get_routing_info(request: Request) -> Response:
        check_access(request)
        return Response(await service.info(), media_type="application/json")

    @router.post(RESET_PREFIX_CACHE_PATH)
    async def reset_prefix_cache(request: Request) -> Response:
        check_access(request)
        return JSONResponse({"num_blocks_dropped": await service.reset_prefix_cache()})

    return router
