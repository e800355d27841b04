"""Routing policies and backend availability, on backends with no network behind them."""

from __future__ import annotations

import collections

import httpx
import pytest

from proxy.backends import Backend, BackendPool, LoadReport, Outcome, Role
from proxy.breaker import CircuitBreaker
from proxy.config import ProxyConfig, RoutingConfig
from proxy.routing.candidates import FALLBACK_TURN, POLICY_TURN, Candidate, RoleTurns, RouteRequest
from proxy.routing.policies import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, least_loaded, round_robin
from proxy.routing.policies_kv import KVAwarePolicy
from proxy.routing.route import build_policy

URLS = ["http://p0:1", "http://p1:1", "http://p2:1"]


def backend(url: str, *, queued: int = 0, in_flight: int = 0, kv_usage: float = 0.0) -> Backend:
    b = Backend(url=url, role=Role.PREFILL, client=httpx.AsyncClient(), breaker=CircuitBreaker(3, 5.0), healthy=True)
    b.load = LoadReport(num_running=queued, kv_usage=kv_usage)
    b.num_in_flight = in_flight
    return b


def candidates(*loads: float) -> list[Candidate]:
    return [Candidate(url, True, load) for url, load in zip(URLS, loads)]


def chosen(policy, offered, prefix_key: bytes = b"", num_picks: int = 1) -> list[str]:
    """The urls of `num_picks` successive picks, each advancing the turns as the forwarder does."""
    turns, urls = RoleTurns(), []
    for _ in range(num_picks):
        pick = policy.choose(offered, RouteRequest(100, prefix_key), turns)
        urls.append(pick.url)
        turns = turns.after(pick)
    return urls


def test_round_robin_cycles_through_backends_in_order():
    assert chosen(RoundRobinPolicy(), candidates(0, 0, 0), num_picks=6) == URLS * 2


def test_round_robin_skips_a_backend_that_dropped_out():
    backends = [backend(u) for u in URLS]
    assert [round_robin([backends[0], backends[2]], turn).url for turn in range(4)] == [URLS[0], URLS[2]] * 2


def test_least_loaded_prefers_fewest_queued_requests():
    backends = [backend(URLS[0], queued=5), backend(URLS[1], queued=1), backend(URLS[2], queued=3)]
    assert least_loaded(backends, 0).url == URLS[1]
    assert chosen(LeastLoadedPolicy(), [Candidate.of(b) for b in backends]) == [URLS[1]]


def test_least_loaded_uses_the_proxys_own_in_flight_count_when_fresher():
    backends = [backend(URLS[0], queued=0, in_flight=4), backend(URLS[1], queued=2)]
    assert least_loaded(backends, 0).url == URLS[1]


def test_least_loaded_counts_kv_pressure():
    backends = [backend(URLS[0], queued=1, kv_usage=0.9), backend(URLS[1], queued=2, kv_usage=0.0)]
    assert least_loaded([Candidate.of(b) for b in backends], 0).url == URLS[1]


def test_least_loaded_spreads_ties():
    assert set(chosen(LeastLoadedPolicy(), candidates(0, 0, 0), num_picks=3)) == set(URLS)


def test_a_pick_names_the_rotation_it_used_and_only_that_one_advances():
    pick = LeastLoadedPolicy().choose(candidates(0, 0), RouteRequest(1), RoleTurns(policy=1, fallback=5))
    assert (pick.url, pick.turn) == (URLS[1], POLICY_TURN)
    assert RoleTurns(1, 5).after(pick) == RoleTurns(2, 5)
    busy = PrefixAwarePolicy(max_load=1).choose(candidates(3, 3), RouteRequest(1, b"k"), RoleTurns(0, 5))
    assert busy.turn == FALLBACK_TURN and RoleTurns(0, 5).after(busy) == RoleTurns(0, 6)
    preferred = PrefixAwarePolicy(max_load=8).choose(candidates(0, 0), RouteRequest(1, b"k"), RoleTurns())
    assert preferred.turn is None and RoleTurns(2, 2).after(preferred) == RoleTurns(2, 2)


def test_prefix_policy_sends_a_prefix_to_the_same_backend():
    policy, offered = PrefixAwarePolicy(max_load=8), candidates(0, 0, 0)
    first = chosen(policy, offered, b"system: you are helpful")
    assert chosen(policy, offered, b"system: you are helpful", num_picks=5) == first * 5


def test_prefix_policy_spreads_distinct_prefixes():
    policy, offered = PrefixAwarePolicy(max_load=8), candidates(0, 0, 0)
    counts = collections.Counter(chosen(policy, offered, f"prompt {i}".encode())[0] for i in range(300))
    assert set(counts) == set(URLS) and min(counts.values()) > 50


def test_prefix_policy_moves_only_the_removed_backends_prefixes():
    policy, offered = PrefixAwarePolicy(max_load=8), candidates(0, 0, 0)
    keys = [f"prompt {i}".encode() for i in range(200)]
    before = {key: chosen(policy, offered, key)[0] for key in keys}
    after = {key: chosen(policy, offered[:2], key)[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == URLS[2] for key in moved)


def test_prefix_policy_falls_back_to_least_loaded_over_the_cap():
    policy, offered = PrefixAwarePolicy(max_load=4), candidates(0, 0, 0)
    preferred = chosen(policy, offered, b"same prefix")[0]
    loaded = [Candidate(c.url, True, 4 if c.url == preferred else 0) for c in offered]
    fallback = policy.choose(loaded, RouteRequest(1, b"same prefix"), RoleTurns())
    assert fallback.url != preferred and fallback.reason == "prefix_busy"


@pytest.mark.parametrize("name, kind", [("round_robin", RoundRobinPolicy), ("least_loaded", LeastLoadedPolicy),
                                        ("prefix", PrefixAwarePolicy), ("kv_aware", KVAwarePolicy)])
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
