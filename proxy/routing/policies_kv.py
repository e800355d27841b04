"""The kv_aware policy: the worker that computes least, counting its queue, serves.

    score(w) = (prompt tokens - tokens cached on w) + load_tokens * load(w)

`load(w)` is the score the least_loaded policy uses (queued + running requests,
plus 4 x KV usage); `load_tokens` (--kv-load-tokens) prices one unit of load in
prompt tokens. Lowest score wins; ties go to the longer cached prefix, then
round robin. Invariant: `rank` is a pure function of its inputs (explain uses
it), and `choose` always returns one of the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from proxy.backends import Backend

CACHE_HIT = "cache_hit"  # the winner holds the longest cached prefix on offer
LOAD = "load"  # another worker held more of the prompt, but its queue cost more
NO_HIT = "no_hit"  # nobody held any of it: load alone decided
NO_BLOCKS = "no_blocks"  # the prompt's blocks are unknown (tokenizer not loaded, or a malformed request)


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    backend: Backend
    cached_tokens: int
    load: float
    score: float

    def as_dict(self) -> dict:
        return {"url": self.backend.url, "cached_tokens": self.cached_tokens, "load": round(self.load, 3),
                "score": round(self.score, 3)}


def score_candidate(backend: Backend, cached_tokens: int, num_prompt_tokens: int,
                    load_tokens: float) -> ScoredCandidate:
    load = backend.load_score()
    return ScoredCandidate(backend, cached_tokens, load, (num_prompt_tokens - cached_tokens) + load_tokens * load)


def rank(scored: Sequence[ScoredCandidate]) -> list[ScoredCandidate]:
    """Best first: lowest score, then most cached tokens, then URL (a stable order for ties)."""
    return sorted(scored, key=lambda c: (c.score, -c.cached_tokens, c.backend.url))


def reason_for(choice: ScoredCandidate, scored: Sequence[ScoredCandidate]) -> str:
    most_cached = max(c.cached_tokens for c in scored)
    if most_cached == 0:
        return NO_HIT
    return CACHE_HIT if choice.cached_tokens == most_cached else LOAD


class KVAwarePolicy:
    """One per role. Exact ties (typically: nothing cached, equal load) rotate, as least_loaded does."""

    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, scored: Sequence[ScoredCandidate]) -> tuple[ScoredCandidate, str]:
        ranked = rank(scored)
        best = ranked[0]
        tied = [c for c in ranked if (c.score, c.cached_tokens) == (best.score, best.cached_tokens)]
        choice = tied[self._num_chosen % len(tied)]
        self._num_chosen += 1
        return choice, reason_for(choice, scored)
