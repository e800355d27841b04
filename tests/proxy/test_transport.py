"""The lean HTTP/1.1 transport against a scripted asyncio server: keep-alive, framing, failures."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import httpx
import pytest

from proxy.transport import LeanTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


class ScriptedServer:
    """Answers each request with `respond(index)`; counts connections; `close_after` drops them."""

    def __init__(self, respond: Callable[[int], bytes], close_after_answer: bool = False, silent: bool = False):
        self.respond = respond
        self.close_after_answer = close_after_answer
        self.silent = silent
        self.num_connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                self.requests.append(await read_request(reader))
                if self.silent:
                    await asyncio.sleep(60)
                writer.write(self.respond(len(self.requests) - 1))
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(server: ScriptedServer, scenario: Callable[[httpx.AsyncClient], Awaitable[None]],
                transport: LeanTransport | None = None) -> None:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    transport = transport or LeanTransport()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport) as client:
        await scenario(client)
    listener.close()


def test_keep_alive_reuses_one_connection_and_sends_the_body():
    server = ScriptedServer(lambda i: ok(b'{"n": %d}' % i))

    async def scenario(client: httpx.AsyncClient) -> None:
        for i in range(3):
            response = await client.post("/v1/completions?x=1", content=b'{"prompt": "hi"}')
            assert response.status_code == 200 and response.json() == {"n": i}

    asyncio.run(serve(server, scenario))
    assert server.num_connections == 1
    assert server.requests[0].startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n")
    assert server.requests[0].endswith(b'\r\n\r\n{"prompt": "hi"}')


def test_chunked_body_streams_chunk_by_chunk():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    server = ScriptedServer(lambda i: chunked)
    seen: list[bytes] = []

    async def scenario(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/", content=b"{}") as response:
            seen.extend([chunk async for chunk in response.aiter_raw()])
        assert (await client.post("/", content=b"{}")).content == b"hello world"

    asyncio.run(serve(server, scenario))
    assert b"".join(seen) == b"hello world" and len(seen) == 2
    assert server.num_connections == 1


def test_connection_close_answer_is_not_reused():
    server = ScriptedServer(lambda i: ok(b"x", b"Connection: close\r\n"), close_after_answer=True)

    async def scenario(client: httpx.AsyncClient) -> None:
        for _ in range(2):
            assert (await client.post("/", content=b"{}")).content == b"x"

    asyncio.run(serve(server, scenario))
    assert server.num_connections == 2


def test_keep_alive_connection_closed_by_the_server_is_retried_on_a_fresh_one():
    server = ScriptedServer(lambda i: ok(b"x"), close_after_answer=True)  # closes without saying so

    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.post("/", content=b"{}")).content == b"x"
        await asyncio.sleep(0)  # the FIN may or may not have been seen: both paths must work
        assert (await client.post("/", content=b"{}")).content == b"x"

    asyncio.run(serve(server, scenario))
    assert server.num_connections == 2


def test_request_dropped_unanswered_on_a_reused_connection_is_resent_once():
    class ClosesInsteadOfSecondAnswer(ScriptedServer):
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.num_connections += 1
            first_connection = self.num_connections == 1
            try:
                while True:
                    self.requests.append(await read_request(reader))
                    if first_connection and len(self.requests) == 2:
                        return  # the keep-alive race: the server had decided to close
                    writer.write(ok(b"x"))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

    server = ClosesInsteadOfSecondAnswer(lambda i: b"")

    async def scenario(client: httpx.AsyncClient) -> None:
        for _ in range(3):
            assert (await client.post("/", content=b"{}")).content == b"x"

    asyncio.run(serve(server, scenario))
    assert server.num_connections == 2 and len(server.requests) == 4


def test_silent_server_gives_read_timeout():
    server = ScriptedServer(lambda i: b"", silent=True)

    async def scenario(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/", content=b"{}", timeout=httpx.Timeout(5.0, read=0.2))

    asyncio.run(serve(server, scenario))


def test_refused_connection_gives_connect_error():
    async def scenario() -> None:
        listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        listener.close()
        await listener.wait_closed()
        async with httpx.AsyncClient(transport=LeanTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.post(f"http://127.0.0.1:{port}/", content=b"{}")

    asyncio.run(scenario())


def test_body_cut_short_gives_remote_protocol_error():
    server = ScriptedServer(lambda i: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b", close_after_answer=True)

    async def scenario(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/", content=b"{}")

    asyncio.run(serve(server, scenario))


def test_unread_body_closes_its_connection_instead_of_reusing_it():
    server = ScriptedServer(lambda i: ok(b"y" * 1000))

    async def scenario(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/", content=b"{}") as response:
            assert response.status_code == 200  # body never read
        assert (await client.post("/", content=b"{}")).content == b"y" * 1000

    asyncio.run(serve(server, scenario))
    assert server.num_connections == 2


def test_connection_cap_makes_callers_wait_then_pool_timeout():
    server = ScriptedServer(lambda i: ok(b"z"))

    async def scenario(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/", content=b"{}"):
            with pytest.raises(httpx.PoolTimeout):
                await client.post("/", content=b"{}", timeout=httpx.Timeout(5.0, pool=0.1))
        assert (await client.post("/", content=b"{}")).content == b"z"  # the slot came back

    asyncio.run(serve(server, scenario, LeanTransport(max_connections=1)))
