"""Dynamic backends: a DNS name that resolves to one address per worker, re-resolved periodically.

This is how a Kubernetes headless service presents its pods. Invariant: a
failed or empty resolution keeps the previous backends (a DNS blip must not
empty the pool; health polls take dead workers out anyway), and a backend
that disappears is retired, never cut off in the middle of a request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Awaitable, Callable

from proxy.backends import BackendPool
from proxy.config import split_host_port

logger = logging.getLogger(__name__)

# (host, port) -> the addresses it resolves to. Injected in tests.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_with_getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def address_url(scheme: str, address: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(address).version == 6
    except ValueError:
        is_v6 = False
    host = f"[{address}]" if is_v6 else address
    return f"{scheme}://{host}:{port}"


class DnsDiscovery:
    """Keeps one pool in step with what one DNS name resolves to."""

    def __init__(self, pool: BackendPool, target: str, resolver: Resolver, scheme: str = "http"):
        self._pool = pool
        self._host, self._port = split_host_port(target)
        self._resolver = resolver
        self._scheme = scheme

    async def refresh(self) -> bool:
        """Resolve once and reconcile the pool; False (pool untouched) when resolution failed."""
        try:
            addresses = await self._resolver(self._host, self._port)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("resolving %s failed (%s); keeping %d %s backends",
                           self._host, exc, len(self._pool), self._pool.role.value)
            return False
        wanted = {address_url(self._scheme, address, self._port) for address in addresses}
        if not wanted:
            logger.warning("%s resolved to no address; keeping the current backends", self._host)
            return False
        for backend in self._pool.backends():
            if backend.url not in wanted:
                self._pool.retire(backend.url)
        for url in sorted(wanted):
            self._pool.add(url)
        return True

    async def run_forever(self, interval_s: float, on_change: Callable[[], Awaitable[None]]) -> None:
        """Re-resolve every `interval_s`; `on_change` (a health poll) runs after each refresh."""
        while True:
            before = {backend.url for backend in self._pool.backends()}
            await self.refresh()
            if {backend.url for backend in self._pool.backends()} != before:
                await on_change()
            await asyncio.sleep(interval_s)
