"""Slow and oversized clients, for the workers and the proxy alike: bounded body reads and a header deadline.

Invariants: a request body is read only up to `max_body_bytes` (413 past it,
without reading the rest) and within `body_timeout_s` (408); a connection
that has not sent a complete request head within `header_timeout_s` of
opening (or of its keep-alive wait after an answer) is closed, so a client trickling bytes
cannot hold a connection, a task or memory for ever. Torch-free; the proxy
imports it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Optional

from starlette.requests import Request

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import RequestTimeout, RequestTooLarge

logger = logging.getLogger(__name__)


_DECIMAL = re.compile(r"[0-9]+")
_LENGTH_DIGITS = 18  # past this a length is certainly over any body limit (and int() may refuse it)


def declared_length(header: str) -> Optional[int]:
    """A Content-Length header's value, or None when it is not a plain ASCII decimal (str.isdigit()
    also takes "²", on which int() raises). An absurdly long one counts as larger than any limit."""
    if _DECIMAL.fullmatch(header) is None:
        return None
    digits = header.lstrip("0") or "0"
    return int(digits) if len(digits) <= _LENGTH_DIGITS else 10**_LENGTH_DIGITS


async def read_body(request: Request, limits: LimitsConfig) -> bytes:
    """The whole body, or `RequestTooLarge` (413) / `RequestTimeout` (408)."""
    declared = declared_length(request.headers.get("content-length", ""))
    if declared is not None and declared > limits.max_body_bytes:
        raise RequestTooLarge(f"the request body has {declared} bytes; at most {limits.max_body_bytes} are accepted")
    try:
        return await asyncio.wait_for(_read_at_most(request, limits.max_body_bytes), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {limits.body_timeout_s:g} s") from None


async def _read_at_most(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLarge(f"the request body is larger than the {max_bytes} bytes accepted")
        chunks.append(chunk)
    return b"".join(chunks)


class _HeaderDeadline:
    """Mixed into uvicorn's HTTP/1.1 protocol class: closes connections whose request head is late.

    uvicorn bounds idle keep-alive connections but not one that sends its
    head a byte at a time; this arms a timer whenever the connection waits
    for a new request and disarms it once that request's head is complete."""

    header_timeout_s: float = 10.0
    _deadline: Optional[asyncio.TimerHandle] = None
    _cycle_when_armed: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._deadline is not None and self.cycle is not self._cycle_when_armed:  # type: ignore[attr-defined]
            self._disarm()  # a new request's head is complete

    def on_response_complete(self) -> None:
        # The next head may come after an idle keep-alive wait (which uvicorn bounds itself).
        # Armed before the base class handles a pipelined request, which disarms again.
        self._arm(getattr(self, "timeout_keep_alive", 0))
        super().on_response_complete()  # type: ignore[misc]
        if self.cycle is not self._cycle_when_armed:  # type: ignore[attr-defined]
            self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self, idle_allowance_s: float = 0.0) -> None:
        self._disarm()
        self._cycle_when_armed = self.cycle  # type: ignore[attr-defined]
        self._deadline = self.loop.call_later(  # type: ignore[attr-defined]
            idle_allowance_s + self.header_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        transport = self.transport  # type: ignore[attr-defined]
        if self.cycle is self._cycle_when_armed and not transport.is_closing():  # type: ignore[attr-defined]
            logger.info("closing a connection that sent no complete request head within %.0f s", self.header_timeout_s)
            transport.close()


def http_protocol_with_header_deadline(header_timeout_s: float) -> type:
    """uvicorn's HTTP/1.1 protocol class (httptools when installed, else h11) with the header deadline;
    pass it as `uvicorn.Config(http=...)`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("HeaderDeadlineHTTPProtocol", (_HeaderDeadline, AutoHTTPProtocol), {"header_timeout_s": header_timeout_s})
