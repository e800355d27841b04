"""The worker's two listeners: both bound before anything loads, the internal one serving as long as
the serving one does (a drain included) and stopped after it."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.app.listeners import InternalServer, WorkerServer, bind_listener, bound_port


def answering(text: str) -> Starlette:
    return Starlette(routes=[Route("/", lambda request: PlainTextResponse(text))])


def test_a_taken_port_fails_the_bind_at_once():
    with bind_listener("127.0.0.1", 0) as taken:
        taken.listen()  # as another server's would be
        with pytest.raises(OSError):
            bind_listener("127.0.0.1", bound_port(taken))


def test_both_listeners_serve_their_own_app_and_the_internal_one_stops_after_the_serving_one():
    serving_socket, internal_socket = bind_listener("127.0.0.1", 0), bind_listener("127.0.0.1", 0)
    internal = InternalServer(uvicorn.Config(answering("internal"), log_level="warning"))
    server = WorkerServer(uvicorn.Config(answering("serving"), log_level="warning"), internal, internal_socket,
                          lambda: None, timeout_s=1.0)

    async def scenario() -> list[str]:
        task = asyncio.create_task(server.serve(sockets=[serving_socket]))
        while not (server.started and internal.started):  # start-up order: forced, not slept on
            assert not task.done(), task
            await asyncio.sleep(0)
        async with httpx.AsyncClient(trust_env=False) as client:
            answers = [(await client.get(f"http://127.0.0.1:{bound_port(sock)}/")).text
                       for sock in (serving_socket, internal_socket)]
        server.should_exit = True
        await task
        return answers

    assert asyncio.run(scenario()) == ["serving", "internal"]
    assert internal.should_exit  # stopped with the serving listener, not left behind
    with pytest.raises(OSError):  # and its port is closed
        socket.create_connection(("127.0.0.1", bound_port(internal_socket)), timeout=1).close()


def test_a_listener_s_connections_send_without_waiting_for_acks():
    """TCP_NODELAY on every accepted connection (asyncio sets it only on sockets that name their protocol,
    IPPROTO_TCP): without it, a response's body waits behind its head for the client's delayed ACK,
    40 ms on Linux, on every request and every streamed chunk."""
    listener = bind_listener("127.0.0.1", 0)

    async def accepted_nodelay() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", bound_port(listener))
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
