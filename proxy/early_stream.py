"""The early first token: a streamed P/D request's token 1 reaches the client as soon as P answered.

P builds token 1's stream events itself (pdserve/server/first_events.py: chat's role chunk, token 1's
chunk, exactly what a colocated worker streams first) when the prefill leg asks. The proxy writes them
to the client at once, then relays D's stream with the same events taken off its head:

    client ◀── P's events (role, token 1) ◀── proxy ◀── P's answer {kv_transfer_params, first_events}
    client ◀── D's stream less its head ◀────── proxy ◀── D: pull, token 1 (stripped), token 2, ...

Why the proxy strips rather than D suppressing: D stays exactly as it is (vLLM's two-leg proxy and the
llm-d sidecar see a worker that emits token 1, the default), concurrent and sequential legs need the
same nothing, and the proxy *checks* what it strips: each of D's head events must equal P's but for
`id`, `created` and logprob values (D's own usage, stop checks and detokenizer state count token 1 as
always, so `completion_tokens` counts it once). Where D's `id`/`created` differ from P's (another
second, an id suffixed on one worker), the rest of D's events get P's, event by event, so the client
sees one identity. Once P's events went out, the forwarder's retries stay as they were (a prefill
again on another P, another decode worker): the check is what keeps the client's stream whole, since a
retried P may sample another token 1 (sampled, not seeded; a D that recomputes the prompt after a
failed pull keeps P's token, pdserve/pd/first_token.py):

    D's head events differ (another token 1)                   -> error event, stream ends (mismatch)
    the decode leg fails for good, or D's stream breaks        -> error event, stream ends (decode_failed)
    the client leaves                                          -> the legs are cancelled, D's closed
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Mapping, Optional

import httpx
from starlette.types import Receive, Scope, Send

from proxy.backends import Outcome
from proxy.errors import ProxyError
from proxy.legs import OpenLeg, PassThrough
from proxy.relay import (
    ClientGone, ClientStalled, DisconnectWatch, StreamTiming, bounded_send, close_leg, error_event, stream_headers,
)

logger = logging.getLogger(__name__)

_EVENT_END = b"\n\n"
_DATA = b"data: "


class FirstEventsMismatch(Exception):
    """D's stream did not begin with the events the client already has."""


# Why P gave no events (pdserve/server/first_events.py), as the metric's `reason` label; an answer that
# names none or another (an older P that ignores the ask) counts as "unnamed": the label set stays fixed.
SKIP_REASONS = frozenset({"n_choices", "echo", "grammar", "ends_at_one", "held_back"})


class EarlyFirstToken:
    """One request's channel from its prefill leg to the response: P's events, offered at most once."""

    def __init__(self) -> None:
        self.ready: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.declined: Optional[str] = None  # a prefill leg answered without events (why): D streams token 1

    def offer(self, events: Optional[bytes], skipped: Optional[str] = None) -> None:
        if self.ready.done():
            return
        if events is None:
            self.declined = skipped if skipped in SKIP_REASONS else "unnamed"
        else:
            self.ready.set_result(events)


def _events(data: bytes) -> list[bytes]:
    return [event for event in data.split(_EVENT_END) if event.strip()]


def _payload(event: bytes) -> Any:
    body = event.strip()
    if not body.startswith(_DATA.strip()):
        return None
    try:
        return json.loads(body[len(_DATA.strip()):])
    except ValueError:
        return None


def _shape(value: Any) -> Any:
    """What must match between P's and D's head events: everything but ids, times and float values."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items() if key not in ("id", "created")}
    if isinstance(value, list):
        return [_shape(item) for item in value]
    return None if isinstance(value, float) else value


class HeadStrip:
    """Takes P's events off the head of D's byte stream, checking them, and gives the rest P's identity.

    `feed(chunk)` returns the bytes to forward; event boundaries are found across chunks."""

    def __init__(self, early_events: bytes):
        self._expected = [_payload(event) for event in _events(early_events)]
        first = self._expected[0] if self._expected else None
        self._identity = (first.get("id"), first.get("created")) if isinstance(first, dict) else (None, None)
        self._buffer = b""
        self._rewrite: Optional[tuple[tuple[bytes, bytes], ...]] = None  # D's -> P's identity bytes
        self.stripping = bool(self._expected)

    def feed(self, chunk: bytes) -> bytes:
        if not self.stripping and self._rewrite is None:
            return chunk
        self._buffer += chunk
        cut = self._buffer.rfind(_EVENT_END)
        if cut < 0:
            return b""
        complete, self._buffer = self._buffer[: cut + len(_EVENT_END)], self._buffer[cut + len(_EVENT_END):]
        out = []
        for event in _events(complete):
            if self.stripping and not self._check(event):
                continue
            out.append(self._identified(event) + _EVENT_END)
        forwarded = b"".join(out)
        if not self.stripping and self._rewrite is None:  # nothing to rewrite: the rest passes as it is
            forwarded, self._buffer = forwarded + self._buffer, b""
        return forwarded

    def rest(self) -> bytes:
        """What is left when D's stream ends (an unterminated tail, forwarded as it is)."""
        rest, self._buffer = self._buffer, b""
        return self._identified(rest) if rest and not self.stripping else rest

    def _check(self, event: bytes) -> bool:
        """Takes one of D's head events; True for D's own error event, which ends the stripping and is
        forwarded as D sent it (the client learns why D failed)."""
        payload = _payload(event)
        if isinstance(payload, dict) and "error" in payload and "choices" not in payload:
            self.stripping = False
            return True
        expected = self._expected.pop(0)
        if not isinstance(payload, dict) or _shape(payload) != _shape(expected):
            raise FirstEventsMismatch(event[:200].decode("utf-8", "replace"))
        if not self._expected:
            self.stripping = False
            self._rewrite = self._rewrites(payload.get("id"), payload.get("created"))
        return False

    def _rewrites(self, d_id: Any, d_created: Any) -> Optional[tuple[tuple[bytes, bytes], ...]]:
        p_id, p_created = self._identity
        pairs = []
        if d_id != p_id and isinstance(d_id, str) and isinstance(p_id, str):
            pairs.append((b'"id":' + json.dumps(d_id).encode(), b'"id":' + json.dumps(p_id).encode()))
        if d_created != p_created and isinstance(d_created, int) and isinstance(p_created, int):
            pairs.append((b'"created":%d' % d_created, b'"created":%d' % p_created))
        return tuple(pairs) or None

    def _identified(self, event: bytes) -> bytes:
        # A JSON string escapes its quotes, so `"id":` and `"created":` match keys only, never text.
        for old, new in self._rewrite or ():
            event = event.replace(old, new, 1)
        return event


