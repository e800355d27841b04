"""The two-leg trip of one client request: route it, prefill, decode, retry, relay.

Where a request goes is `proxy.routing.route.choose_route`'s pure choice over a snapshot of the
pools; this module gathers that snapshot, executes the route and its retries, and counts them.

Invariants: a decode worker is chosen before any prefill work starts (no
decode, no wasted prefill: a quick 503); a failed prefill leg is retried on
another prefill worker; decode's "the KV never arrived" answer re-runs the
prefill (on another worker when there is one) and retries exactly once; the
client's `X-Request-Id` (or a fresh one) goes on both legs and back.

What a process death costs (nothing, where nothing had reached the client):

    no prefill worker available, or every one tried failed (dead, unreachable)
        -> the decode worker computes the prompt itself (colocated fallback, counted)
    the decode worker drops the connection before its answer starts
        -> a fresh prefill (a new pin: the dead worker may have read and released the
           old one, whose pages P may since have reused) and another decode worker, once
    the decode worker dies mid-stream
        -> the stream ends with an error event (proxy/relay.py): bytes already left
    the decode leg fails after P's token 1 went to the client (proxy/early_stream.py)
        -> the same retries as above; the stream that answers must begin with that token 1 (checked:
           a sampled, unseeded token 1 drawn again may differ), else it ends with an error event
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdserve.api.errors import PdserveError
from pdserve.api.handoff import ProxyHandoff, log_fields
from pdserve.api.http_bounds import read_body
from pdserve.api.kv_transfer import KV_RECOMPUTED_HEADER

from proxy.backends import Backend, BackendPool, Outcome, Role
from proxy.client_request import REQUEST_ID_HEADER, ClientRequest, choose_request_id, parse_client_request
from proxy.config import ProxyConfig
from proxy.errors import NoBackendAvailable, ProxyError, RejectedRequest, error_response
from proxy.early_stream import EarlyFirstToken, EarlyStreamResponse
from proxy.kv_release import KVReleaser, PrefillHold
from proxy.both_legs import BothLegs, KVRetryAfterConcurrent, LegOps
from proxy.legs import DecodeLost, KVRetry, LegFailed, LegSender, OpenLeg, PassThrough, cached_tokens_of
from proxy.metrics import ProxyMetrics, status_class
from proxy.slo import SloTracker, client_key
from proxy.relay import ClientGone, RelayStreamResponse, StreamTiming, close_leg, until_client_disconnects
from proxy.routing.candidates import Candidate, Pick, RoleTurns, RouteRequest
from proxy.routing.disaggregation import ArrivalRate, PrefillSpeed
from proxy.routing.kv_routing import KVRouting
from proxy.routing.peer_hints import PeerHints
from proxy.routing.policies import RoutingPolicy
from proxy.routing.route import (DECODE_ONLY, DISAGGREGATED, NO_PREFILL, SKIPPED_DECODE_CACHED, Route, RouteSettings,
                                 RouteSignals, choose_route, pick_prefill, pick_worker, request_mode)

logger = logging.getLogger(__name__)

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's routing sidecar names the prefill worker so
# A decode leg that failed these ways reached its worker, which may still be reading the KV.
_MAY_STILL_READ = ("timeout", "transport")
# Failures of the connection, not of the worker's answer: the same worker may be tried again.
_CONNECTION_FAILURES = ("connect", "transport")
# A decode leg that failed this way reached its worker, which then dropped the connection before
# answering (it died): nothing reached the client, so the request may start over elsewhere.
_DECODE_LOST = "transport"


@dataclass(slots=True)
class RequestTiming:
    """Where a request's time to first byte went (perf_counter seconds)."""

    arrival_s: float
    mode: str
    prefill_s: float = 0.0  # the prefill leg(s), retries included
    wasted_s: float = 0.0  # decode legs that ended in a KV retry
    handoff: ProxyHandoff = field(init=False)  # the components of its handoff (pdserve/api/handoff.py)
    early: Optional[EarlyFirstToken] = None  # a streamed request's token 1 from P (proxy/early_stream.py)

    def __post_init__(self) -> None:
        self.handoff = ProxyHandoff(self.arrival_s)


