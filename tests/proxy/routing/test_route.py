"""`choose_route` without HTTP: signals in (workers' health and load, KV predictions, measured speeds,
rotation turns), a `Route` out, under each policy, static and adaptive disaggregation, and sick workers."""

from __future__ import annotations

import dataclasses

from proxy.config import ProxyConfig, RoutingConfig
from proxy.routing.candidates import NAMED, Candidate, RoleTurns, RouteRequest
from proxy.routing.disaggregation import Slo
from proxy.routing.kv_index import CachedPrefix
from proxy.routing.policies import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy
from proxy.routing.policies_kv import CACHE_HIT, NO_BLOCKS, KVAwarePolicy
from proxy.routing.route import (DECODE_ONLY, DISAGGREGATED, LOCAL_PROMPT, NO_DECODE, NO_PREFILL, NO_PREFILL_TIER,
                                 SKIPPED_DECODE_CACHED, RouteSettings, RouteSignals, choose_route, pick_prefill,
                                 pick_worker)

SLO = Slo(ttft_ms=1000.0, ttft_ms_per_token=2.0, tpot_ms=20.0)
D0, D1, P0, P1 = "http://d0:1", "http://d1:1", "http://p0:1", "http://p1:1"


def worker(url: str, load: float = 0.0, *, available: bool = True, backlog: int = 0, running: int = 0,
           cached: int | None = None) -> Candidate:
    return Candidate(url, available, load, backlog, running, None if cached is None else CachedPrefix(cached))


def settings(policy=None, **fields) -> RouteSettings:
    policy = policy or LeastLoadedPolicy()
    return RouteSettings(policy, fields.pop("decode_policy", policy), SLO, **fields)


def signals(decode=(worker(D0), worker(D1)), prefill=(worker(P0), worker(P1)), **fields) -> RouteSignals:
    return RouteSignals(tuple(decode), tuple(prefill), **fields)


def test_a_prompt_goes_to_the_least_loaded_prefill_and_decode_workers():
    route = choose_route(RouteRequest(500), signals((worker(D0, 3), worker(D1, 1)), (worker(P0, 0), worker(P1, 2))),
                         settings())
    assert (route.mode, route.decode.url, route.prefill.url) == (DISAGGREGATED, D1, P0)
    assert route.reason == "static" and route.decision.where == "prefill"


def test_the_same_signals_give_the_same_route():
    request, given = RouteRequest(500, b"abc"), signals()
    assert choose_route(request, given, settings()) == choose_route(request, given, settings())


def test_unavailable_workers_are_never_chosen_however_idle():
    decode = (worker(D0, 0, available=False), worker(D1, 9))
    prefill = (worker(P0, 0, available=False), worker(P1, 9))
    route = choose_route(RouteRequest(500), signals(decode, prefill), settings())
    assert (route.decode.url, route.prefill.url) == (D1, P1)


def test_without_an_available_decode_worker_the_route_is_a_refusal():
    route = choose_route(RouteRequest(500), signals((worker(D0, available=False),)), settings())
    assert (route.mode, route.reason, route.decode, route.prefill) == (DISAGGREGATED, NO_DECODE, None, None)


def test_without_an_available_prefill_worker_decode_computes_the_prompt_unless_the_fallback_is_off():
    sick = (worker(P0, available=False),)
    route = choose_route(RouteRequest(500), signals(prefill=sick), settings())
    assert (route.mode, route.reason, route.decode.url, route.prefill) == (DECODE_ONLY, NO_PREFILL, D0, None)
    refused = choose_route(RouteRequest(500), signals(prefill=sick), settings(colocated_fallback=False))
    assert (refused.mode, refused.prefill) == (DISAGGREGATED, None)  # the forwarder answers 503


def test_the_request_shape_alone_can_make_a_route_decode_only():
    no_tier = choose_route(RouteRequest(500), signals(prefill=()), settings(has_prefill=False))
    assert (no_tier.mode, no_tier.reason, no_tier.prefill) == (DECODE_ONLY, NO_PREFILL_TIER, None)
    local = choose_route(RouteRequest(500, needs_local_prompt=True), signals(), settings())
    assert (local.mode, local.reason, local.decision) == (DECODE_ONLY, LOCAL_PROMPT, None)


