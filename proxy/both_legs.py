"""Both legs at once: the decode leg goes out with the prefill leg, and P's answer follows it to D.

D parses, tokenizes and validates the request while P computes it, then waits (bounded by its own
`--kv-ticket-wait-s`) under a random key of ours; when P answers, the proxy delivers P's
kv_transfer_params to D's `POST /internal/kv/ticket`, and D claims the pin from P as it would from a
sequential leg (D learns the blocks, the prompt digest and the first token only from P).

    proxy ──▶ D  {kv_transfer_params: {do_remote_prefill, awaited_ticket: K}}   D: parse, tokenize, wait(K)
    proxy ──▶ P  prefill leg (as today)                                          P: compute, pin
    P ──▶ proxy  kv_transfer_params ── POST /internal/kv/ticket {K, params} ──▶ D: claim, pull, decode ──▶ proxy

Invariants: when this returns or raises, no leg of its own is left running or open that is not
returned (bar the call-off it sends D in the background); nothing pins or reserves for longer than
the failure it follows:

    P fails (answers an error, dies, times out)   D's leg is called off (its connection closed, a null
                                                  delivery sent): D holds nothing; D then computes
                                                  the prompt itself (colocated fallback) as before
    the client leaves                             both legs are cancelled, D's with them; a pin P made
                                                  already is released unless D may be reading it
    D fails before its ticket                     D read nothing: P's pin goes to another decode worker
                                                  (in turn); D refusing the request itself (a 4xx, its
                                                  own 5xx) ends it: P's leg is closed (P aborts), or
                                                  its pin released where P answered already
    the delivery fails (D restarted, its wait     D's leg is closed, and the pin goes to a sequential
      ran out, an older D)                        decode leg as before
    D fails after its ticket                      as a sequential decode leg's failure (forwarder.py)

A decode worker that refuses the awaited params by name (400 on kv_transfer_params: a release
before concurrent legs) gets the sequential legs instead. The proxy's wire to P is unchanged.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, Optional

import httpx

from proxy.backends import Backend, Outcome
from proxy.errors import ProxyError
from proxy.kv_release import PrefillHold
from proxy.legs import DecodeLost, KVRetry, LegFailed, OpenLeg, PassThrough
from proxy.relay import close_leg

if TYPE_CHECKING:
    from proxy.client_request import ClientRequest

logger = logging.getLogger(__name__)

TICKET_PATH = "/internal/kv/ticket"  # D's (pdserve/server/kv_routes.py); the proxy may not import pdserve/pd
TICKET_KEY_HEX_CHARS = 32
_KV_PARAM = "kv_transfer_params"
# Failures of a decode leg before its ticket after which another decode worker may take the pin.
_RETRY_ELSEWHERE = ("connect", "transport", "breaker_open", "busy", "timeout")


class KVRetryAfterConcurrent(Exception):
    """D could not use the KV of `prefill` (KVRetry): the forwarder prefills again, sequentially."""

    def __init__(self, prefill: Backend, retry: KVRetry):
        super().__init__(retry.reason)
        self.prefill = prefill
        self.retry = retry


def awaited_params(key: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "awaited_ticket": key}


def _refused_by_name(exc: PassThrough) -> bool:
    """A decode worker's 400 about kv_transfer_params: one that does not know awaited tickets."""
    if exc.answer.status_code != 400:
        return False
    try:
        error = json.loads(exc.answer.content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and str(error.get("param") or "").startswith(_KV_PARAM)


class _Delivered(enum.Enum):
    YES = "yes"  # D took the ticket (202)
    REFUSED = "refused"  # D answered otherwise (its wait ended, it restarted, an older release): alive
    UNREACHABLE = "unreachable"  # no answer: D is likely gone


@dataclass(slots=True, eq=False)
class _Trip:
    """One request's concurrent legs while they run."""

    key: str  # the awaited ticket: random, ours, never reused
    decode: Backend
    hold: PrefillHold  # P's pin once it answered (params empty until then, or once another path took it)
    decode_task: "asyncio.Future[OpenLeg]"
    prefill_task: asyncio.Future
    called_off: bool = False  # D's leg was cancelled and told so
    awaiting: bool = True  # D's leg waits for its ticket (counted in `decode.num_awaiting_ticket`)

    def settled(self) -> None:
        """D's leg no longer waits for its ticket (delivered, called off, or it ended)."""
        if self.awaiting:
            self.awaiting = False
            self.decode.num_awaiting_ticket -= 1


@dataclass(frozen=True, slots=True)
class LegOps:
    """What the forwarder (proxy/forwarder.py, which owns the legs' own logic) lends: its one prefill
    (with retries), one decode leg, sequential decode of a pin, colocated fallback, and early release."""

    open_decode: Callable[..., Awaitable[OpenLeg]]  # (backend, request, params, hold)
    prefill: Callable[..., Awaitable[tuple[Backend, dict[str, Any]]]]  # (request, avoid, timing, first)
    decode_holding: Callable[..., Awaitable[OpenLeg]]  # (request, first, hold, avoid)
    colocated: Callable[..., Awaitable[OpenLeg]]  # (request, decode, timing, reason, error, avoid)
    release_unless_read: Callable[[PrefillHold, str], None]
    count: Callable[[str], None] = lambda outcome: None  # pdserve_proxy_concurrent_legs_total{outcome}


class BothLegs:
    """Runs one request's two legs concurrently."""

    def __init__(self, ops: LegOps, delivery_timeout_s: float):
        self._ops = ops
        self._delivery_timeout_s = delivery_timeout_s
        self._background: set[asyncio.Task] = set()

    async def run(self, request: "ClientRequest", decode: Backend, timing: Any,
                  avoid_decode: Collection[str], first_prefill: Optional[Backend]) -> OpenLeg:
        fw = self._ops
        key = secrets.token_hex(TICKET_KEY_HEX_CHARS // 2)
        hold = PrefillHold(decode, {})  # filled with P's answer; `_open_decode` keeps its decode_may_read
        trip = _Trip(key, decode, hold, asyncio.ensure_future(fw.open_decode(decode, request, awaited_params(key),
                                                                                hold)),
                     asyncio.ensure_future(fw.prefill(request, (), timing, first_prefill)))
        decode.num_awaiting_ticket += 1  # routing does not count it as a request D serves yet
        returned: Optional[OpenLeg] = None
        try:
            await asyncio.wait((trip.prefill_task, trip.decode_task), return_when=asyncio.FIRST_COMPLETED)
            if trip.decode_task.done():  # D ended without its ticket (before P answered, or as it did)
                trip.settled()
                returned = await self._decode_ended_first(request, trip, timing, avoid_decode)
                return returned
            try:
                prefill, params = trip.prefill_task.result()
            except ProxyError as error:  # every prefill worker tried failed: call D's leg off at once
                self._call_off(trip, request.request_id)
                returned = await fw.colocated(request, decode, timing, "prefill_failed", error, avoid_decode)
                return returned
            hold.backend, hold.params = prefill, params
            delivered_s = time.perf_counter()
            delivery = await self._deliver(decode, key, params, request.request_id)
            trip.settled()
            fw.count("delivered" if delivery is _Delivered.YES else "in_turn")
            if delivery is _Delivered.YES:
                returned = await self._decoded(request, trip, prefill)
                returned.started_s = delivered_s  # D's leg (handoff, TTFT split) starts when it could go on
                return returned
            await _cancel(trip.decode_task)  # D never had the params: the pin goes to a leg in turn
            hold.params = {}
            again, avoid = (decode, avoid_decode) if delivery is _Delivered.REFUSED else (None, (*avoid_decode,
                                                                                             decode.url))
            returned = await fw.decode_holding(request, again, PrefillHold(prefill, params), avoid)
            return returned
        finally:
            await self._tidy(trip, returned, request.request_id)

    async def _decoded(self, request: "ClientRequest", trip: _Trip, prefill: Backend) -> OpenLeg:
        """D's leg after its ticket: a sequential decode leg's outcomes (forwarder.py `_decode_holding`);
        the pin is released on the way out (`_tidy`) unless D may be reading it."""
        try:
            return await trip.decode_task
        except KVRetry as retry:
            trip.hold.decode_may_read = False  # D answered: it ended the request
            raise KVRetryAfterConcurrent(prefill, retry) from None
        except LegFailed as exc:
            if exc.reason == "transport":
                raise DecodeLost(trip.decode.url, exc.error) from None
            raise exc.error from None

    async def _decode_ended_first(self, request: "ClientRequest", trip: _Trip, timing: Any,
                                  avoid_decode: Collection[str]) -> OpenLeg:
        """D's leg ended before its ticket: D read nothing. Its answer (a worker that did not wait) or its
        refusal of the request is the answer, and the prefill is abandoned; a refusal of the awaited params
        by name, or a failure another decode worker may not share, gets P's pin in turn."""
        decode = trip.decode
        try:
            leg = trip.decode_task.result()
        except PassThrough as exc:
            if not _refused_by_name(exc):
                self._abandon_prefill(trip, request.request_id)
                raise
            logger.info("request %s: decode worker %s takes no concurrent legs; sending them in turn",
                        request.request_id, decode.url)
            self._ops.count("in_turn")
            return await self._in_turn(request, decode, trip, timing, avoid_decode)
        except LegFailed as exc:
            if exc.reason not in _RETRY_ELSEWHERE:
                self._abandon_prefill(trip, request.request_id)
                raise exc.error from None
            logger.warning("request %s: decode leg on %s failed (%s) while the prompt was prefilled; another "
                           "decode worker takes the KV", request.request_id, decode.url, exc.reason)
            self._ops.count("in_turn")
            return await self._in_turn(request, None, trip, timing, (*avoid_decode, decode.url))
        except KVRetry as retry:  # never before a ticket from our decode worker: pass it on as it came
            self._abandon_prefill(trip, request.request_id)
            raise PassThrough(retry.answer) from None
        self._abandon_prefill(trip, request.request_id)  # it answered without P's KV
        return leg

    async def _in_turn(self, request: "ClientRequest", decode: Optional[Backend], trip: _Trip,
                       timing: Any, avoid_decode: Collection[str]) -> OpenLeg:
        """The sequential legs from here: P's answer, then a decode leg with its params."""
        fw = self._ops
        try:
            prefill, params = await trip.prefill_task
        except ProxyError as error:
            return await fw.colocated(request, decode, timing, "prefill_failed", error, avoid_decode)
        return await fw.decode_holding(request, decode, PrefillHold(prefill, params), avoid_decode)

    async def _deliver(self, decode: Backend, key: str, params: Optional[dict[str, Any]],
                       request_id: str) -> "_Delivered":
        """POST the ticket (or, with None, the call-off) to D's internal listener."""
        level = logging.WARNING if params is not None else logging.DEBUG

        def log(request: str, message: str, *args: Any) -> None:
            logger.log(level, "request %s: " + message, request, *args)

        try:
            response = await decode.internal_client.post(
                TICKET_PATH, json={"awaited_ticket": key, _KV_PARAM: params}, timeout=self._delivery_timeout_s)
        except httpx.HTTPError as error:
            log(request_id, "delivering its ticket to %s failed (%s)", decode.url, type(error).__name__)
            return _Delivered.UNREACHABLE
        if response.status_code != 202:  # for a call-off, most likely: D's wait ended with its closed leg
            log(request_id, "%s refused its ticket (HTTP %d)", decode.url, response.status_code)
            return _Delivered.REFUSED
        return _Delivered.YES

    def _call_off(self, trip: _Trip, request_id: str) -> None:
        """Close D's leg (D's wait is cancelled with its connection) and tell D so in the background."""
        if trip.called_off:
            return
        trip.called_off = True
        trip.settled()
        self._ops.count("called_off")
        trip.decode_task.cancel()
        self._spawn(self._deliver(trip.decode, trip.key, None, request_id))

    def _abandon_prefill(self, trip: _Trip, request_id: str) -> None:
        """No decode worker will read this prefill: stop it (closing its leg makes P abort the request, so
        it pins nothing), and free the pin of whatever answer P gave all the same (it answered already, or
        as the leg was closed)."""
        release_unless_read = self._ops.release_unless_read

        def release_if_pinned(task: asyncio.Future) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            prefill, params = task.result()
            release_unless_read(PrefillHold(prefill, params), request_id)

        trip.prefill_task.cancel()
        trip.prefill_task.add_done_callback(release_if_pinned)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tidy(self, trip: _Trip, returned: Optional[OpenLeg], request_id: str) -> None:
        """Whatever way the trip ended: no leg of ours running or open unless it is the answer, and P's
        pin, if this trip still holds it and no leg was returned, released unless D may be reading it."""
        trip.settled()
        decode_task, prefill_task = trip.decode_task, trip.prefill_task
        if not decode_task.done():
            self._call_off(trip, request_id)
        elif not decode_task.cancelled() and decode_task.exception() is None and decode_task.result() is not returned:
            await close_leg(decode_task.result(), Outcome.NEUTRAL)
        if not prefill_task.done():
            self._abandon_prefill(trip, request_id)  # the client left while P computed: P aborts it
        elif not prefill_task.cancelled():
            prefill_task.exception()  # retrieved: whatever P's leg ended with was dealt with above
        if returned is None and trip.hold.params:
            self._ops.release_unless_read(trip.hold, request_id)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._delivery_timeout_s)


async def _cancel(task: asyncio.Future) -> None:
    if task.done():
        if not task.cancelled() and task.exception() is None:
            await close_leg(task.result(), Outcome.NEUTRAL)
        return
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - its end is all we wait for
        pass