class Forwarder:
    def __init__(self, config: ProxyConfig, prefill_pool: BackendPool, decode_pool: BackendPool,
                 metrics: ProxyMetrics, kv: Optional[KVRouting] = None):
        self._config = config
        self._prefill_pool = prefill_pool
        self._decode_pool = decode_pool
        self._settings = RouteSettings.from_config(config)
        self._turns = {Role.PREFILL: RoleTurns(), Role.DECODE: RoleTurns()}  # advanced as picks are executed
        self._sender = LegSender(metrics, config.timeouts)
        self._releaser = KVReleaser(metrics, config.health.timeout_s)
        self._metrics = metrics
        self._kv = kv  # set when a role's policy is kv_aware, or with peer hints
        self._hints = (PeerHints(kv, (prefill_pool, decode_pool), config.routing.peer_pull_margin_tokens,
                                 metrics.registry)
                       if kv is not None and config.routing.peer_pull else None)
        self._slo = SloTracker(self._settings.slo, metrics.slo_requests, metrics.slo_attainment)
        # Seconds per prompt token of each role's prefill, from legs that had their worker to themselves.
        self._speeds = {Role.PREFILL: PrefillSpeed(), Role.DECODE: PrefillSpeed()}
        self._arrivals = ArrivalRate()
        ops = LegOps(self._open_decode, self._prefill, self._decode_holding, self._colocated,
                     self._releaser.release_unless_read, lambda outcome: metrics.concurrent_legs.labels(outcome).inc())
        self._both_legs = BothLegs(ops, config.health.timeout_s) if config.concurrent_legs else None

    async def handle(self, raw: Request, path: str) -> Response:
        arrival_s = time.perf_counter()
        request_id: Optional[str] = None
        timing = RequestTiming(arrival_s, DECODE_ONLY)
        try:
            request_id = choose_request_id(raw.headers.get(REQUEST_ID_HEADER))
            request = parse_client_request(path, await self._read_body(raw), request_id,
                                           self._config.routing.chars_per_token, self._config.limits)
            request.prefill_url = self._named_prefill(raw.headers.get(PREFILLER_HEADER))
            request.client_key = client_key(raw.headers.get("authorization"),
                                            raw.client.host if raw.client is not None else None)
            if self._kv is not None:
                await self._kv.prepare(request)
            facts = self._route_request(request)
            timing.mode = request_mode(facts, self._settings)
            if self._config.early_first_token and request.stream and request.body.get("n") in (None, 1):
                request.want_first_events = True
                timing.early = EarlyFirstToken()
                opened = await until_client_disconnects(raw.receive, self._legs_or_early(request, facts, timing))
                if isinstance(opened, asyncio.Task):
                    return self._counted(timing.mode, self._respond_early(request, opened, timing))
                leg = opened
            else:
                leg = await until_client_disconnects(raw.receive, self._run_legs(request, facts, timing))
        except ProxyError as exc:
            return self._counted(timing.mode, error_response(exc, request_id, self._config.retry_after_s))
        except PassThrough as exc:
            answer = exc.answer
            headers = {REQUEST_ID_HEADER: request_id}
            if answer.status_code == 503:
                headers["Retry-After"] = str(self._config.retry_after_s)
            return self._counted(timing.mode, Response(answer.content, answer.status_code,
                                                       media_type=answer.content_type, headers=headers))
        except ClientGone:
            logger.info("request %s: client disconnected before the answer started", request_id)
            return self._counted(timing.mode, Response(status_code=499))
        except Exception:  # noqa: BLE001 - our bug, not the client's: a logged 500 that names the request
            logger.exception("request %s failed in the proxy", request_id)
            return self._counted(timing.mode, error_response(ProxyError("internal proxy error"), request_id,
                                                             self._config.retry_after_s))
        return self._counted(timing.mode, self._respond(request, leg, timing))

    def _named_prefill(self, host_port: Optional[str]) -> Optional[str]:
        """The prefill backend an llm-d style `x-prefiller-host-port` header names, when it is one this
        proxy knows; anything else is ignored, exactly as a known backend that is unavailable is: the
        proxy never connects to an address a client chose, and the answer never tells a client which
        addresses are backends (an unknown name and an unhealthy backend route alike)."""
        if host_port is None:
            return None
        wanted = host_port.strip().lower()
        for backend in self._prefill_pool.backends():
            if backend.url.split("://", 1)[-1].lower() == wanted:
                return backend.url
        return None

    async def _read_body(self, raw: Request) -> bytes:
        try:
            return await read_body(raw, self._config.limits)
        except PdserveError as error:  # too large (413) or too slow (408): as a worker would answer
            raise RejectedRequest(error) from None
        except ClientDisconnect:
            raise ClientGone() from None

    async def aclose(self) -> None:
        if self._both_legs is not None:
            await self._both_legs.aclose()
        await self._releaser.aclose()

    def _counted(self, mode: str, response: Response) -> Response:
        self._metrics.requests.labels(mode, status_class(response.status_code)).inc()
        return response

    @staticmethod
    def _num_prompt_tokens(request: ClientRequest) -> int:
        blocks = request.kv_route.blocks if request.kv_route is not None else None
        return blocks.num_tokens if blocks is not None else request.num_prompt_tokens  # exact if known

    # ---- the route's signals, and its picks executed -----------------------------------------

    def _route_request(self, request: ClientRequest) -> RouteRequest:
        blocks_known = self._kv is not None and self._kv.blocks_known(request)
        return RouteRequest(self._num_prompt_tokens(request), request.prefix_key(self._config.routing.prefix_chars),
                            request.needs_local_prompt, request.prefill_url, blocks_known)

    def _candidates(self, role: Role, request: ClientRequest) -> tuple[Candidate, ...]:
        """Every worker of the role as it is now, with the KV index's prediction where kv_aware routes it."""
        kv = self._kv if self._kv is not None and self._kv.handles(role) else None
        return tuple(Candidate.of(b, kv.cached_prefix(b.url, request) if kv is not None and b.is_available() else None)
                     for b in self._pool(role).backends())

    def _signals(self, request: ClientRequest) -> RouteSignals:
        return RouteSignals(self._candidates(Role.DECODE, request), self._candidates(Role.PREFILL, request),
                            self._turns[Role.DECODE], self._turns[Role.PREFILL],
                            self._speeds[Role.PREFILL].s_per_token, self._speeds[Role.DECODE].s_per_token,
                            self._arrivals.per_s)

    def _take(self, role: Role, request: ClientRequest, pick: Optional[Pick]) -> Optional[Backend]:
        """Execute a pick: its rotation advances, kv_aware keeps its prediction; the backend it names."""
        if pick is None:
            return None
        self._turns[role] = self._turns[role].after(pick)
        if self._kv is not None and self._kv.handles(role):
            self._kv.record(role, request, pick)
        return self._pool(role).get(pick.url)

    def _count_route(self, route: Route) -> None:
        if route.reason == SKIPPED_DECODE_CACHED and self._kv is not None:
            self._kv.record_skipped_prefill()
        if route.decision is not None:
            self._metrics.disaggregation.labels(route.decision.where, route.decision.reason).inc()

    def _pick(self, role: Role, request: ClientRequest, exclude_urls: Collection[str] = ()) -> Optional[Backend]:
        pick = pick_worker(self._policy(role), self._route_request(request), self._candidates(role, request),
                           self._turns[role], exclude_urls)
        return self._take(role, request, pick)

    def _pool(self, role: Role) -> BackendPool:
        return self._prefill_pool if role is Role.PREFILL else self._decode_pool

    def _policy(self, role: Role) -> RoutingPolicy:
        return self._settings.prefill_policy if role is Role.PREFILL else self._settings.decode_policy

    def _unavailable(self, role: Role) -> NoBackendAvailable:
        self._metrics.rejected.labels(role.value).inc()
        return NoBackendAvailable(f"no {role.value} worker is available; retry later")

    async def _legs_or_early(self, request: ClientRequest, facts: RouteRequest,
                             timing: RequestTiming) -> "OpenLeg | asyncio.Task[OpenLeg]":
        """The request's legs in a task of their own: the open decode leg when it comes first, or the
        task itself once P's token-1 events are in (the response then sends them and awaits the leg)."""
        early = timing.early
        legs = asyncio.ensure_future(self._run_legs(request, facts, timing))
        try:
            await asyncio.wait({legs, early.ready}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the client left): the legs go too, a leg they opened is closed
            legs.cancel()
            await asyncio.wait({legs})
            if not legs.cancelled() and legs.exception() is None:
                await close_leg(legs.result(), Outcome.NEUTRAL)
            raise
        if early.ready.done():
            return legs
        if early.declined is not None:
            self._metrics.early_first_token.labels("not_offered", early.declined).inc()
        return legs.result()

    async def _run_legs(self, request: ClientRequest, facts: RouteRequest, timing: RequestTiming) -> OpenLeg:
        self._arrivals.observe()
        route = choose_route(facts, self._signals(request), self._settings)
        decode = self._take(Role.DECODE, request, route.decode)
        if decode is None:
            raise self._unavailable(Role.DECODE)
        self._count_route(route)
        if route.reason == NO_PREFILL:
            return await self._colocated(request, decode, timing, NO_PREFILL)
        if route.mode == DECODE_ONLY:
            timing.mode = DECODE_ONLY
            return await self._decode(request, decode, None)
        first_prefill = self._take(Role.PREFILL, request, route.prefill)
        try:
            return await self._disaggregated(request, decode, timing, (), first_prefill)
        except DecodeLost as lost:
            logger.warning("request %s: decode worker %s dropped it before answering; prefilling again for "
                           "another one", request.request_id, lost.url)
            self._metrics.retries.labels(Role.DECODE.value, _DECODE_LOST).inc()
            dead_url = lost.url
        try:
            return await self._disaggregated(request, None, timing, (dead_url,))
        except DecodeLost as again:
            raise again.error from None

    async def _disaggregated(self, request: ClientRequest, decode: Optional[Backend], timing: RequestTiming,
                             avoid_decode: Collection[str], first_prefill: Optional[Backend] = None) -> OpenLeg:
        """Prefill (first on `first_prefill`, the route's), then decode on `decode` (or a worker not in
        `avoid_decode`); a decode that cannot read the KV gets one more prefill; with no prefill possible,
        the decode worker computes the prompt. With concurrent legs (and a decode worker chosen) the first
        decode leg goes out with the first prefill leg (proxy/both_legs.py)."""
        decode_started_s = time.perf_counter()
        if self._both_legs is not None and decode is not None:
            try:
                return await self._both_legs.run(request, decode, timing, avoid_decode, first_prefill)
            except KVRetryAfterConcurrent as concurrent:
                prefill, exc = concurrent.prefill, concurrent.retry
        else:
            try:
                prefill, params = await self._prefill(request, (), timing, first_prefill)
            except ProxyError as error:
                return await self._colocated(request, decode, timing, "prefill_failed", error, avoid_decode)
            decode_started_s = time.perf_counter()
            try:
                return await self._decode_holding(request, decode, PrefillHold(prefill, params), avoid_decode)
            except KVRetry as retry:
                exc = retry
        timing.wasted_s += time.perf_counter() - decode_started_s
        logger.warning("request %s: decode answered %s for KV from %s; prefilling again",
                       request.request_id, exc.reason, prefill.url)
        if exc.reason == "kv_pull_failed":
            prefill.breaker.record_failure()  # its blocks could not be read: suspect the worker
        self._metrics.retries.labels(Role.PREFILL.value, exc.reason).inc()
        try:
            second, params = await self._prefill(request, (prefill.url,), timing)
        except ProxyError as error:
            return await self._colocated(request, None, timing, "prefill_failed", error, avoid_decode)
        try:
            return await self._decode_holding(request, None, PrefillHold(second, params), avoid_decode)
        except KVRetry as again:
            raise PassThrough(again.answer) from None

    async def _colocated(self, request: ClientRequest, decode: Optional[Backend], timing: RequestTiming,
                         reason: str, error: Optional[ProxyError] = None,
                         avoid_decode: Collection[str] = ()) -> OpenLeg:
        """No prefill worker can take the request: a decode worker computes the prompt itself."""
        if not self._config.colocated_fallback:
            raise error or self._unavailable(Role.PREFILL)
        logger.warning("request %s: no prefill worker could take it (%s); the decode worker computes the prompt",
                       request.request_id, reason)
        self._metrics.colocated_fallbacks.labels(reason).inc()
        timing.mode = DECODE_ONLY
        return await self._decode(request, decode, None, avoid_urls=avoid_decode)

    async def _decode_holding(self, request: ClientRequest, first: Optional[Backend], hold: PrefillHold,
                              avoid_urls: Collection[str] = ()) -> OpenLeg:
        """The decode leg of a prefill's KV; if it ends without a decode worker reading the KV (refused,
        answered with an error, never sent, or the client left first), the prefill worker frees it now."""
        try:
            return await self._decode(request, first, hold.params, hold, avoid_urls)
        except BaseException:
            self._releaser.release_unless_read(hold, request.request_id)
            raise

    async def _prefill(self, request: ClientRequest, avoid_urls: Collection[str], timing: RequestTiming,
                       first: Optional[Backend] = None) -> tuple[Backend, dict[str, Any]]:
        started_s = time.perf_counter()
        tried: set[str] = set()
        last: Optional[LegFailed] = None
        try:
            for attempt in range(self._config.max_prefill_attempts):
                backend = first if attempt == 0 and first is not None else \
                    self._pick_prefill(request, tried, avoid_urls, last)
                if backend is None:
                    break
                if last is not None:
                    self._metrics.retries.labels(Role.PREFILL.value, last.reason).inc()
                try:
                    answer = await self._timed_prefill(backend, request, timing.handoff)
                except LegFailed as exc:
                    logger.warning("request %s: prefill leg on %s failed (%s)", request.request_id,
                                   backend.url, exc.reason)
                    tried.add(backend.url)
                    last = exc
                    continue
                if self._kv is not None:
                    self._kv.observe(Role.PREFILL, request, backend, answer.num_cached_tokens)
                if timing.early is not None:
                    timing.early.offer(answer.first_events, answer.first_events_skipped)
                return backend, answer.kv_transfer_params
        finally:
            timing.prefill_s += time.perf_counter() - started_s
        if last is None:
            raise self._unavailable(Role.PREFILL)
        raise last.error

    async def _timed_prefill(self, backend: Backend, request: ClientRequest,
                             handoff: Optional[ProxyHandoff] = None) -> Any:
        """A prefill leg, its prompt counted in the worker's backlog while it runs; a leg that had the
        worker to itself is a sample of the prefill speed; its times go into `handoff`."""
        num_tokens = self._num_prompt_tokens(request)
        alone = backend.num_in_flight == 0
        started_s = time.perf_counter()
        if handoff is not None and handoff.prefill_sent_s is None:
            handoff.prefill_sent_s = started_s
        backend.prompt_tokens_in_flight += num_tokens
        if self._hints is not None:
            request.peer_hint_headers = self._hints.headers_for(backend, request)
        try:
            answer = await self._sender.prefill(backend, request)
        finally:
            backend.prompt_tokens_in_flight -= num_tokens
        answered_s = time.perf_counter()
        if handoff is not None:
            handoff.prefill_answered(answered_s - started_s, answered_s, answer.handoff_s)
        computed = num_tokens - (answer.num_cached_tokens or 0)  # the worker's count of its cached prefix
        if alone and computed > 0:
            self._speeds[Role.PREFILL].observe(computed, time.perf_counter() - started_s)
        return answer

    def _pick_prefill(self, request: ClientRequest, tried: set[str], avoid_urls: Collection[str],
                      last: Optional[LegFailed]) -> Optional[Backend]:
        """`pick_prefill` on the pool as it is now: a worker whose connection failed may be tried again."""
        pick = pick_prefill(self._settings.prefill_policy, self._route_request(request),
                            self._candidates(Role.PREFILL, request), self._turns[Role.PREFILL], tried, avoid_urls,
                            may_retry_tried=last is not None and last.reason in _CONNECTION_FAILURES)
        return self._take(Role.PREFILL, request, pick)

    async def _decode(self, request: ClientRequest, first: Optional[Backend],
                      params: Optional[dict[str, Any]], hold: Optional[PrefillHold] = None,
                      avoid_urls: Collection[str] = ()) -> OpenLeg:
        """Open the decode leg; a worker that never saw the request is replaced by another one, and so
        is one that dropped it before answering when it held no prefill's KV (nothing to re-read).
        With a prefill's KV, such a drop raises `DecodeLost`: the retry needs a fresh prefill."""
        tried: set[str] = set(avoid_urls)
        last: Optional[LegFailed] = None
        backend = first
        for _ in range(self._config.max_decode_attempts):
            if backend is None:
                backend = self._pick(Role.DECODE, request, tried)
                if backend is None:
                    break
            if last is not None:
                self._metrics.retries.labels(Role.DECODE.value, last.reason).inc()
            try:
                return await self._open_decode(backend, request, params, hold)
            except LegFailed as exc:
                logger.warning("request %s: decode leg on %s failed (%s)", request.request_id,
                               backend.url, exc.reason)
                if exc.delivered and exc.reason == _DECODE_LOST and params is not None:
                    raise DecodeLost(backend.url, exc.error) from None
                if exc.delivered and exc.reason != _DECODE_LOST:  # it may be at work still: not safe to replay
                    raise exc.error from None
                tried.add(backend.url)
                last = exc
                backend = None
        if last is None:
            raise self._unavailable(Role.DECODE)
        raise last.error

    async def _open_decode(self, backend: Backend, request: ClientRequest, params: Optional[dict[str, Any]],
                           hold: Optional[PrefillHold]) -> OpenLeg:
        """One decode leg; `hold.decode_may_read` is true from its sending until a definite refusal."""
        computes_prompt = hold is None
        hold = hold or PrefillHold(backend, {})  # decode-only: nothing pinned, the flag is unused
        hold.decode_may_read = True
        num_tokens = self._num_prompt_tokens(request) if computes_prompt else 0
        alone = backend.num_in_flight == 0
        backend.prompt_tokens_in_flight += num_tokens
        # A decode worker that computes the prompt itself may pull its prefix from a peer (P or D) too.
        hint = self._hints.headers_for(backend, request) if computes_prompt and self._hints is not None else None
        try:
            leg = await self._sender.open_decode(backend, request, params, hint)
            cached = self._predicted_cached_tokens(request, backend)
            if computes_prompt and alone and request.stream and cached is not None and num_tokens > cached:
                # its headers came with the first token
                self._speeds[Role.DECODE].observe(num_tokens - cached, leg.headers_s - leg.started_s)
            if params is not None and leg.response.headers.get(KV_RECOMPUTED_HEADER) == "1":
                self._metrics.pd_legs_recomputed.inc()  # the silent-recompute alarm's proxy side
            return leg
        except (KVRetry, PassThrough):
            hold.decode_may_read = False  # the decode worker answered: it ended the request
            raise
        except LegFailed as exc:
            hold.decode_may_read = exc.reason in _MAY_STILL_READ
            raise
        finally:
            backend.prompt_tokens_in_flight -= num_tokens

    @staticmethod
    def _predicted_cached_tokens(request: ClientRequest, backend: Backend) -> Optional[int]:
        """The KV index's prediction of `backend`'s prefix hit for this request; None where it made none.
        A streamed decode leg's usage comes only at its end, so its speed sample subtracts this instead,
        and without a prediction it takes none: D's rate then defaults to P's."""
        route = request.kv_route
        return route.predicted.get(backend.url) if route is not None else None

    def _respond_early(self, request: ClientRequest, legs: "asyncio.Task[OpenLeg]",
                       timing: RequestTiming) -> EarlyStreamResponse:
        """P's token-1 events go out now; D's stream follows once `legs` opened it."""
        self._metrics.early_first_token.labels("sent", "").inc()
        handoff = timing.handoff
        handoff.decode_sent_s = handoff.decode_first_byte_s = handoff.prefill_answered_s  # token 1's source: P

        def on_first_written(now_s: float) -> None:
            handoff.client_first_byte_s = now_s
            to_first_byte_s = now_s - timing.arrival_s
            self._metrics.ttft_s.labels(timing.mode).observe(to_first_byte_s)
            self._metrics.ttft_prefill_s.observe(timing.prefill_s)
            self._publish_handoff(request, timing)

        def on_leg(leg: OpenLeg, first_byte_s: float) -> None:
            self._metrics.ttft_decode_s.labels(timing.mode).observe(first_byte_s - leg.started_s)

        def on_complete(stream: StreamTiming) -> None:
            if stream.first_s is not None:
                self._slo.observe(self._num_prompt_tokens(request), stream.first_s - timing.arrival_s,
                                  stream.mean_gap_s, request.client_key)

        return EarlyStreamResponse(timing.early.ready.result(), legs, {REQUEST_ID_HEADER: request.request_id},
                                   lambda outcome: self._metrics.early_first_token.labels(outcome, "").inc(),
                                   on_first_written, on_leg, on_complete, self._config.timeouts.client_send_s)

    def _respond(self, request: ClientRequest, leg: OpenLeg, timing: RequestTiming) -> Response:
        headers = {REQUEST_ID_HEADER: request.request_id}
        timing.handoff.decode_sent_s = leg.started_s
        if request.stream:
            errors = self._metrics.backend_errors

            def on_broken(reason: str) -> None:
                errors.labels(Role.DECODE.value, leg.backend.url, reason).inc()

            def on_complete(stream: StreamTiming) -> None:
                if stream.first_s is not None:
                    self._slo.observe(self._num_prompt_tokens(request), stream.first_s - timing.arrival_s,
                                      stream.mean_gap_s, request.client_key)

            def on_first_written(now_s: float) -> None:
                timing.handoff.client_first_byte_s = now_s
                self._publish_handoff(request, timing)

            return RelayStreamResponse(leg, lambda now_s: self._observe(timing, leg, now_s, True), on_broken, headers,
                                       on_complete=on_complete, on_first_written=on_first_written,
                                       send_timeout_s=self._config.timeouts.client_send_s)
        leg.finish(Outcome.SUCCESS)  # the whole body is in: the leg is over
        self._observe(timing, leg, time.perf_counter(), False)
        self._publish_handoff(request, timing)
        if self._kv is not None and self._kv.handles(Role.DECODE):
            self._observe_decode_cache(request, leg)
        media_type = leg.response.headers.get("content-type", "application/json")
        return Response(leg.response.content, status_code=200, media_type=media_type, headers=headers)

    def _observe_decode_cache(self, request: ClientRequest, leg: OpenLeg) -> None:
        """Decode's own cached-token count (a non-streamed answer is in memory already)."""
        try:
            answer = json.loads(leg.response.content)
        except ValueError:
            return
        self._kv.observe(Role.DECODE, request, leg.backend, cached_tokens_of(answer))

    def _observe(self, timing: RequestTiming, leg: OpenLeg, first_byte_s: float, streamed: bool) -> None:
        """Split the time to first byte into prefill, decode (transfer + first token) and proxy overhead."""
        metrics = self._metrics
        timing.handoff.decode_first_byte_s = first_byte_s
        to_first_byte_s = first_byte_s - timing.arrival_s
        decode_s = first_byte_s - leg.started_s
        metrics.overhead_s.labels(timing.mode).observe(
            max(0.0, to_first_byte_s - timing.prefill_s - timing.wasted_s - decode_s))
        if streamed:
            metrics.ttft_s.labels(timing.mode).observe(to_first_byte_s)
            metrics.ttft_decode_s.labels(timing.mode).observe(decode_s)
            if timing.mode == DISAGGREGATED:
                metrics.ttft_prefill_s.observe(timing.prefill_s)

    def _publish_handoff(self, request: ClientRequest, timing: RequestTiming) -> None:
        """The request's handoff components: one histogram sample each and one log line with them all."""
        parts = timing.handoff.parts()
        histogram = self._metrics.handoff_s
        for component, seconds in parts.items():
            histogram.labels(timing.mode, component).observe(seconds)
        if logger.isEnabledFor(logging.INFO):  # the fields cost a little: none at --log-level warning
            logger.info("request %s: handoff mode=%s %s", request.request_id, timing.mode, log_fields(parts))
