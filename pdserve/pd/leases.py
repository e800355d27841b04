"""Leases on a prefill worker's pinned KV blocks, one per finished remote-decode prefill.

Invariant: every pinned request is released exactly once — by the reader's
completion notification, by an explicit early release, or when its lease
expires — so a dead decode worker can hold blocks for at most one lease, and
a live one (renewing) for at most `max_pin_s`. Each pin carries a random
nonce, handed to the reader in kv_transfer_params: a message about a pin is
honoured only with it (`holds`), so a late message cannot touch a newer pin
that reuses the request id, nor a stranger renew a pin it never saw.
A pin's ticket (P's record of its blocks and prompt) is handed out at most
once, to whoever shows the nonce (`claim`, called from the HTTP side): two
readers can never both be told where the blocks are.
`num_pinned_blocks` is a running count (a plain int other threads may read).
The table's dict is guarded by a lock held only for dict work, never across
I/O, so the engine thread never waits on more than a few dict operations.
Torch-free; the caller frees the blocks of whatever `release`/`expire` return.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Optional, TypeVar

TicketT = TypeVar("TicketT")

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
    ticket: object = None  # P's record of the pin (frozen), handed to the one reader that claims it
    claimed: bool = False


class ClaimOutcome(enum.Enum):
    GRANTED = "granted"
    UNKNOWN = "unknown"  # no live pin of that id carries that nonce (never pinned, released, expired, forged)
    ALREADY_CLAIMED = "already_claimed"  # a reader was already told where the blocks are


@dataclass(frozen=True, slots=True)
class Claim(Generic[TicketT]):
    outcome: ClaimOutcome
    ticket: Optional[TicketT] = None
    lease_left_s: float = 0.0


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, max_pin_s: Optional[float] = None,
                 nonce_factory: Callable[[], str] = new_pin_nonce):
        self.lease_s = lease_s
        self.max_pin_s = max_pin_s  # None: renewals may go on as long as the reader asks
        self.clock = clock
        self._new_nonce = nonce_factory
        self._leases: dict[str, Lease] = {}
        self._num_pinned_blocks = 0
        self._lock = threading.Lock()  # the HTTP side claims tickets while the engine thread pins and frees

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    @property
    def num_pinned_requests(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned_blocks

    def pin(self, request_id: str, num_blocks: int, ticket: object = None) -> Lease:
        """`ticket`: an immutable record of the pin that `claim` hands out once."""
        self.release(request_id)  # never counted twice
        now = self.clock()
        ends_by_s = now + self.max_pin_s if self.max_pin_s is not None else float("inf")
        lease = Lease(request_id, num_blocks, min(now + self.lease_s, ends_by_s), self._new_nonce(), ends_by_s,
                      ticket)
        with self._lock:
            self._leases[request_id] = lease
            self._num_pinned_blocks += num_blocks
        return lease

    def holds(self, request_id: str, nonce: str) -> bool:
        """Whether `nonce` is the one of the live pin of `request_id` (compared in constant time)."""
        lease = self._leases.get(request_id)
        return lease is not None and hmac.compare_digest(lease.nonce.encode(), nonce.encode())

    def claim(self, request_id: str, nonce: str) -> Claim:
        """The pin's ticket, to the first caller that shows its nonce (any thread). A wrong nonce and an
        unknown id answer alike, so a caller without the nonce learns nothing of which ids are pinned."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not hmac.compare_digest(lease.nonce.encode(), nonce.encode()):
                return Claim(ClaimOutcome.UNKNOWN)
            if lease.claimed or lease.ticket is None:
                return Claim(ClaimOutcome.ALREADY_CLAIMED)
            lease.claimed = True
            return Claim(ClaimOutcome.GRANTED, lease.ticket, max(0.0, lease.expires_at_s - self.clock()))

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
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self._num_pinned_blocks -= lease.num_blocks
        return True

    def expire(self) -> list[str]:
        """Drop and return the leases whose time ran out."""
        now = self.clock()
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if lease.expires_at_s <= now]
        for request_id in gone:
            self.release(request_id)
        return gone
