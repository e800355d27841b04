"""Leases on a prefill worker's pinned KV blocks, one per finished remote-decode prefill.

Invariant: every pinned request is released exactly once — by the reader's
completion notification, by an explicit early release, or when its lease
expires — so a dead decode worker can hold blocks for at most one lease, and
a live one (renewing) for at most `max_pin_s`. Each pin carries a random
nonce, handed to the reader in kv_transfer_params: a message about a pin is
honoured only with it (`holds`), so a late message cannot touch a newer pin
that reuses the request id, nor a stranger renew a pin it never saw.
`num_pinned_blocks` is a running count (a plain int other threads may read).
Torch-free; the caller frees the blocks of whatever `release`/`expire` return.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

PIN_NONCE_HEX_CHARS = 32


def new_pin_nonce() -> str:
    return secrets.token_hex(PIN_NONCE_HEX_CHARS // 2)


@dataclass(slots=True)
class Lease:
    request_id: str
    num_blocks: int
    expires_at_s: float
    nonce: str
    ends_by_s: float  # no renewal extends the pin past this


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, max_pin_s: Optional[float] = None,
                 nonce_factory: Callable[[], str] = new_pin_nonce):
        self.lease_s = lease_s
        self.max_pin_s = max_pin_s  # None: renewals may go on as long as the reader asks
        self.clock = clock
        self._new_nonce = nonce_factory
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
        now = self.clock()
        ends_by_s = now + self.max_pin_s if self.max_pin_s is not None else float("inf")
        lease = Lease(request_id, num_blocks, min(now + self.lease_s, ends_by_s), self._new_nonce(), ends_by_s)
        self._leases[request_id] = lease
        self._num_pinned_blocks += num_blocks
        return lease

    def holds(self, request_id: str, nonce: str) -> bool:
        """Whether `nonce` is the one of the live pin of `request_id` (compared in constant time)."""
        lease = self._leases.get(request_id)
        return lease is not None and hmac.compare_digest(lease.nonce.encode(), nonce.encode())

    def renew(self, request_ids: Iterable[str]) -> list[str]:
        """Extend the leases that still exist, never past their `max_pin_s`; returns the ids renewed."""
        renewed = []
        deadline = self.clock() + self.lease_s
        for request_id in request_ids:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.expires_at_s = min(deadline, lease.ends_by_s)
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
