"""The kv_aware policy: the worker that computes least, counting its queue, serves.

    score(w) = (prompt tokens - worth of the prefix cached on w) + load_tokens * load(w)
    worth    = device tokens + offload_hit_weight * offload-tier tokens

A prefix the worker must first load from its offload tier is worth less than
one already on its device (a copy and a wait in the loading state) and more
than a miss (a copy is far cheaper than computing): `offload_hit_weight`
(--kv-offload-hit-weight, strictly between 0 and 1) says how much. `load(w)` is
the score the least_loaded policy uses (queued + running requests, plus 4 x
KV usage); `load_tokens` (--kv-load-tokens) prices one unit of load in prompt
tokens. Lowest score wins; ties go to the worthier cached prefix, then round
robin. Invariant: `rank` and `choose` are pure functions of their inputs (explain
uses `rank`), and `choose` always returns one of the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from proxy.routing.candidates import FALLBACK_TURN, POLICY_TURN, Candidate, Pick, RoleTurns, RouteRequest
from proxy.routing.kv_index import CachedPrefix
from proxy.routing.policies import Routable, least_loaded

CACHE_HIT = "cache_hit"  # the winner holds the worthiest cached prefix on offer (a device hit beats a tier one)
LOAD = "load"  # another worker held more of the prompt, but its queue cost more
NO_HIT = "no_hit"  # nobody held any of it: load alone decided
NO_BLOCKS = "no_blocks"  # the prompt's blocks are unknown (tokenizer not loaded, or a malformed request)
KV_REASONS = (CACHE_HIT, LOAD, NO_HIT, NO_BLOCKS)


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    backend: Routable
    cached_tokens: int  # what the worker will report cached, tier included (the prediction checked)
    offload_tokens: int  # of those, the ones it loads from its offload tier first
    cached_worth_tokens: float  # device tokens + offload_hit_weight * offload tokens
    load: float
    score: float

    def as_dict(self) -> dict:
        return {"url": self.backend.url, "cached_tokens": self.cached_tokens, "offload_tokens": self.offload_tokens,
                "load": round(self.load, 3), "score": round(self.score, 3)}


def score_candidate(backend: Routable, cached: CachedPrefix, num_prompt_tokens: int, load_tokens: float,
                    offload_hit_weight: float) -> ScoredCandidate:
    load = backend.load_score()
    worth = cached.num_device_tokens + offload_hit_weight * cached.num_offload_tokens
    return ScoredCandidate(backend, cached.num_tokens, cached.num_offload_tokens, worth, load,
                           (num_prompt_tokens - worth) + load_tokens * load)


def rank(scored: Sequence[ScoredCandidate]) -> list[ScoredCandidate]:
    """Best first: lowest score, then the worthiest cached prefix, then URL (a stable order for ties)."""
    return sorted(scored, key=lambda c: (c.score, -c.cached_worth_tokens, c.backend.url))


def reason_for(choice: ScoredCandidate, scored: Sequence[ScoredCandidate]) -> str:
    if max(c.cached_tokens for c in scored) == 0:
        return NO_HIT
    most_worth = max(c.cached_worth_tokens for c in scored)
    return CACHE_HIT if choice.cached_worth_tokens == most_worth else LOAD


def choose_scored(scored: Sequence[ScoredCandidate], turn: int) -> tuple[ScoredCandidate, str]:
    """The best candidate and why; exact ties (typically: nothing cached, equal load) rotate by `turn`,
    as least_loaded's do."""
    ranked = rank(scored)
    best = ranked[0]
    tied = [c for c in ranked if (c.score, c.cached_worth_tokens) == (best.score, best.cached_worth_tokens)]
    choice = tied[turn % len(tied)]
    return choice, reason_for(choice, scored)


def decode_alone_suffices(num_prompt_tokens: int, cached_tokens: int, max_uncached_tokens: int) -> bool:
    """Cache-aware disaggregation: the decode worker holds all but at most `max_uncached_tokens` of the
    prompt (0: never skip the prefill leg)."""
    return max_uncached_tokens > 0 and cached_tokens > 0 and num_prompt_tokens - cached_tokens <= max_uncached_tokens


@dataclass(frozen=True, slots=True)
class KVAwarePolicy:
    """One per role. Without the prompt's blocks it is least_loaded on its fallback rotation."""

    load_tokens: float
    offload_hit_weight: float

    def choose(self, offered: Sequence[Candidate], request: RouteRequest, turns: RoleTurns) -> Pick:
        if not request.blocks_known:
            return Pick(least_loaded(offered, turns.fallback).url, NO_BLOCKS, FALLBACK_TURN)
        scored = [score_candidate(c, c.cached or CachedPrefix(), request.num_prompt_tokens, self.load_tokens,
                                  self.offload_hit_weight) for c in offered]
        choice, reason = choose_scored(scored, turns.policy)
        return Pick(choice.backend.url, reason, POLICY_TURN, choice.cached_tokens)
