"""Routing policies: which of the offered workers of one role serves a request.

Invariant: a policy is pure. It sees only workers offered right now (available, not excluded; never
an empty list), the request's routing facts and the role's rotation turns, and returns a `Pick` of
one of them naming the rotation it used; the forwarder advances that turn when it executes the pick.
A policy object holds settings only. Prefill and decode each get their own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar

from proxy.routing.candidates import FALLBACK_TURN, POLICY_TURN, Candidate, Pick, RoleTurns, RouteRequest

ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
PREFIX = "prefix"  # the prefix's own worker
PREFIX_BUSY = "prefix_busy"  # the prefix's worker was at its cap: the least loaded one


class Routable(Protocol):
    """What a policy reads of a worker (a `Candidate`, or a live `Backend` for /kv/explain)."""

    @property
    def url(self) -> str: ...

    def load_score(self) -> float: ...


R = TypeVar("R", bound=Routable)


class RoutingPolicy(Protocol):
    def choose(self, offered: Sequence[Candidate], request: RouteRequest, turns: RoleTurns) -> Pick:
        """One of `offered` (never empty)."""


def round_robin(offered: Sequence[R], turn: int) -> R:
    """Each worker in turn, in a stable order whatever the pool's history; one that dropped out is skipped."""
    ordered = sorted(offered, key=lambda b: b.url)
    return ordered[turn % len(ordered)]


def least_loaded(offered: Sequence[R], turn: int) -> R:
    """Lowest load score (queued + running requests and KV usage); ties go round robin."""
    lowest = min(b.load_score() for b in offered)
    return round_robin([b for b in offered if b.load_score() == lowest], turn)


def rendezvous_rank(prefix_key: bytes, url: str) -> int:
    """Highest-random-weight hashing: adding or removing a backend moves only its own prefixes."""
    digest = hashlib.blake2b(prefix_key + b"\0" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class RoundRobinPolicy:
    def choose(self, offered: Sequence[Candidate], request: RouteRequest, turns: RoleTurns) -> Pick:
        return Pick(round_robin(offered, turns.policy).url, ROUND_ROBIN, POLICY_TURN)


class LeastLoadedPolicy:
    def choose(self, offered: Sequence[Candidate], request: RouteRequest, turns: RoleTurns) -> Pick:
        return Pick(least_loaded(offered, turns.policy).url, LEAST_LOADED, POLICY_TURN)


@dataclass(frozen=True, slots=True)
class PrefixAwarePolicy:
    """The same prompt prefix goes to the same backend (its prefix cache is warm there),
    unless that backend's load reached `max_load`: then the least loaded one serves."""

    max_load: int

    def choose(self, offered: Sequence[Candidate], request: RouteRequest, turns: RoleTurns) -> Pick:
        preferred = max(offered, key=lambda b: rendezvous_rank(request.prefix_key, b.url))
        if preferred.load_score() < self.max_load:
            return Pick(preferred.url, PREFIX)
        return Pick(least_loaded(offered, turns.fallback).url, PREFIX_BUSY, FALLBACK_TURN)
