"""Relaying decode's answer to the client, and noticing a client that leaves.

Invariant: decode's bytes reach the client unchanged, and however the
exchange ends (finished, client gone, backend gone, or the body never
started) the upstream response is closed exactly once, which makes the
decode worker abort a request nobody reads. Both phases (before the answer
starts, while it streams) watch for the client's disconnect with one helper
task per request: this code runs on every request and its cost is the proxy's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Optional, TypeVar

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from proxy.backends import Outcome
from proxy.legs import OpenLeg

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


class ClientGone(Exception):
    """The client disconnected; there is nobody left to answer."""


class ClientStalled(Exception):
    """The client took no part of the answer within the send timeout: it stopped reading."""


def stream_headers(media_type: str, headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """An event stream's raw response headers: its type, no caching or proxy buffering, then `headers`."""
    return [(b"content-type", media_type.encode("latin-1")), *_STREAM_HEADERS,
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())]


def bounded_send(raw_send: Send, timeout_s: float) -> Callable[[dict], Awaitable[None]]:
    """The client's send, bounded: a client that takes no bytes for `timeout_s` is `ClientStalled`."""

    async def send(message: dict) -> None:
        try:
            await asyncio.wait_for(raw_send(message), timeout_s)
        except asyncio.TimeoutError:
            raise ClientStalled() from None

    return send


class DisconnectWatch:
    """Cancels the current task when the client disconnects, until `stop()`.

    A done-callback rather than a racing task: the callback may already be
    queued when the work finishes, so it checks `_stopped` before cancelling.
    """

    def __init__(self, receive: Receive):
        self._task = asyncio.current_task()
        self._stopped = False
        self.client_gone = False
        self._watcher = asyncio.ensure_future(self._wait(receive))
        self._watcher.add_done_callback(self._on_done)

    @staticmethod
    async def _wait(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def _on_done(self, watcher: asyncio.Future) -> None:
        if not self._stopped and not watcher.cancelled() and watcher.exception() is None:
            self.client_gone = True
            self._task.cancel()

    def absorb(self) -> None:
        """Turn our own cancellation into `ClientGone` (call in `except CancelledError`)."""
        if not self.client_gone:
            return
        if hasattr(self._task, "uncancel"):
            self._task.uncancel()
        raise ClientGone()

    def stop(self) -> None:
        self._stopped = True
        self._watcher.cancel()


async def until_client_disconnects(receive: Receive, work: Awaitable[T]) -> T:
    """Run `work` in this task; if the client goes away first, cancel it (and so both legs'
    HTTP requests) and raise `ClientGone`. The request body must already have been read."""
    watch = DisconnectWatch(receive)
    try:
        return await work
    except asyncio.CancelledError:
        watch.absorb()
        raise
    finally:
        watch.stop()


async def close_leg(leg: OpenLeg, outcome: Outcome) -> None:
    # Shielded: this can run in a cancelled scope, and the connection must
    # still be closed so that decode aborts the request.
    with anyio.CancelScope(shield=True):
        await leg.response.aclose()
    leg.finish(outcome)


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass(slots=True)
class StreamTiming:
    """When a relayed stream's answer events arrived: the first, the last, and how many ([DONE] aside)."""

    first_s: Optional[float] = None
    last_s: Optional[float] = None
    num_events: int = 0

    def saw(self, chunk: bytes, now_s: float) -> None:
        events = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        if events > 0:
            self.first_s = now_s if self.first_s is None else self.first_s
            self.last_s = now_s
            self.num_events += events

    @property
    def mean_gap_s(self) -> Optional[float]:
        """The mean time between events after the first (a client's time per output token)."""
        if self.first_s is None or self.last_s is None or self.num_events < 2:
            return None
        return (self.last_s - self.first_s) / (self.num_events - 1)


class RelayStreamResponse:
    """An ASGI response that streams decode's SSE bytes as they arrive and closes the leg always."""

    def __init__(self, leg: OpenLeg, on_first_byte: Callable[[float], None], on_broken: Callable[[str], None],
                 headers: Mapping[str, str], send_timeout_s: float = 30.0,
                 on_complete: Optional[Callable[["StreamTiming"], None]] = None,
                 on_first_written: Optional[Callable[[float], None]] = None):
        """`on_first_byte`: decode's first byte arrived (before it goes on); `on_first_written`: the client's
        server took it (perf_counter seconds, both)."""
        self.status_code = 200
        self._on_first_written = on_first_written
        self._send_timeout_s = send_timeout_s  # a client that takes nothing this long has stopped reading
        self._leg = leg
        self._on_first_byte = on_first_byte
        self._on_complete = on_complete
        self._timing = StreamTiming()
        self._on_broken = on_broken
        media_type = leg.response.headers.get("content-type", "text/event-stream")
        self._raw_headers = stream_headers(media_type, headers)

    async def __call__(self, scope: Scope, receive: Receive, raw_send: Send) -> None:
        watch = DisconnectWatch(receive)
        outcome = Outcome.NEUTRAL

        send = bounded_send(raw_send, self._send_timeout_s)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
            outcome = await self._relay(send)
            await close_leg(self._leg, outcome)  # settled before the client sees the end
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            try:
                watch.absorb()
            except ClientGone:
                logger.debug("client of a streamed answer disconnected")
                return
            raise
        except OSError:  # ASGI >= 2.4 servers report a gone client by failing `send`
            logger.debug("client of a streamed answer disconnected")
        except ClientStalled:
            logger.warning("a streaming client took nothing for %g s; dropping it", self._send_timeout_s)
        finally:
            watch.stop()
            await close_leg(self._leg, outcome)

    async def _relay(self, send: Send) -> Outcome:
        """Decode's raw bytes, unchanged; a backend that breaks mid-stream gets an SSE error event."""
        first = True
        try:
            async for chunk in self._leg.response.aiter_raw():
                is_first = first and bool(chunk)
                if is_first:
                    first = False
                    self._on_first_byte(time.perf_counter())
                self._timing.saw(chunk, time.perf_counter())
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if is_first and self._on_first_written is not None:
                    self._on_first_written(time.perf_counter())
        except httpx.HTTPError as exc:
            logger.warning("decode %s broke the stream mid-way: %s", self._leg.backend.url, type(exc).__name__)
            self._on_broken("timeout" if isinstance(exc, httpx.TimeoutException) else "stream_broken")
            message = f"the decode worker stopped streaming ({type(exc).__name__})"
            await send({"type": "http.response.body", "body": error_event(message), "more_body": True})
            return Outcome.FAILURE
        if self._on_complete is not None:
            self._on_complete(self._timing)
        return Outcome.SUCCESS
