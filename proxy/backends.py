"""Backends (worker endpoints) of one role: their pooled HTTP clients, health, load and breaker.

Invariant: a backend is offered to routing only while its last health poll
said ready, its breaker lets a request through and it is not saturated;
every request sent to it is bracketed by `begin()` and exactly one `end()`,
so the in-flight count (the freshest load signal the proxy has) never drifts.
A worker's /internal/* routes live on its internal listener, whose port its
/load names: the proxy calls them there (`Backend.internal_client`), never on
the serving URL once the worker has named one.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import httpx

from pdserve.api.validation import REQUEST_ID_HEADER
from proxy.breaker import CircuitBreaker
from proxy.config import ProxyConfig
from proxy.transport import LeanTransport

logger = logging.getLogger(__name__)

INTERNAL_TOKEN_HEADER = "X-Pdserve-Internal-Token"
# A KV usage of 100% weighs as much as this many queued requests in the load score.
KV_USAGE_WEIGHT = 4.0
KEEPALIVE_EXPIRY_S = 4.0


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Outcome(enum.Enum):
    SUCCESS = "success"  # the backend served the request
    FAILURE = "failure"  # unreachable, timed out, 5xx, or nonsense: counts towards the breaker
    NEUTRAL = "neutral"  # says nothing about the backend: client gone, backend busy (503), the request's own fault


class BreakerOpen(Exception):
    """The backend was picked while its breaker let requests through, but by sending time it does not."""


@dataclass(slots=True)
class LoadReport:
    """What a worker's GET /load said last time."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    kv_usage: float = 0.0
    internal_port: Optional[int] = None  # the worker's internal listener; None: it names none

    @classmethod
    def from_json(cls, body: dict) -> "LoadReport":
        def number(key: str) -> float:
            value = body.get(key, 0)
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

        port = body.get("internal_port")
        valid_port = port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None
        return cls(int(number("num_running")), int(number("num_waiting")),
                   int(number("num_waiting_for_kv")), float(number("kv_usage")), valid_port)

    @property
    def num_queued(self) -> int:
        return self.num_running + self.num_waiting + self.num_waiting_for_kv


@dataclass(slots=True, eq=False)
class Backend:
    url: str
    role: Role
    client: httpx.AsyncClient
    breaker: CircuitBreaker
    max_in_flight: int = 0  # 0 = no cap
    healthy: bool = False  # pessimistic until the first poll says ready
    load: LoadReport = field(default_factory=LoadReport)
    num_in_flight: int = 0
    prompt_tokens_in_flight: int = 0  # prompt tokens of the legs in flight that make this worker compute a prompt
    num_awaiting_ticket: int = 0  # of those in flight, decode legs waiting for their prefill (proxy/both_legs.py)
    num_failed_polls: int = 0
    make_client: Optional["ClientFactory"] = None  # builds the internal listener's client
    internal_clients: dict[int, httpx.AsyncClient] = field(default_factory=dict)  # by internal port

    @property
    def internal_client(self) -> httpx.AsyncClient:
        """The client of the worker's internal listener (/internal/* routes), at the port its last /load
        named. Until one has (the worker is not ready yet) or for a worker that names none (an older
        release), the serving client: there a current worker answers 404 and callers retry later."""
        port = self.load.internal_port
        if port is None or self.make_client is None:
            return self.client
        client = self.internal_clients.get(port)
        if client is None:
            url = str(httpx.URL(self.url).copy_with(port=port)).rstrip("/")
            client = self.internal_clients[port] = self.make_client(url)
        return client

    async def aclose(self) -> None:
        await self.client.aclose()
        for client in self.internal_clients.values():
            await client.aclose()

    def is_available(self) -> bool:
        if not self.healthy or not self.breaker.allows_request():
            return False
        return self.max_in_flight == 0 or self.num_in_flight < self.max_in_flight

    def load_score(self) -> float:
        """Queued + running requests (the proxy's own count when fresher than the poll), plus KV pressure."""
        return max(self.num_in_flight, self.load.num_queued) + KV_USAGE_WEIGHT * self.load.kv_usage

    def begin(self) -> bool:
        """Count a request about to be sent; True when it is the breaker's half-open trial.
        Raises `BreakerOpen` (nothing counted) when the breaker lets no request through now."""
        if not self.breaker.allows_request():
            raise BreakerOpen(self.url)
        self.num_in_flight += 1
        return self.breaker.on_request_start()

    def end(self, outcome: Outcome, trial: bool = False) -> None:
        self.num_in_flight -= 1
        if outcome is Outcome.SUCCESS:
            self.breaker.record_success(trial)
        elif outcome is Outcome.FAILURE:
            self.breaker.record_failure(trial)
        else:
            self.breaker.record_neutral(trial)