def failure_message(exc: BaseException) -> str:
    """The text of the error event for a decode leg that failed after token 1 went out."""
    if isinstance(exc, ProxyError):
        return exc.message
    if isinstance(exc, PassThrough):
        try:
            error = json.loads(exc.answer.content).get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return error["message"]
        except (ValueError, AttributeError):
            pass
        return f"the decode worker answered HTTP {exc.answer.status_code}"
    return "the decode leg failed"


class EarlyStreamResponse:
    """An ASGI response: P's token-1 events at once, then D's stream (its head stripped) once its leg opens.

    `legs` is the task running the request's legs (its result: the open decode leg); it is cancelled,
    and a leg it opened closed, however the exchange ends."""

    def __init__(self, events: bytes, legs: "asyncio.Task[OpenLeg]", headers: Mapping[str, str],
                 count: Callable[[str], None], on_first_written: Callable[[float], None],
                 on_leg: Callable[[OpenLeg, float], None], on_complete: Callable[[StreamTiming], None],
                 send_timeout_s: float = 30.0):
        """`count(outcome)`: pdserve_proxy_early_first_token_total; `on_leg(leg, first_byte_s)`: D's first
        byte arrived; `on_complete`: the stream ended well (its timing counts P's events as the first)."""
        self.status_code = 200
        self._events = events
        self._legs = legs
        self._count = count
        self._on_first_written = on_first_written
        self._on_leg = on_leg
        self._on_complete = on_complete
        self._send_timeout_s = send_timeout_s
        self._timing = StreamTiming()
        self._raw_headers = stream_headers("text/event-stream; charset=utf-8", headers)

    async def __call__(self, scope: Scope, receive: Receive, raw_send: Send) -> None:
        watch = DisconnectWatch(receive)
        leg: Optional[OpenLeg] = None
        outcome = Outcome.NEUTRAL

        send = bounded_send(raw_send, self._send_timeout_s)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
            self._timing.saw(self._events, time.perf_counter())
            await send({"type": "http.response.body", "body": self._events, "more_body": True})
            self._on_first_written(time.perf_counter())
            try:
                leg = await self._legs
            except (ProxyError, PassThrough, Exception) as exc:  # noqa: BLE001 - every failure ends the stream
                if not isinstance(exc, (ProxyError, PassThrough)):
                    logger.exception("the decode leg of an early-token stream failed in the proxy")
                self._count("decode_failed")
                await send({"type": "http.response.body", "body": error_event(failure_message(exc)),
                            "more_body": True})
            else:
                outcome = await self._relay(leg, send)
                await close_leg(leg, outcome)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            try:
                watch.absorb()
            except ClientGone:
                logger.debug("client of an early-token stream disconnected")
                return
            raise
        except OSError:
            logger.debug("client of an early-token stream disconnected")
        except ClientStalled:
            logger.warning("a streaming client took nothing for %g s; dropping it", self._send_timeout_s)
        finally:
            watch.stop()
            await self._settle(leg, outcome)

    async def _settle(self, leg: Optional[OpenLeg], outcome: Outcome) -> None:
        """The legs task ended (cancelled if it still ran); the decode leg it opened is closed."""
        if not self._legs.done():
            self._legs.cancel()
            await asyncio.wait({self._legs})
        if leg is None and not self._legs.cancelled() and self._legs.exception() is None:
            leg = self._legs.result()
        if leg is not None:
            await close_leg(leg, outcome)

    async def _relay(self, leg: OpenLeg, send: Send) -> Outcome:
        strip = HeadStrip(self._events)
        first = True
        try:
            async for chunk in leg.response.aiter_raw():
                if first and chunk:
                    first = False
                    self._on_leg(leg, time.perf_counter())
                out = strip.feed(chunk)
                if out:
                    self._timing.saw(out, time.perf_counter())
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            rest = strip.rest()
            if rest:
                await send({"type": "http.response.body", "body": rest, "more_body": True})
        except FirstEventsMismatch as mismatch:
            logger.warning("decode %s began its stream otherwise than P's token 1: %s", leg.backend.url, mismatch)
            self._count("mismatch")
            message = "the decode worker's first token differs from the one already sent"
            await send({"type": "http.response.body", "body": error_event(message), "more_body": True})
            return Outcome.NEUTRAL
        except httpx.HTTPError as exc:
            logger.warning("decode %s broke the stream mid-way: %s", leg.backend.url, type(exc).__name__)
            self._count("decode_failed")
            message = f"the decode worker stopped streaming ({type(exc).__name__})"
            await send({"type": "http.response.body", "body": error_event(message), "more_body": True})
            return Outcome.FAILURE
        self._on_complete(self._timing)
        return Outcome.SUCCESS
