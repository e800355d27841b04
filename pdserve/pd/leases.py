"""Leases on a prefill worker's pinned KV blocks, one per finished remote-decode prefill.

Invariant: every pinned request is released exactly once — by the reader's
completion notification, by an explicit early release, or when its lease
expires — so a dead decode worker can hold blocks for at most one lease.
`num_pinned_blocks` is a running count (a plain int other threads may read).
Torch-free; the caller frees the blocks of whatever `release`/`expire` return.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(slots=True)
class Lease:
    request_id: str
    num_blocks: int
    expires_at_s: float


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._num_pinned_blocks = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    @property
    def num_pinned_requests(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned_blocks

    def pin(self, request_id: str, num_blocks: int) -> Lease:
        self.release(request_id)  # never counted twice
        lease = Lease(request_id, num_blocks, self.clock() + self.lease_s)
        self._leases[request_id] = lease
        self._num_pinned_blocks += num_blocks
        return lease

    def renew(self, request_ids: Iterable[str]) -> list[str]:
        """Extend the leases that still exist; returns the ids renewed."""
        renewed = []
        deadline = self.clock() + self.lease_s
        for request_id in request_ids:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.expires_at_s = deadline
                renewed.append(request_id)
        return renewed

    def release(self, request_id: str) -> bool:
        """True when the request was pinned (the caller frees its blocks now)."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._num_pinned_blocks -= lease.num_blocks
        return True

    def expire(self) -> list[str]:
        """Drop and return the leases whose time ran out."""
        now = self.clock()
        gone = [rid for rid, lease in self._leases.items() if lease.expires_at_s <= now]
        for request_id in gone:
            self.release(request_id)
        return gone
