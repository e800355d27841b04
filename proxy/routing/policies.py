"""Routing policies: which of the available backends of one role serves a request.

Each policy sees only backends that are available right now (healthy, breaker
closed or on trial, not saturated) and must return one of them; the caller
handles the empty case. Prefill and decode each get their own policy object.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

from proxy.backends import Backend
from proxy.config import PolicyName, RoutingConfig


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Backend], prefix_key: bytes) -> Backend:
        """Pick one of `candidates` (never empty). `prefix_key` names the prompt's prefix."""


class RoundRobinPolicy:
    """Each backend in turn; a backend that drops out is simply skipped."""

    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, candidates: Sequence[Backend], prefix_key: bytes) -> Backend:
        ordered = sorted(candidates, key=lambda b: b.url)  # stable order whatever the pool's history
        backend = ordered[self._num_chosen % len(ordered)]
        self._num_chosen += 1
        return backend


class LeastLoadedPolicy:
    """Lowest load score (queued + running requests and KV usage); ties go round robin."""

    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, candidates: Sequence[Backend], prefix_key: bytes) -> Backend:
        lowest = min(b.load_score() for b in candidates)
        tied = sorted((b for b in candidates if b.load_score() == lowest), key=lambda b: b.url)
        backend = tied[self._num_chosen % len(tied)]
        self._num_chosen += 1
        return backend


def rendezvous_rank(prefix_key: bytes, url: str) -> int:
    """Highest-random-weight hashing: adding or removing a backend moves only its own prefixes."""
    digest = hashlib.blake2b(prefix_key + b"\0" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAwarePolicy:
    """The same prompt prefix goes to the same backend (its prefix cache is warm there),
    unless that backend's load reached `max_load`: then the least loaded one serves."""

    def __init__(self, max_load: int) -> None:
        self._max_load = max_load
        self._fallback = LeastLoadedPolicy()

    def choose(self, candidates: Sequence[Backend], prefix_key: bytes) -> Backend:
        preferred = max(candidates, key=lambda b: rendezvous_rank(prefix_key, b.url))
        if preferred.load_score() < self._max_load:
            return preferred
        return self._fallback.choose(candidates, prefix_key)


def build_policy(name: PolicyName, config: RoutingConfig) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name in ("least_loaded", "kv_aware"):  # kv_aware scores in proxy/routing/kv_routing.py; this is its fallback
        return LeastLoadedPolicy()
    return PrefixAwarePolicy(config.prefix_max_load)