def test_round_robin_follows_the_turns_it_is_given():
    request, policy = RouteRequest(500), RoundRobinPolicy()
    first = choose_route(request, signals(), settings(policy))
    later = choose_route(request, signals(decode_turns=RoleTurns(policy=1), prefill_turns=RoleTurns(policy=1)),
                         settings(policy))
    assert (first.decode.url, first.prefill.url, later.decode.url, later.prefill.url) == (D0, P0, D1, P1)
    assert first.decode.turn == "policy"


def test_the_prefix_policy_keeps_a_prefix_on_one_worker_until_it_is_busy():
    policy = PrefixAwarePolicy(max_load=4)
    request = RouteRequest(500, b"system: be brief")
    home = choose_route(request, signals(), settings(policy)).decode.url
    other = D1 if home == D0 else D0
    busy = choose_route(request, signals((worker(home, 4), worker(other, 1))), settings(policy))
    assert (busy.decode.url, busy.decode.reason) == (other, "prefix_busy")


def test_the_static_threshold_keeps_short_prompts_on_the_decode_worker():
    static = settings(disagg_min_prompt_tokens=100)
    short = choose_route(RouteRequest(50), signals(), static)
    assert (short.mode, short.reason, short.prefill) == (DECODE_ONLY, "static_short", None)
    assert choose_route(RouteRequest(150), signals(), static).mode == DISAGGREGATED


def test_adaptive_disaggregation_weighs_the_prefill_queue_against_the_slo():
    adaptive = settings(adaptive=True)
    speeds = {"prefill_s_per_token": 0.001, "decode_s_per_token": 0.001}
    fits = choose_route(RouteRequest(1000), signals(**speeds), adaptive)
    assert (fits.mode, fits.reason) == (DISAGGREGATED, "prefill_fits")
    queued = (worker(P0, backlog=5000), worker(P1, backlog=8000))  # 6 s on the shortest queue > a 3 s budget
    busy = choose_route(RouteRequest(1000), signals(prefill=queued, **speeds), adaptive)
    assert (busy.mode, busy.reason, busy.decode.url) == (DECODE_ONLY, "prefill_busy", D0)
    assert busy.decision.ttft_prefill_s == 6.0
    short = choose_route(RouteRequest(10), signals(**speeds), adaptive)  # 10 ms of prefill: within one TPOT
    assert (short.mode, short.reason) == (DECODE_ONLY, "short")


def test_adaptive_disaggregation_uses_the_static_rule_until_speeds_are_measured():
    unmeasured = choose_route(RouteRequest(10), signals(), settings(adaptive=True))
    assert (unmeasured.mode, unmeasured.reason) == (DISAGGREGATED, "static")
    static = choose_route(RouteRequest(10), signals(prefill_s_per_token=0.001), settings())
    assert static.reason == "static"  # --disaggregation static ignores the measured speed


def test_a_running_decode_worker_keeps_its_streams_from_a_long_stall():
    adaptive = settings(adaptive=True, decode_stall_tpots=10.0)
    queued = (worker(P0, backlog=5000),)
    loaded = (worker(D0, running=3),)  # 1 s of prefill stalls its streams 50 TPOTs
    route = choose_route(RouteRequest(1000), signals(loaded, queued, prefill_s_per_token=0.001,
                                                     decode_s_per_token=0.001), adaptive)
    assert (route.mode, route.reason) == (DISAGGREGATED, "best_effort")


