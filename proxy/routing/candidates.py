"""The vocabulary of route choice: a worker as routing sees it, a request's routing facts, a pick.

Invariant: these records are frozen snapshots taken in one instant; nothing that chooses a route
reads a live `Backend` or a clock, so the same records always give the same route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from proxy.routing.kv_index import CachedPrefix

if TYPE_CHECKING:
    from proxy.backends import Backend

POLICY_TURN = "policy"  # the rotation of the role's policy (round robin, ties of least_loaded and kv_aware)
FALLBACK_TURN = "fallback"  # the rotation of its least_loaded fallback (prefix over its cap, kv_aware blind)
NAMED = "named"  # the prefill worker the client named (x-prefiller-host-port)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker at the moment of choosing."""

    url: str
    available: bool  # healthy, its breaker lets a request through, not saturated
    load: float  # `Backend.load_score()`: queued + running requests, plus KV pressure
    prompt_tokens_in_flight: int = 0  # prompt tokens it is computing for this proxy now
    num_running: int = 0  # requests it serves: the proxy's count or its own report, the larger
    cached: Optional[CachedPrefix] = None  # the KV index's prediction for this request (kv_aware only)

    def load_score(self) -> float:
        return self.load

    @classmethod
    def of(cls, backend: "Backend", cached: Optional[CachedPrefix] = None) -> "Candidate":
        # A decode leg still waiting for its prefill (both legs at once) is not served yet: not counted.
        return cls(backend.url, backend.is_available(), backend.load_score(), backend.prompt_tokens_in_flight,
                   max(backend.num_in_flight - backend.num_awaiting_ticket, backend.load.num_running), cached)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs of a client request (`proxy.client_request.ClientRequest`)."""

    num_prompt_tokens: int  # exact when the prompt's blocks are known, else the estimate
    prefix_key: bytes = b""  # the start of the prompt (prefix policy)
    needs_local_prompt: bool = False  # only the decode worker may compute this prompt
    named_prefill_url: Optional[str] = None  # a known prefill worker the client named
    blocks_known: bool = False  # kv_aware: the prompt's block hashes (and so each candidate's `cached`) are known


@dataclass(frozen=True, slots=True)
class RoleTurns:
    """How many picks each rotation of one role has made: the tie-breaker of round robin and of ties."""

    policy: int = 0
    fallback: int = 0

    def after(self, pick: Optional["Pick"]) -> "RoleTurns":
        """The turns once `pick` is executed (a pick advances the rotation it used, if any)."""
        if pick is None or pick.turn is None:
            return self
        if pick.turn == POLICY_TURN:
            return RoleTurns(self.policy + 1, self.fallback)
        return RoleTurns(self.policy, self.fallback + 1)


@dataclass(frozen=True, slots=True)
class Pick:
    """One worker chosen, and why."""

    url: str
    reason: str  # the policy's word: round_robin, least_loaded, prefix, prefix_busy, named, or kv_aware's
    turn: Optional[str] = None  # POLICY_TURN or FALLBACK_TURN: the rotation it used (None: none)
    cached_tokens: Optional[int] = None  # kv_aware: the prediction, checked against the worker's answer
