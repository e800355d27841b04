"""One leg to one backend: send it, time it, and sort its answer into what the forwarder may do next.

Invariant: every leg is bracketed by `Backend.begin()` and exactly one
`Backend.end(outcome)`; for a streamed decode answer that end happens when
the stream is closed (`OpenLeg.finish`), not when its headers arrive.
Nothing here decides where to retry: it only raises the typed reason.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from pdserve.api.handoff import parse_prefill_parts

from proxy.backends import Backend, BreakerOpen, Outcome
from proxy.client_request import ClientRequest, decode_body, prefill_body
from proxy.config import TimeoutConfig
from proxy.errors import NoBackendAvailable, ProxyError, UpstreamFailed, UpstreamTimeout
from proxy.metrics import ProxyMetrics, status_class

logger = logging.getLogger(__name__)

FIRST_EVENTS_FIELD = "first_events"  # P's answer's kv_transfer_params (pdserve/server/first_events.py)
FIRST_EVENTS_SKIPPED_FIELD = "first_events_skipped"
# Decode's answers that mean "the KV never arrived": prefill again (elsewhere) and retry.
KV_RETRY_ERROR_TYPES = {503: "kv_pull_failed", 409: "kv_params_stale"}
# Answers that say the path to a worker failed, not the request: retried elsewhere, counted by the breaker.
PATH_FAILURE_STATUSES = frozenset({408, 502, 504})


class LegFailed(Exception):
    """The backend failed this leg; another backend may succeed. `error` is what the client gets
    if no other one does. `delivered` is False when the backend never saw the request."""

    def __init__(self, reason: str, error: ProxyError, delivered: bool = True):
        super().__init__(error.message)
        self.reason = reason
        self.error = error
        self.delivered = delivered


class DecodeLost(Exception):
    """The decode worker took the request and died before answering; `url` is the dead one."""

    def __init__(self, url: str, error: ProxyError):
        super().__init__(url)
        self.url = url
        self.error = error


class KVRetry(Exception):
    """Decode could not get the prompt's KV (pull failed, or the params went stale)."""

    def __init__(self, reason: str, answer: "RelayedAnswer"):
        super().__init__(reason)
        self.reason = reason
        self.answer = answer


@dataclass(slots=True)
class RelayedAnswer:
    """A backend's complete non-200 answer, relayed to the client as it is."""

    status_code: int
    content: bytes
    content_type: str


class PassThrough(Exception):
    """The backend judged the request itself (a 4xx): no other backend would answer differently."""

    def __init__(self, answer: RelayedAnswer):
        super().__init__(answer.status_code)
        self.answer = answer


@dataclass(slots=True)
class PrefillAnswer:
    kv_transfer_params: dict[str, Any]
    num_cached_tokens: Optional[int]  # the worker's usage.prompt_tokens_details.cached_tokens
    handoff_s: dict[str, float] = field(default_factory=dict)  # P's own handoff components (pdserve/api/handoff.py)
    first_events: Optional[bytes] = None  # token 1's stream events, when asked and P could give them
    first_events_skipped: Optional[str] = None  # else why not, as P named it (pdserve/server/first_events.py)


def cached_tokens_of(answer: Any) -> Optional[int]:
    """usage.prompt_tokens_details.cached_tokens of an OpenAI response body, if it has one."""
    try:
        value = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(slots=True, eq=False)
class OpenLeg:
    """A decode answer whose headers arrived; for a stream, the body is still to come."""

    backend: Backend
    response: httpx.Response
    started_s: float
    headers_s: float
    trial: bool = False  # the backend's half-open breaker trial
    ended: bool = False

    def finish(self, outcome: Outcome) -> None:
        if not self.ended:
            self.ended = True
            self.backend.end(outcome, self.trial)


def _error_type(content: bytes) -> Optional[str]:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("type") if isinstance(error, dict) else None


