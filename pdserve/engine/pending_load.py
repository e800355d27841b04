"""One record per loading request (WAITING_FOR_REMOTE_KV): which parts of its KV are still being
written into its blocks, and what the request does once none is.

    part            who writes the blocks            reported by
    pull            a prefill worker or, for a        the connector's KVEvents (landed / failed)
                    peer pull, any peer (NIXL READ)
    tier read       this worker's offload tier       the KV manager's poll_offload (landed / failed)
    ticket          nobody yet: P still computes     the ticket's delivery (Scheduler.take_ticket), then
                    (D holds the blocks for it)      the pull above starts at once

A request awaiting its ticket holds every block its prompt needs (counted against the pool and the
running cap like any loading request) but is never scheduled for compute until the pull has landed.

Invariant: a record has at least one part in flight until it is removed; the request moves on
(runs from `resume_at`, recomputes, or fails with `error`) only when no part still writes its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.api.errors import PdserveError
from pdserve.request import Request


@dataclass(slots=True)
class PendingLoad:
    request: Request
    resume_at: int  # computed tokens once everything landed (the prefix, or all but the last prompt token)
    pulling: bool  # prompt KV coming from a prefill worker
    reading_tier: bool  # prefix pages coming from this worker's offload tier
    failed: bool = False  # a part failed: recompute, or fail with `error`
    error: Optional[PdserveError] = None  # set when a failed part says the request must fail (outranks a recompute)
    peer: bool = False  # the pull is a peer pull (a prefix from any worker), not a P/D handoff
    awaiting_ticket: bool = False  # D reserved the blocks; P's ticket (what to pull) has not come yet

    @property
    def in_flight(self) -> bool:
        """Whether some part still writes the request's blocks, or will once its ticket comes."""
        return self.pulling or self.reading_tier or self.awaiting_ticket

    def part_failed(self, error: Optional[PdserveError]) -> None:
        self.failed = True
        self.error = self.error or error
