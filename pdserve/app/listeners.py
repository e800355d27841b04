"""The worker's two listeners in one event loop: the serving port and the internal port.

Invariant: both sockets are bound before the model starts loading (so the ports a worker names to
its peers, `--port 0` included, are the ports it got, and a port clash fails the start at once);
the internal listener serves for as long as the serving one does, drain included (a prefill worker
being drained still answers decode workers' handshakes and the proxy's releases), and stops after it.
Signals belong to the serving listener alone: it drains, then both stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Callable, Iterator, Optional

import uvicorn

from pdserve.app.drain import Drainable, DrainingServer


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket on host:port (0: any free port); raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named: asyncio sets TCP_NODELAY only on connections of a socket whose proto is
    # IPPROTO_TCP; without it every response's body waited 40 ms behind its head for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


class InternalServer(uvicorn.Server):
    """The internal listener: installs no signal handlers of its own (the serving listener's drain
    decides when the worker stops; this one is stopped after it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class WorkerServer(DrainingServer):
    """The serving listener (drains on SIGTERM), running the internal listener beside it."""

    def __init__(self, config: uvicorn.Config, internal: InternalServer, internal_socket: socket.socket,
                 engine: Callable[[], Optional[Drainable]], timeout_s: float,
                 is_alive: Callable[[], bool] = lambda: True):
        super().__init__(config, engine, timeout_s, is_alive=is_alive)
        self._internal = internal
        self._internal_socket = internal_socket

    async def serve(self, sockets: Optional[list[socket.socket]] = None) -> None:
        internal = asyncio.create_task(self._internal.serve(sockets=[self._internal_socket]), name="internal-listener")
        try:
            await super().serve(sockets=sockets)
        finally:
            self._internal.should_exit = True
            await internal