def _answer(response: httpx.Response) -> RelayedAnswer:
    return RelayedAnswer(response.status_code, response.content,
                         response.headers.get("content-type", "application/json"))


def _transport_failure(exc: httpx.HTTPError, leg: str) -> LegFailed:
    """Map an httpx exception to a reason; connect-phase failures never reached the worker."""
    never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
    if isinstance(exc, httpx.TimeoutException) and not never_sent:
        return LegFailed("timeout", UpstreamTimeout(f"the {leg} worker did not answer in time"))
    reason = "connect" if never_sent else "transport"
    error = NoBackendAvailable(f"no {leg} worker could be reached") if never_sent else \
        UpstreamFailed(f"the {leg} worker dropped the connection ({type(exc).__name__})")
    return LegFailed(reason, error, delivered=not never_sent)


def _status_failure(answer: RelayedAnswer, leg: str) -> tuple[Outcome, Exception]:
    """Non-200 answers. A worker that answered is alive: its 4xx, and its own 5xx (500 and kin, e.g. a
    fault in this request's handling), are about the request: passed through unchanged, never retried,
    never counted against the worker, so that no sequence of client requests can open a breaker on a
    healthy worker. 503/429 is a busy worker (retried elsewhere, counted neither way). 502/504 (a
    gateway between us could not reach it) and 408 (it did not get our request in time) are failures
    of the path to the worker: retried elsewhere and counted by the breaker, like transport errors."""
    status = answer.status_code
    if status in (503, 429):
        return Outcome.NEUTRAL, LegFailed("busy", NoBackendAvailable(f"the {leg} worker is busy"))
    if status in PATH_FAILURE_STATUSES:
        return Outcome.FAILURE, LegFailed(f"http_{status}", UpstreamFailed(f"the {leg} worker failed (HTTP {status})"))
    return Outcome.NEUTRAL, PassThrough(answer)


def _begin(backend: Backend, leg: str) -> bool:
    """`Backend.begin()`; a breaker that closed its door since the pick makes the leg undelivered."""
    try:
        return backend.begin()
    except BreakerOpen:
        raise LegFailed("breaker_open", NoBackendAvailable(f"no {leg} worker is available; retry later"),
                        delivered=False) from None