def test_kv_aware_decode_holding_nearly_all_of_the_prompt_skips_the_prefill_leg():
    kv = KVAwarePolicy(load_tokens=128.0, offload_hit_weight=0.5)
    kv_settings = settings(kv, kv_decode_only_max_tokens=64)
    decode = (worker(D0, cached=0), worker(D1, cached=960))
    request = RouteRequest(1000, blocks_known=True)
    skipped = choose_route(request, signals(decode, (worker(P0, cached=0), worker(P1, cached=512))), kv_settings)
    assert (skipped.mode, skipped.reason, skipped.decode.url, skipped.decode.cached_tokens) == (
        DECODE_ONLY, SKIPPED_DECODE_CACHED, D1, 960)
    partial = (worker(D0, cached=0), worker(D1, cached=512))
    route = choose_route(request, signals(partial, (worker(P0, cached=0), worker(P1, cached=512))), kv_settings)
    assert (route.mode, route.decode.reason, route.prefill.url, route.prefill.cached_tokens) == (
        DISAGGREGATED, CACHE_HIT, P1, 512)


def test_the_decode_workers_predicted_hit_shortens_the_adaptive_estimate():
    kv = KVAwarePolicy(load_tokens=128.0, offload_hit_weight=0.5)
    adaptive = settings(kv, adaptive=True)
    request = RouteRequest(1000, blocks_known=True)
    cached = choose_route(request, signals((worker(D0, cached=995),), (worker(P0),), prefill_s_per_token=0.001,
                                           decode_s_per_token=0.001), adaptive)
    assert (cached.mode, cached.reason) == (DECODE_ONLY, "short")  # 5 uncached tokens
    blind = choose_route(dataclasses.replace(request, blocks_known=False),
                         signals((worker(D0),), (worker(P0),), prefill_s_per_token=0.001, decode_s_per_token=0.001),
                         adaptive)
    assert (blind.decode.reason, blind.decode.turn, blind.reason) == (NO_BLOCKS, "fallback", "prefill_fits")


def test_the_prefill_worker_the_client_named_is_taken_while_it_is_available():
    named = RouteRequest(500, named_prefill_url=P1)
    route = choose_route(named, signals(prefill=(worker(P0), worker(P1, 9))), settings())
    assert (route.prefill.url, route.prefill.reason, route.prefill.turn) == (P1, NAMED, None)
    down = choose_route(named, signals(prefill=(worker(P0), worker(P1, available=False))), settings())
    assert down.prefill.url == P0


def test_a_prefill_retry_prefers_untried_workers_and_reuses_one_only_after_a_connection_failure():
    policy, request, turns = LeastLoadedPolicy(), RouteRequest(500), RoleTurns()
    prefill = (worker(P0), worker(P1, 1))
    assert pick_prefill(policy, request, prefill, turns, tried_urls={P0}).url == P1
    assert pick_prefill(policy, request, prefill, turns, avoid_urls={P0}).url == P1
    assert pick_prefill(policy, request, prefill, turns, tried_urls={P1}, avoid_urls={P0}).url == P0
    assert pick_prefill(policy, request, prefill, turns, tried_urls={P0, P1}) is None
    assert pick_prefill(policy, request, prefill, turns, tried_urls={P0, P1}, may_retry_tried=True).url == P0


def test_pick_worker_offers_only_available_workers_not_excluded():
    offered = (worker(D0, available=False), worker(D1, 5))
    assert pick_worker(LeastLoadedPolicy(), RouteRequest(1), offered, RoleTurns()).url == D1
    assert pick_worker(LeastLoadedPolicy(), RouteRequest(1), offered, RoleTurns(), exclude_urls={D1}) is None


def test_settings_come_from_the_proxy_config():
    config = ProxyConfig(decode_urls=("d:1",), prefill_urls=("p:1",), colocated_fallback=False,
                         routing=RoutingConfig(prefill_policy="round_robin", decode_policy="kv_aware",
                                               disaggregation="adaptive", kv_decode_only_max_tokens=32))
    built = RouteSettings.from_config(config)
    assert isinstance(built.prefill_policy, RoundRobinPolicy) and isinstance(built.decode_policy, KVAwarePolicy)
    assert (built.has_prefill, built.colocated_fallback, built.adaptive, built.kv_decode_only_max_tokens) == (
        True, False, True, 32)
    assert built.slo == Slo(config.slo.ttft_ms, config.slo.ttft_ms_per_token, config.slo.tpot_ms)
