"""The proxy's ASGI app: OpenAI routes forwarded in two legs, plus /v1/models, /tokenize, /detokenize,
/health and /metrics.

Everything (pools, clients, metrics, background loops) comes from
`create_app` and lives as long as the app: no module-level state. The health
poll and DNS discovery loops run in the app's lifespan and stop with it;
the backends' HTTP clients are closed on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.api.errors import PdserveError
from pdserve.api.http_bounds import read_body
from pdserve.api.openapi import OPENAPI_PATH, PROTOCOL_VERSION_LABEL, openapi_document
from proxy.backends import INTERNAL_TOKEN_HEADER, Backend, BackendPool, ClientFactory, Role, client_factory
from proxy.config import ProxyConfig
from proxy.discovery import DnsDiscovery, Resolver, resolve_with_getaddrinfo
from proxy.errors import NoBackendAvailable, RejectedRequest, error_body, error_response
from proxy.forwarder import Forwarder
from proxy.health import HealthMonitor
from proxy.kv_routes import explain_route
from proxy.metrics import CONTENT_TYPE, ProxyMetrics, create_proxy_metrics
from proxy.routing.kv_routing import KV_AWARE, KVRouting

logger = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass
class ProxyComponents:
    """What one proxy app is made of; tests reach in here to watch backends and metrics."""

    config: ProxyConfig
    prefill_pool: BackendPool
    decode_pool: BackendPool
    metrics: ProxyMetrics
    forwarder: Forwarder
    monitor: HealthMonitor
    discoveries: list[DnsDiscovery] = field(default_factory=list)
    kv: Optional[KVRouting] = None  # when a role's policy is kv_aware

    def all_backends(self) -> list[Backend]:
        return [*self.prefill_pool.backends(), *self.decode_pool.backends()]

    def is_ready(self) -> bool:
        """Serving is possible: a decode worker, and a prefill worker unless there is no prefill tier or
        the decode workers may compute prompts themselves meanwhile (`colocated_fallback`)."""
        if not self.decode_pool.available():
            return False
        return not self.config.has_prefill or self.config.colocated_fallback or bool(self.prefill_pool.available())


def build_components(config: ProxyConfig, resolver: Optional[Resolver] = None,
                     make_client: Optional[ClientFactory] = None) -> ProxyComponents:
    make_client = make_client or client_factory(config)
    prefill_pool = BackendPool(Role.PREFILL, config, make_client)
    decode_pool = BackendPool(Role.DECODE, config, make_client)
    for url in config.prefill_urls:
        prefill_pool.add(url)
    for url in config.decode_urls:
        decode_pool.add(url)
    metrics = create_proxy_metrics(lambda: [*prefill_pool.backends(), *decode_pool.backends()])
    kv = None
    # Peer hints need the index too, and a worker besides the one computing that may lend: decode workers lend
    # since issue 39, so one prefill and one decode worker (`pdserve up`'s default) qualify: a conversation's
    # next turn goes to P while D holds the last answer's KV. A lone worker keeps no index for hints.
    discovered = config.discovery.prefill_dns is not None or config.discovery.decode_dns is not None
    peer_hints = config.routing.peer_pull and (len(config.prefill_urls) + len(config.decode_urls) > 1 or discovered)
    if KV_AWARE in (config.routing.prefill_policy, config.routing.decode_policy) or peer_hints:
        kv = KVRouting(config.routing, {Role.PREFILL: prefill_pool, Role.DECODE: decode_pool}, metrics.registry)
    components = ProxyComponents(
        config=config, prefill_pool=prefill_pool, decode_pool=decode_pool, metrics=metrics,
        forwarder=Forwarder(config, prefill_pool, decode_pool, metrics, kv),
        monitor=HealthMonitor((prefill_pool, decode_pool), config.health), kv=kv,
    )
    discovery = config.discovery
    for pool, target in ((prefill_pool, discovery.prefill_dns), (decode_pool, discovery.decode_dns)):
        if target is not None:
            components.discoveries.append(
                DnsDiscovery(pool, target, resolver or resolve_with_getaddrinfo, discovery.scheme))
    return components


@contextlib.asynccontextmanager
async def _lifespan(components: ProxyComponents) -> AsyncIterator[None]:
    for discovery in components.discoveries:
        await discovery.refresh()
    tasks = [asyncio.create_task(components.monitor.run_forever(), name="proxy-health")]
    if components.kv is not None:
        tasks.append(asyncio.create_task(components.kv.run_forever(), name="proxy-kv-routing"))
    for discovery in components.discoveries:
        tasks.append(asyncio.create_task(
            discovery.run_forever(components.config.discovery.interval_s, components.monitor.poll_all),
            name="proxy-discovery"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await components.forwarder.aclose()
        await components.prefill_pool.aclose()
        await components.decode_pool.aclose()


def _backend_state(backend: Backend) -> dict:
    return {"url": backend.url, "healthy": backend.healthy, "breaker": backend.breaker.state.name.lower(),
            "in_flight": backend.num_in_flight, "available": backend.is_available()}


def _is_internal_caller(request: Request, token: Optional[str]) -> bool:
    """Only a caller with the internal token sees the backends (never anyone when there is no token)."""
    given = request.headers.get(INTERNAL_TOKEN_HEADER)
    return token is not None and given is not None and hmac.compare_digest(given.encode(), token.encode())


def _routes(components: ProxyComponents) -> list[Route]:
    forwarder = components.forwarder

    async def completions(request: Request) -> Response:
        return await forwarder.handle(request, COMPLETIONS_PATH)

    async def chat_completions(request: Request) -> Response:
        return await forwarder.handle(request, CHAT_COMPLETIONS_PATH)

    async def models(request: Request) -> Response:
        return await _relay_to_decode(components, "GET", "/v1/models")

    async def tokenizer_route(request: Request) -> Response:
        return await _relay_tokenizer(components, request)

    async def health(request: Request) -> Response:
        body: dict = {"status": "ok" if components.is_ready() else "unavailable"}
        if _is_internal_caller(request, components.config.internal_token):  # backend addresses are internal
            body["prefill"] = [_backend_state(b) for b in components.prefill_pool.backends()]
            body["decode"] = [_backend_state(b) for b in components.decode_pool.backends()]
        return JSONResponse(body, status_code=200 if components.is_ready() else 503)

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def metrics(request: Request) -> Response:
        return Response(components.metrics.render(), media_type=CONTENT_TYPE)

    document = openapi_document("pdserve proxy", PROTOCOL_VERSION_LABEL)

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    return [
        Route(COMPLETIONS_PATH, completions, methods=["POST"]),
        Route(CHAT_COMPLETIONS_PATH, chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenizer_route, methods=["POST"]),
        Route("/detokenize", tokenizer_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", health, methods=["GET"]),
        Route("/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route(OPENAPI_PATH, openapi, methods=["GET"]),
        explain_route(components.kv, components.config.internal_token),
    ]


async def _relay_tokenizer(components: ProxyComponents, request: Request) -> Response:
    """Every worker serves the same tokenizer: any decode worker answers. The body is read as
    bounded as the workers read theirs (413/408); the worker validates the rest."""
    try:
        body = await read_body(request, components.config.limits)
    except PdserveError as error:
        return error_response(RejectedRequest(error), None, components.config.retry_after_s)
    except ClientDisconnect:
        return Response(status_code=499)
    return await _relay_to_decode(components, "POST", request.url.path, body)


async def _relay_to_decode(components: ProxyComponents, method: str, path: str, body: bytes = b"") -> Response:
    """A decode worker's answer to a model-wide question (every worker serves the same model and tokenizer)."""
    retry_after_s = components.config.retry_after_s
    for backend in components.decode_pool.available():
        try:
            response = await backend.client.request(method, path, content=body or None,
                                                    headers={"Content-Type": "application/json"} if body else None,
                                                    timeout=components.config.health.timeout_s * 5)
        except httpx.HTTPError as exc:
            logger.warning("%s %s on %s failed: %s", method, path, backend.url, type(exc).__name__)
            continue
        return Response(response.content, response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))
    return error_response(NoBackendAvailable("no decode worker is available; retry later"), None, retry_after_s)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    error_type = "not_found_error" if status == 404 else "invalid_request_error"
    return Response(error_body(status, str(getattr(exc, "detail", "error")), error_type), status,
                    media_type="application/json")


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    return Response(error_body(500, "internal proxy error", "internal_error"), 500, media_type="application/json")


def create_app(config: ProxyConfig, *, resolver: Optional[Resolver] = None,
               components: Optional[ProxyComponents] = None) -> Starlette:
    """The proxy app; pass `components` (from `build_components`) to watch its internals."""
    components = components or build_components(config, resolver)
    app = Starlette(routes=_routes(components), lifespan=lambda app: _lifespan(components),
                    exception_handlers={HTTPException: _on_http_exception, Exception: _on_unexpected})
    app.state.components = components
    return app
