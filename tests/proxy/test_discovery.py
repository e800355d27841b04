"""DNS discovery with an injected resolver: pools follow the name, and survive DNS trouble."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from proxy.backends import BackendPool, Role
from proxy.config import DiscoveryConfig, ProxyConfig
from proxy.discovery import DnsDiscovery, address_url


class FakeDns:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: Exception | None = None
        self.queries: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.queries.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


def make_pool() -> BackendPool:
    config = ProxyConfig(discovery=DiscoveryConfig(decode_dns="decode.pd.svc:8200"))
    return BackendPool(Role.DECODE, config, lambda url: httpx.AsyncClient(base_url=url))


def urls(pool: BackendPool) -> set[str]:
    return {backend.url for backend in pool.backends()}


def test_every_resolved_address_becomes_a_backend():
    pool, dns = make_pool(), FakeDns("10.0.0.1", "10.0.0.2", "10.0.0.1")
    assert asyncio.run(DnsDiscovery(pool, "decode.pd.svc:8200", dns).refresh())
    assert urls(pool) == {"http://10.0.0.1:8200", "http://10.0.0.2:8200"}
    assert dns.queries == [("decode.pd.svc", 8200)]


def test_re_resolution_adds_new_pods_and_retires_gone_ones():
    pool, dns = make_pool(), FakeDns("10.0.0.1", "10.0.0.2")
    discovery = DnsDiscovery(pool, "decode.pd.svc:8200", dns)
    asyncio.run(discovery.refresh())
    kept = pool.get("http://10.0.0.2:8200")
    dns.addresses = ["10.0.0.2", "10.0.0.3"]
    asyncio.run(discovery.refresh())
    assert urls(pool) == {"http://10.0.0.2:8200", "http://10.0.0.3:8200"}
    assert pool.get("http://10.0.0.2:8200") is kept  # its health and breaker state survive


def test_retired_backend_is_closed_only_after_its_last_request():
    pool, dns = make_pool(), FakeDns("10.0.0.1")
    discovery = DnsDiscovery(pool, "decode.pd.svc:8200", dns)

    async def scenario() -> tuple[bool, bool]:
        await discovery.refresh()
        gone = pool.get("http://10.0.0.1:8200")
        gone.num_in_flight = 1  # a stream still running
        dns.addresses = ["10.0.0.9"]
        await discovery.refresh()
        await pool.close_idle_retired()
        closed_while_busy = gone.client.is_closed
        gone.num_in_flight = 0
        await pool.close_idle_retired()
        return closed_while_busy, gone.client.is_closed

    assert asyncio.run(scenario()) == (False, True)


@pytest.mark.parametrize("error", [socket.gaierror(-2, "Name or service not known"), None])
def test_failed_or_empty_resolution_keeps_the_current_backends(error):
    pool, dns = make_pool(), FakeDns("10.0.0.1")
    discovery = DnsDiscovery(pool, "decode.pd.svc:8200", dns)
    asyncio.run(discovery.refresh())
    dns.error, dns.addresses = error, []
    assert asyncio.run(discovery.refresh()) is False
    assert urls(pool) == {"http://10.0.0.1:8200"}


def test_ipv6_addresses_are_bracketed():
    assert address_url("http", "fd00::12", 8100) == "http://[fd00::12]:8100"
    assert address_url("http", "10.1.2.3", 8100) == "http://10.1.2.3:8100"


def test_discovered_backends_serve_through_the_proxy():
    from tests.proxy.proxy_stubs import Served, ServedProxy, StubWorker

    decode, prefill = StubWorker("decode", "d0"), StubWorker("prefill", "p0")
    with Served(decode.app()) as d, Served(prefill.app()) as p:
        dns = FakeDns("127.0.0.1")
        config = ProxyConfig(
            prefill_urls=(p.url,),
            discovery=DiscoveryConfig(decode_dns=f"decode.local:{d.port}", interval_s=0.05),
            health={"interval_s": 0.05},
        )
        with ServedProxy(config, resolver=dns) as proxy:
            proxy.wait_ready()
            response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"})
            assert response.json()["choices"][0]["text"] == "from p0"
            assert len(dns.queries) >= 1