class BackendClient(httpx.AsyncClient):
    """The pooled client of one backend. Health polls use the plain httpx API; the legs, which
    are the hot path, go straight to the transport (httpx's client layer of auth, redirects and
    cookies costs more than the proxy's whole budget and does nothing for a worker)."""

    def __init__(self, url: str, *, leg_headers: dict[str, str], lean: Optional[LeanTransport], **kwargs):
        super().__init__(base_url=url, headers=leg_headers, transport=lean, **kwargs)
        self._lean = lean
        self._leg_headers = leg_headers
        self._urls: dict[str, httpx.URL] = {}

    def leg_request(self, path: str, body: bytes, request_id: str, timeout: dict[str, float],
                    extra_headers: Optional[dict[str, str]] = None) -> httpx.Request:
        """`extra_headers`: the proxy's own (a peer hint), never a client's."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.base_url.join(path)
        headers = {**self._leg_headers, **(extra_headers or {}), REQUEST_ID_HEADER: request_id,
                   "Content-Type": "application/json"}
        return httpx.Request("POST", url, headers=headers, content=body, extensions={"timeout": timeout})

    async def send_leg(self, request: httpx.Request) -> httpx.Response:
        """The answer streams: the caller reads and closes it."""
        if self._lean is not None:
            return await self._lean.handle_async_request(request)
        return await self.send(request, stream=True)


ClientFactory = Callable[[str], httpx.AsyncClient]


def client_factory(config: ProxyConfig) -> ClientFactory:
    """One pooled client per backend: keep-alive connections, per-hop timeouts, no env proxies."""
    timeouts = config.timeouts
    headers = {"Accept-Encoding": "identity"}  # relay bytes unchanged: never let a worker compress
    if config.internal_token is not None:
        headers[INTERNAL_TOKEN_HEADER] = config.internal_token
    timeout = httpx.Timeout(connect=timeouts.connect_s, read=timeouts.decode_s,
                            write=timeouts.write_s, pool=timeouts.pool_s)
    limits = httpx.Limits(max_connections=config.max_connections_per_backend, keepalive_expiry=KEEPALIVE_EXPIRY_S)

    def make(url: str) -> httpx.AsyncClient:
        # Plain HTTP (the cluster-internal case) gets the lean transport; https keeps httpx's own.
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them from the
        # worker's side, so a request is rarely sent on a connection being closed.
        lean = LeanTransport(config.max_connections_per_backend, KEEPALIVE_EXPIRY_S) \
            if url.startswith("http://") else None
        return BackendClient(url, leg_headers=headers, lean=lean, timeout=timeout, limits=limits, trust_env=False)

    return make


class BackendPool:
    """The backends of one role; discovery adds and retires them while requests run."""

    def __init__(self, role: Role, config: ProxyConfig, make_client: ClientFactory):
        self.role = role
        self._config = config
        self._make_client = make_client
        self._backends: dict[str, Backend] = {}
        self._retired: list[Backend] = []  # removed, closed once their last request ends

    def __len__(self) -> int:
        return len(self._backends)

    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def get(self, url: str) -> Optional[Backend]:
        return self._backends.get(url)

    def available(self, exclude_urls: Iterable[str] = ()) -> list[Backend]:
        excluded = set(exclude_urls)
        return [b for b in self._backends.values() if b.url not in excluded and b.is_available()]

    def add(self, url: str) -> Backend:
        existing = self._backends.get(url)
        if existing is not None:
            return existing
        health = self._config.health
        backend = Backend(
            url=url, role=self.role, client=self._make_client(url),
            breaker=CircuitBreaker(health.breaker_failures, health.breaker_cooldown_s),
            max_in_flight=self._config.routing.max_in_flight_per_backend, make_client=self._make_client,
        )
        self._backends[url] = backend
        logger.info("%s backend added: %s", self.role.value, url)
        return backend

    def retire(self, url: str) -> None:
        backend = self._backends.pop(url, None)
        if backend is not None:
            logger.info("%s backend removed: %s", self.role.value, url)
            self._retired.append(backend)

    async def close_idle_retired(self) -> None:
        """Close retired backends' clients once no request uses them (never under a live stream)."""
        still_busy = []
        for backend in self._retired:
            if backend.num_in_flight > 0:
                still_busy.append(backend)
            else:
                await backend.aclose()
        self._retired = still_busy

    async def aclose(self) -> None:
        for backend in [*self._backends.values(), *self._retired]:
            await backend.aclose()
        self._backends.clear()
        self._retired.clear()