class LegSender:
    """Sends legs and keeps the per-backend counters; one per proxy app."""

    def __init__(self, metrics: ProxyMetrics, timeouts: TimeoutConfig):
        self._metrics = metrics
        hop = {"connect": timeouts.connect_s, "write": timeouts.write_s, "pool": timeouts.pool_s}
        self._prefill_timeout = {**hop, "read": timeouts.prefill_s}
        self._decode_timeout = {**hop, "read": timeouts.decode_s}

    def _count(self, backend: Backend, status: str, reason: Optional[str] = None) -> None:
        role = backend.role.value
        self._metrics.backend_requests.labels(role, backend.url, status).inc()
        if reason is not None:
            self._metrics.backend_errors.labels(role, backend.url, reason).inc()

    async def prefill(self, backend: Backend, request: ClientRequest) -> PrefillAnswer:
        """The first leg; returns the `kv_transfer_params` that tell decode where the KV is."""
        outcome = Outcome.NEUTRAL  # if cancelled (client gone), the leg says nothing about the worker
        trial = _begin(backend, "prefill")
        started_s = time.perf_counter()
        try:
            try:
                response = await _send_and_read(backend, backend.client.leg_request(
                    request.path, prefill_body(request), request.request_id, self._prefill_timeout,
                    request.peer_hint_headers))
            except httpx.HTTPError as exc:
                failure = _transport_failure(exc, "prefill")
                outcome = Outcome.FAILURE
                self._count(backend, "error", failure.reason)
                raise failure from None
            self._metrics.backend_latency_s.labels("prefill", backend.url).observe(time.perf_counter() - started_s)
            self._count(backend, status_class(response.status_code))
            if response.status_code != 200:
                outcome, exc = _status_failure(_answer(response), "prefill")
                self._count_error(backend, exc)
                raise exc
            answer = _prefill_answer(response)
            if answer is None:
                outcome = Outcome.FAILURE
                self._metrics.backend_errors.labels("prefill", backend.url, "no_kv_params").inc()
                raise LegFailed("no_kv_params", UpstreamFailed("the prefill worker returned no kv_transfer_params"))
            outcome = Outcome.SUCCESS
            return answer
        finally:
            backend.end(outcome, trial)

    def _count_error(self, backend: Backend, exc: Exception) -> None:
        """A failed leg by its reason; a worker's own 5xx, passed through, in a metric of its own."""
        if isinstance(exc, LegFailed) and exc.reason != "busy":
            self._metrics.backend_errors.labels(backend.role.value, backend.url, exc.reason).inc()
        elif isinstance(exc, PassThrough) and exc.answer.status_code >= 500:
            self._metrics.backend_server_errors.labels(backend.role.value, backend.url,
                                                       str(exc.answer.status_code)).inc()

    async def open_decode(self, backend: Backend, request: ClientRequest, params: Optional[dict[str, Any]],
                          extra_headers: Optional[dict[str, str]] = None) -> OpenLeg:
        """The second leg, up to its headers (and, unless streamed, its whole body); `extra_headers`: the
        proxy's own (a peer hint for a decode-only leg)."""
        trial = _begin(backend, "decode")
        started_s = time.perf_counter()
        handed_over = False
        outcome = Outcome.NEUTRAL
        response: Optional[httpx.Response] = None
        try:
            try:
                response = await backend.client.send_leg(backend.client.leg_request(
                    request.path, decode_body(request.body, params), request.request_id, self._decode_timeout,
                    extra_headers))
                if not request.stream or response.status_code != 200:
                    await response.aread()
            except httpx.HTTPError as exc:
                failure = _transport_failure(exc, "decode")
                outcome = Outcome.FAILURE
                self._count(backend, "error", failure.reason)
                raise failure from None
            headers_s = time.perf_counter()
            self._metrics.backend_latency_s.labels("decode", backend.url).observe(headers_s - started_s)
            self._count(backend, status_class(response.status_code))
            if response.status_code == 200:
                handed_over = True
                return OpenLeg(backend, response, started_s, headers_s, trial)
            outcome, exc = self._decode_refusal(backend, response)
            raise exc
        finally:
            if not handed_over:
                if response is not None:
                    await response.aclose()
                backend.end(outcome, trial)

    def _decode_refusal(self, backend: Backend, response: httpx.Response) -> tuple[Outcome, Exception]:
        answer = _answer(response)
        kv_error = KV_RETRY_ERROR_TYPES.get(answer.status_code)
        if kv_error is not None and _error_type(answer.content) == kv_error:
            # Decode itself is fine: the prefill side lost (or never had) the blocks.
            self._metrics.backend_errors.labels("decode", backend.url, kv_error).inc()
            return Outcome.SUCCESS, KVRetry(kv_error, answer)
        outcome, exc = _status_failure(answer, "decode")
        self._count_error(backend, exc)
        return outcome, exc


async def _send_and_read(backend: Backend, request: httpx.Request) -> httpx.Response:
    response = await backend.client.send_leg(request)
    try:
        await response.aread()
    finally:
        await response.aclose()
    return response


def _prefill_answer(response: httpx.Response) -> Optional[PrefillAnswer]:
    try:
        body = response.json()
        params = body.get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict):
        return None
    events = params.pop(FIRST_EVENTS_FIELD, None)  # for the client, not for D: taken off the ticket
    skipped = params.pop(FIRST_EVENTS_SKIPPED_FIELD, None)
    return PrefillAnswer(params, cached_tokens_of(body), parse_prefill_parts(params.get("handoff_s")),
                         events.encode() if isinstance(events, str) and events else None,
                         skipped if isinstance(skipped, str) else None)
