"""Where one request goes: `choose_route`, a pure function from the request and the proxy's signals
to a `Route` (which decode worker, which prefill worker or none, and why) that the forwarder executes.

Invariant: nothing here reads a clock, a live backend or a counter of its own, sends anything or
counts a metric: the same `RouteRequest`, `RouteSignals` and `RouteSettings` give the same `Route`.
The forwarder gathers the signals in one instant and does what the route names (the legs, their
retries through `pick_worker` and `pick_prefill`, the metrics and the rotation turns).

    decode worker by the decode policy            none available -> NO_DECODE (a 503)
    request shape: no prefill tier, or a prompt only decode may compute -> decode-only
    kv_aware decode holds all but a few prompt tokens           -> decode-only (SKIPPED_DECODE_CACHED)
    no prefill worker available, colocated fallback on          -> decode-only (NO_PREFILL)
    disaggregation.decide: the static threshold or the adaptive SLO estimate -> decode-only or P/D
    P/D: the prefill worker the client named, else the prefill policy's pick
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from proxy.config import PolicyName, ProxyConfig, RoutingConfig
from proxy.routing.candidates import NAMED, Candidate, Pick, RoleTurns, RouteRequest
from proxy.routing.disaggregation import DECODE, Decision, Slo, Signals, decide
from proxy.routing.policies import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, RoutingPolicy
from proxy.routing.policies_kv import KVAwarePolicy, decode_alone_suffices

DISAGGREGATED = "disaggregated"
DECODE_ONLY = "decode_only"
# Why a route is decode-only or refused before any estimate (the estimate's reasons: `disaggregation`).
NO_DECODE = "no_decode"  # no decode worker is available: the client gets a 503
NO_PREFILL_TIER = "no_prefill_tier"  # the proxy has no prefill workers at all: it balances decode workers
LOCAL_PROMPT = "local_prompt"  # only the decode worker may compute this prompt
SKIPPED_DECODE_CACHED = "skipped_decode_cached"  # kv_aware: the decode worker holds nearly all of the prompt
NO_PREFILL = "no_prefill"  # no prefill worker is available: the decode worker computes the prompt (fallback)


def build_policy(name: PolicyName, config: RoutingConfig) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "kv_aware":
        return KVAwarePolicy(config.kv_load_tokens, config.kv_offload_hit_weight)
    return PrefixAwarePolicy(config.prefix_max_load)


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """The policy settings a route is chosen by (from `ProxyConfig`, fixed for the proxy's life)."""

    prefill_policy: RoutingPolicy
    decode_policy: RoutingPolicy
    slo: Slo
    has_prefill: bool = True  # the proxy has a prefill tier (static URLs or discovery)
    colocated_fallback: bool = True
    adaptive: bool = False  # --disaggregation adaptive: estimate against the SLO once speeds are measured
    disagg_min_prompt_tokens: int = 0
    decode_stall_tpots: float = 10.0
    kv_decode_only_max_tokens: int = 0

    @classmethod
    def from_config(cls, config: ProxyConfig) -> "RouteSettings":
        routing = config.routing
        return cls(build_policy(routing.prefill_policy, routing), build_policy(routing.decode_policy, routing),
                   Slo(config.slo.ttft_ms, config.slo.ttft_ms_per_token, config.slo.tpot_ms),
                   config.has_prefill, config.colocated_fallback, routing.disaggregation == "adaptive",
                   routing.disagg_min_prompt_tokens, routing.decode_stall_tpots, routing.kv_decode_only_max_tokens)


@dataclass(frozen=True, slots=True)
class RouteSignals:
    """What the proxy knows when it routes: every worker (available or not), the rotation turns and
    the prefill speeds it measured (seconds per prompt token; None until measured)."""

    decode: tuple[Candidate, ...]
    prefill: tuple[Candidate, ...] = ()
    decode_turns: RoleTurns = RoleTurns()
    prefill_turns: RoleTurns = RoleTurns()
    prefill_s_per_token: Optional[float] = None
    decode_s_per_token: Optional[float] = None
    arrivals_per_s: float = 0.0  # requests this proxy routed per second, lately


@dataclass(frozen=True, slots=True)
class Route:
    mode: str  # DISAGGREGATED or DECODE_ONLY (with no decode worker: what the request's shape asked for)
    reason: str  # why this shape: one of the reasons above, or the disaggregation decision's
    decode: Optional[Pick] = None  # None: no decode worker is available
    prefill: Optional[Pick] = None  # P/D's first prefill worker; None with P/D: none available
    decision: Optional[Decision] = None  # the disaggregation estimate, when one was made


def request_mode(request: RouteRequest, settings: RouteSettings) -> str:
    """What the request's shape alone decides (before any worker is looked at)."""
    if not settings.has_prefill or request.needs_local_prompt:
        return DECODE_ONLY
    return DISAGGREGATED


def pick_worker(policy: RoutingPolicy, request: RouteRequest, candidates: Sequence[Candidate], turns: RoleTurns,
                exclude_urls: Collection[str] = ()) -> Optional[Pick]:
    """The policy's pick among the available candidates not excluded; None when there is none."""
    offered = [c for c in candidates if c.available and c.url not in exclude_urls]
    return policy.choose(offered, request, turns) if offered else None


def pick_prefill(policy: RoutingPolicy, request: RouteRequest, candidates: Sequence[Candidate], turns: RoleTurns,
                 tried_urls: Collection[str] = (), avoid_urls: Collection[str] = (),
                 may_retry_tried: bool = False) -> Optional[Pick]:
    """The worker the client named, while it is available and untried; else an untried worker,
    preferably not one to avoid; a tried one again only when `may_retry_tried` (its connection failed:
    a dropped keep-alive connection), never after it answered or timed out."""
    skipped = {*tried_urls, *avoid_urls}
    named = request.named_prefill_url
    if named is not None and named not in skipped:
        if any(c.url == named and c.available for c in candidates):
            return Pick(named, NAMED)
    pick = pick_worker(policy, request, candidates, turns, skipped)
    if pick is None:
        pick = pick_worker(policy, request, candidates, turns, tried_urls)
    if pick is None and may_retry_tried:
        pick = pick_worker(policy, request, candidates, turns)
    return pick


def choose_route(request: RouteRequest, signals: RouteSignals, settings: RouteSettings) -> Route:
    """Where the request goes (see the module docstring)."""
    mode = request_mode(request, settings)
    decode = pick_worker(settings.decode_policy, request, signals.decode, signals.decode_turns)
    if decode is None:
        return Route(mode, NO_DECODE)
    if mode == DECODE_ONLY:
        return Route(DECODE_ONLY, NO_PREFILL_TIER if not settings.has_prefill else LOCAL_PROMPT, decode)
    if decode.cached_tokens is not None and decode_alone_suffices(
            request.num_prompt_tokens, decode.cached_tokens, settings.kv_decode_only_max_tokens):
        return Route(DECODE_ONLY, SKIPPED_DECODE_CACHED, decode)
    available_prefill = [c for c in signals.prefill if c.available]
    if settings.colocated_fallback and not available_prefill:
        return Route(DECODE_ONLY, NO_PREFILL, decode)
    decision = _decide(request, signals, settings, decode, available_prefill)
    if decision.where == DECODE:
        return Route(DECODE_ONLY, decision.reason, decode, decision=decision)
    prefill = pick_prefill(settings.prefill_policy, request, signals.prefill, signals.prefill_turns)
    return Route(DISAGGREGATED, decision.reason, decode, prefill, decision)


def _decide(request: RouteRequest, signals: RouteSignals, settings: RouteSettings, decode: Pick,
            available_prefill: Sequence[Candidate]) -> Decision:
    """Prefill worker or the decode worker itself, by the static threshold or the adaptive estimate."""
    worker = next(c for c in signals.decode if c.url == decode.url)
    estimate = Signals(
        num_prompt_tokens=request.num_prompt_tokens, decode_cached_tokens=decode.cached_tokens or 0,
        prefill_backlog_tokens=min((c.prompt_tokens_in_flight for c in available_prefill), default=0),
        decode_backlog_tokens=worker.prompt_tokens_in_flight, decode_running=worker.num_running,
        decode_arrivals_per_s=signals.arrivals_per_s / max(1, sum(c.available for c in signals.decode)))
    return decide(estimate, settings.slo, signals.prefill_s_per_token if settings.adaptive else None,
                  signals.decode_s_per_token, settings.disagg_min_prompt_tokens, settings.decode_stall_tpots)
