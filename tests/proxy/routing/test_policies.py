"""Routing policies and backend availability, on backends with no network behind them."""

from __future__ import annotations

import collections

import httpx
import pytest

from proxy.backends import Backend, BackendPool, LoadReport, Outcome, Role
from proxy.breaker import CircuitBreaker
from proxy.config import ProxyConfig, RoutingConfig
from proxy.routing.policies import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, build_policy

URLS = ["http://p0:1", "http://p1:1", "http://p2:1"]


def backend(url: str, *, queued: int = 0, in_flight: int = 0, kv_usage: float = 0.0) -> Backend:
    b = Backend(url=url, role=Role.PREFILL, client=httpx.AsyncClient(), breaker=CircuitBreaker(3, 5.0), healthy=True)
    b.load = LoadReport(num_running=queued, kv_usage=kv_usage)
    b.num_in_flight = in_flight
    return b


def test_round_robin_cycles_through_backends_in_order():
    policy = RoundRobinPolicy()
    backends = [backend(u) for u in URLS]
    assert [policy.choose(backends, b"").url for _ in range(6)] == URLS * 2


def test_round_robin_skips_a_backend_that_dropped_out():
    policy = RoundRobinPolicy()
    backends = [backend(u) for u in URLS]
    chosen = [policy.choose([backends[0], backends[2]], b"").url for _ in range(4)]
    assert chosen == [URLS[0], URLS[2], URLS[0], URLS[2]]


def test_least_loaded_prefers_fewest_queued_requests():
    policy = LeastLoadedPolicy()
    backends = [backend(URLS[0], queued=5), backend(URLS[1], queued=1), backend(URLS[2], queued=3)]
    assert policy.choose(backends, b"").url == URLS[1]


def test_least_loaded_uses_the_proxys_own_in_flight_count_when_fresher():
    policy = LeastLoadedPolicy()
    backends = [backend(URLS[0], queued=0, in_flight=4), backend(URLS[1], queued=2)]
    assert policy.choose(backends, b"").url == URLS[1]


def test_least_loaded_counts_kv_pressure():
    policy = LeastLoadedPolicy()
    backends = [backend(URLS[0], queued=1, kv_usage=0.9), backend(URLS[1], queued=2, kv_usage=0.0)]
    assert policy.choose(backends, b"").url == URLS[1]


def test_least_loaded_spreads_ties():
    policy = LeastLoadedPolicy()
    backends = [backend(u) for u in URLS]
    assert {policy.choose(backends, b"").url for _ in range(3)} == set(URLS)


def test_prefix_policy_sends_a_prefix_to_the_same_backend():
    policy = PrefixAwarePolicy(max_load=8)
    backends = [backend(u) for u in URLS]
    first = policy.choose(backends, b"system: you are helpful")
    assert all(policy.choose(backends, b"system: you are helpful") is first for _ in range(5))


def test_prefix_policy_spreads_distinct_prefixes():
    policy = PrefixAwarePolicy(max_load=8)
    backends = [backend(u) for u in URLS]
    counts = collections.Counter(policy.choose(backends, f"prompt {i}".encode()).url for i in range(300))
    assert set(counts) == set(URLS) and min(counts.values()) > 50


def test_prefix_policy_moves_only_the_removed_backends_prefixes():
    policy = PrefixAwarePolicy(max_load=8)
    backends = [backend(u) for u in URLS]
    keys = [f"prompt {i}".encode() for i in range(200)]
    before = {key: policy.choose(backends, key).url for key in keys}
    after = {key: policy.choose(backends[:2], key).url for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == URLS[2] for key in moved)


def test_prefix_policy_falls_back_to_least_loaded_over_the_cap():
    policy = PrefixAwarePolicy(max_load=4)
    backends = [backend(u) for u in URLS]
    preferred = policy.choose(backends, b"same prefix")
    preferred.num_in_flight = 4
    fallback = policy.choose(backends, b"same prefix")
    assert fallback is not preferred and fallback.load_score() == 0


@pytest.mark.parametrize("name, kind", [("round_robin", RoundRobinPolicy), ("least_loaded", LeastLoadedPolicy),
                                        ("prefix", PrefixAwarePolicy)])
def test_build_policy_by_name(name, kind):
    assert isinstance(build_policy(name, RoutingConfig()), kind)


def test_pool_offers_only_healthy_closed_unsaturated_backends():
    config = ProxyConfig(decode_urls=("http://d:1",), routing=RoutingConfig(max_in_flight_per_backend=2))
    pool = BackendPool(Role.PREFILL, config, lambda url: httpx.AsyncClient(base_url=url))
    sick, tripped, busy, fine = (pool.add(u) for u in ["http://a:1", "http://b:1", "http://c:1", "http://d:1"])
    for b in (tripped, busy, fine):
        b.healthy = True
    for _ in range(3):
        tripped.begin()
        tripped.end(Outcome.FAILURE)
    busy.begin()
    busy.begin()
    assert [b.url for b in pool.available()] == [fine.url]
    busy.end(Outcome.SUCCESS)
    assert {b.url for b in pool.available()} == {busy.url, fine.url}
    assert sick.healthy is False


def test_load_report_ignores_malformed_fields():
    report = LoadReport.from_json({"num_running": "lots", "num_waiting": 2, "kv_usage": True})
    assert (report.num_running, report.num_waiting, report.kv_usage) == (0, 2, 0.0)
