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
robin. Invariant: `rank` is a pure function of its inputs (explain uses it),
and `choose` always returns one of the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from proxy.backends import Backend
from proxy.routing.kv_index import CachedPrefix

CACHE_HIT = "cache_hit"  # the winner holds the worthiest cached prefix on offer (a device hit beats a tier one)
LOAD = "load"  # another worker held more of the prompt, but its queue cost more
NO_HIT = "no_hit"  # nobody held any of it: load alone decided
NO_BLOCKS = "no_blocks"  # the prompt's blocks are unknown (tokenizer not loaded, or a malformed request)


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    backend: Backend
    cached_tokens: int  # what the worker will report cached, tier included (the prediction checked)
    offload_tokens: int  # of those, the ones it loads from its offload tier first
    cached_worth_tokens: float  # device tokens + offload_hit_weight * offload tokens
    load: float
    score: float

    def as_dict(self) -> dict:
        return {"url": self.backend.url, "cached_tokens": self.cached_tokens, "offload_tokens": self.offload_tokens,
                "load": round(self.load, 3), "score": round(self.score, 3)}


def score_candidate(backend: Backend, cached: CachedPrefix, num_prompt_tokens: int, load_tokens: float,
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


class KVAwarePolicy:
    """One per role. Exact ties (typically: nothing cached, equal load) rotate, as least_loaded does."""

    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, scored: Sequence[ScoredCandidate]) -> tuple[ScoredCandidate, str]:
        ranked = rank(scored)
        best = ranked[0]
        tied = [c for c in ranked if (c.score, c.cached_worth_tokens) == (best.score, best.cached_worth_tokens)]
        choice = tied[self._num_chosen % len(tied)]
        self._num_chosen += 1
        return choice, reason_for(choice, scored)
