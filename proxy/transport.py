"""A lean HTTP/1.1 keep-alive transport for httpx, one per backend (a single origin).

httpx's default transport (httpcore over anyio) costs about a millisecond of
Python per request on a small CPU, more than the proxy's whole budget; this
one writes each request in one `write`, parses the answer head by hand and
streams the body straight from the socket. Invariants: a connection goes back
to the pool only after its answer was read to the end (and the server did not
say `Connection: close`); every failure is raised as the httpx exception a
default transport would raise, so callers cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import AsyncIterator, Awaitable, Optional, TypeVar

import httpx

T = TypeVar("T")
MAX_HEAD_BYTES = 64 * 1024
_CHUNKED, _LENGTH, _UNTIL_CLOSE, _EMPTY = range(4)

async def _within(awaitable: Awaitable[T], delay_s: Optional[float]) -> T:
    """Await with a deadline; raises TimeoutError (asyncio.TimeoutError before 3.11)."""
    if delay_s is None:
        return await awaitable
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(delay_s):  # no extra task, unlike wait_for
            return await awaitable
    return await asyncio.wait_for(awaitable, delay_s)  # pragma: no cover - Python 3.10


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the server before it answered: resend on a new one."""


class _Connection:
    __slots__ = ("reader", "writer", "idle_since_s", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.idle_since_s = 0.0
        self.reused = False

    def is_reusable(self, now_s: float, expiry_s: float) -> bool:
        return now_s - self.idle_since_s < expiry_s and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class _Pool:
    """Idle connections (most recently used first) and a cap on open ones."""

    def __init__(self, max_connections: int, keepalive_expiry_s: float):
        self.idle: collections.deque[_Connection] = collections.deque()
        self.slots = asyncio.Semaphore(max_connections) if max_connections else None
        self.keepalive_expiry_s = keepalive_expiry_s

    def take_idle(self) -> Optional[_Connection]:
        now_s = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if connection.is_reusable(now_s, self.keepalive_expiry_s):
                connection.reused = True
                return connection
            connection.close()
        return None

    def give_back(self, connection: _Connection) -> None:
        connection.idle_since_s = time.monotonic()
        self.idle.append(connection)


class _BodyStream(httpx.AsyncByteStream):
    """The answer's body, read from the socket as the caller iterates; releases the connection once."""

    def __init__(self, transport: "LeanTransport", connection: _Connection, framing: int, length: int,
                 keep_alive: bool, read_timeout_s: Optional[float]):
        self._transport = transport
        self._connection = connection
        self._framing = framing
        self._remaining = length
        self._keep_alive = keep_alive
        self._read_timeout_s = read_timeout_s
        self._complete = framing == _EMPTY
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        while not self._complete:
            # The deadline covers one read, never a `yield`: the consumer may sit between chunks.
            try:
                chunk = await _within(self._next_chunk(reader), self._read_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                raise httpx.ReadTimeout("timed out reading the response body") from None
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as exc:
                raise httpx.RemoteProtocolError(f"the connection broke mid-body ({type(exc).__name__})") from None
            if chunk:
                yield chunk

    async def _next_chunk(self, reader: asyncio.StreamReader) -> bytes:
        if self._framing == _LENGTH:
            chunk = await reader.read(min(self._remaining, 65536))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", self._remaining)
            self._remaining -= len(chunk)
            self._complete = self._remaining == 0
            return chunk
        if self._framing == _UNTIL_CLOSE:
            chunk = await reader.read(65536)
            self._complete = not chunk
            return chunk
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, if any
                pass
            self._complete = True
            return b""
        data = await reader.readexactly(size + 2)
        return data[:-2]

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        reusable = self._complete and self._keep_alive and self._framing != _UNTIL_CLOSE
        self._transport._release(self._connection, reusable)


class LeanTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to one origin (`http://host:port`); honours httpx's per-request timeouts."""

    def __init__(self, max_connections: int = 0, keepalive_expiry_s: float = 4.0):
        self._pool = _Pool(max_connections, keepalive_expiry_s)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        try:
            return await self._exchange(request, timeouts)
        except _StaleConnection:
            return await self._exchange(request, timeouts)  # a fresh connection this time: idle ones may be stale too

    async def _exchange(self, request: httpx.Request, timeouts: dict) -> httpx.Response:
        connection = await self._acquire(request.url, timeouts.get("pool"), timeouts.get("connect"))
        try:
            await self._send(connection, request, timeouts.get("write"))
            status, headers, framing, length, keep_alive = await self._read_head(
                connection, request.method, timeouts.get("read"))
        except BaseException:
            self._release(connection, reusable=False)
            if connection.reused:
                self._drop_idle()
            raise
        stream = _BodyStream(self, connection, framing, length, keep_alive, timeouts.get("read"))
        return httpx.Response(status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"})

    def _drop_idle(self) -> None:
        while self._pool.idle:
            self._pool.idle.pop().close()

    async def _acquire(self, url: httpx.URL, pool_s: Optional[float], connect_s: Optional[float]) -> _Connection:
        if self._closed:
            raise httpx.ConnectError("the transport is closed")
        if self._pool.slots is not None:
            try:
                await _within(self._pool.slots.acquire(), pool_s)
            except (TimeoutError, asyncio.TimeoutError):
                raise httpx.PoolTimeout("no free connection to the backend in time") from None
        idle = self._pool.take_idle()
        if idle is not None:
            return idle
        try:
            reader, writer = await _within(
                asyncio.open_connection(url.host, url.port or 80, limit=MAX_HEAD_BYTES), connect_s)
        except (TimeoutError, asyncio.TimeoutError):
            self._free_slot()
            raise httpx.ConnectTimeout(f"connecting to {url.host}:{url.port} timed out") from None
        except OSError as exc:
            self._free_slot()
            raise httpx.ConnectError(f"cannot connect to {url.host}:{url.port}: {exc}") from None
        except BaseException:
            self._free_slot()
            raise
        return _Connection(reader, writer)

    async def _send(self, connection: _Connection, request: httpx.Request, write_s: Optional[float]) -> None:
        body = await request.aread()
        target = request.url.raw_path
        lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), target)]
        lines.extend(b"%s: %s\r\n" % (name, value) for name, value in request.headers.raw)
        lines.append(b"\r\n")
        lines.append(body)
        try:
            connection.writer.write(b"".join(lines))  # one write: one segment for a small request
            await _within(connection.writer.drain(), write_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise httpx.WriteTimeout("timed out sending the request") from None
        except (ConnectionError, OSError) as exc:
            if connection.reused:
                raise _StaleConnection() from None
            raise httpx.WriteError(f"sending the request failed: {exc}") from None

    async def _read_head(self, connection: _Connection, method: str,
                         read_s: Optional[float]) -> tuple[int, list[tuple[bytes, bytes]], int, int, bool]:
        try:
            head = await _within(connection.reader.readuntil(b"\r\n\r\n"), read_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise httpx.ReadTimeout("timed out waiting for the response") from None
        except asyncio.IncompleteReadError as exc:
            if connection.reused and not exc.partial:
                raise _StaleConnection() from None  # closed while idle, before reading our request
            raise httpx.RemoteProtocolError("the server closed the connection without answering") from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("the response head is too large") from None
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"reading the response failed: {exc}") from None
        return _parse_head(head, method)

    def _release(self, connection: _Connection, reusable: bool) -> None:
        if reusable and not self._closed:
            self._pool.give_back(connection)
        else:
            connection.close()
        self._free_slot()

    def _free_slot(self) -> None:
        if self._pool.slots is not None:
            self._pool.slots.release()

    async def aclose(self) -> None:
        self._closed = True
        while self._pool.idle:
            self._pool.idle.pop().close()


def _parse_head(head: bytes, method: str) -> tuple[int, list[tuple[bytes, bytes]], int, int, bool]:
    """Status, headers, body framing, content length and keep-alive of one response head."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line: {lines[0][:80]!r}")
    status = int(parts[1])
    headers = []
    framing, length, keep_alive = _UNTIL_CLOSE, 0, parts[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError("malformed header line")
        name, value = name.strip(), value.strip()
        headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" and framing != _CHUNKED:
            if not value.isdigit():
                raise httpx.RemoteProtocolError("malformed Content-Length")
            framing, length = _LENGTH, int(value)
        elif lowered == b"transfer-encoding" and value.lower().endswith(b"chunked"):
            framing = _CHUNKED
        elif lowered == b"connection":
            keep_alive = value.lower() != b"close"
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200 or (framing == _LENGTH and length == 0):
        framing = _EMPTY
    return status, headers, framing, length, keep_alive
