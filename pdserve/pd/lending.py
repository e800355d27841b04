"""The holder's side of every pin another worker reads, engine thread: the lease table of the blocks a
worker lends, the readers' messages about them, early releases and expiry. A prefill worker lends its
finished prefills to decode workers and its prefixes to peers; a decode worker lends its prefixes
(prompt and answer) to peers: both through one `PinLender` (pd/prefill.py, pd/decode.py).

Invariants: a pinned id's blocks stay referenced until exactly one of the reader's "done" or "free"
(carrying the pin's nonce, over the transport), an early release (`release_early`, with the nonce),
or lease expiry; only then is the id reported released for the scheduler to free. A message or
release without the live pin's nonce touches nothing. Pinned blocks never exceed `max_pinned_blocks`
(but for one pin larger than that, pinned alone). Torch-free.

    reader                         lender (this worker)
    READ ... "done" ───────────▶  take_released ──▶ released ids ──▶ the scheduler frees them
    "free" / POST release ─────▶  (the nonce must match the live pin's; else counted stale)
    "renew" ───────────────────▶  lease extended, never past max_pin_s
    silence ───────────────────▶  lease expires ──▶ released
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

from pdserve.metrics import TransferMetrics
from pdserve.pd.leases import LeaseTable
from pdserve.pd.messages import MessageKind, parse_message
from pdserve.transfer.transport import KVTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LenderIdentity:
    """What a reader needs to find and verify a worker that lends blocks."""

    engine_id: str
    epoch: str
    host: str  # the address readers reach this worker's HTTP server on
    port: int  # its internal listener (--internal-port): the handshake and release routes live there
    tp_size: int = 1  # tensor-parallel ranks: a reader reads rank r's slice from rank r


def transfer_epoch(base_epoch: str, generation: int) -> str:
    """The epoch a worker's KV is named by: a new one each time its NIXL agent is replaced (its
    metadata changed, so readers must handshake again and pins of the old agent are stale)."""
    return base_epoch if generation == 0 else f"{base_epoch}.{generation}"


class PinLender:
    """The lease table of a worker's lent blocks, and the news about them."""

    def __init__(self, transport: KVTransport, leases: LeaseTable, identity: LenderIdentity,
                 metrics: TransferMetrics, max_pinned_blocks: Optional[int] = None):
        self.transport = transport
        self.leases = leases
        self.identity = identity
        self._base_epoch = identity.epoch
        self.metrics = metrics
        self.max_pinned_blocks = max_pinned_blocks  # None: no cap
        self._released_early: list[str] = []
        if max_pinned_blocks is not None:
            metrics.pinned_blocks_limit.set(max_pinned_blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return self.leases.num_pinned_blocks

    def has_room_to_pin(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more may be pinned (read from other threads too: plain int compares).
        A pin larger than the whole limit may be made when nothing else is, or it could never be."""
        cap, pinned = self.max_pinned_blocks, self.leases.num_pinned_blocks
        return cap is None or pinned + num_blocks <= cap or pinned == 0

    def release_early(self, request_id: str, nonce: str) -> None:
        """A caller gave up on a pin (the proxy after a failed decode leg, a puller that will not read):
        free at the next poll. Only with the pin's nonce: a bare id, or a late release of an earlier pin,
        frees nothing."""
        if not self.leases.holds(request_id, nonce):
            self.metrics.rejected_messages.labels(reason="stale").inc()
            logger.info("pin %s: release ignored, no live pin carries its nonce", request_id)
            return
        if self.leases.release(request_id):
            self._released_early.append(request_id)
            logger.info("pin %s: blocks released (its reader gave up on it)", request_id)

    def has_pending(self) -> bool:
        return self.leases.num_pinned_requests > 0 or bool(self._released_early)

    def take_released(self, payloads: Iterable[bytes]) -> list[str]:
        """Apply early releases and readers' messages (`payloads`: the transport's notifications), then
        expire leases that ran out; returns the ids released, for the scheduler to free."""
        released, self._released_early = self._released_early, []
        for payload in payloads:
            self._apply_message(payload, released)
        epoch = transfer_epoch(self._base_epoch, self.transport.generation)
        if epoch != self.identity.epoch:  # the agent was replaced: new pins name the new one
            self.identity = dataclasses.replace(self.identity, epoch=epoch)
        for request_id in self.leases.expire():
            released.append(request_id)
            self.metrics.expired_leases.inc()
            logger.warning("pin %s: lease expired before its reader read it; blocks freed", request_id)
        self.metrics.pinned_blocks.set(self.leases.num_pinned_blocks)
        return released

    def _apply_message(self, payload: bytes, released: list[str]) -> None:
        message = parse_message(payload)
        if message is None:
            self.metrics.rejected_messages.labels(reason="malformed").inc()
            logger.warning("ignoring malformed KV message %r", payload[:80])
            return
        if not self.leases.holds(message.request_id, message.nonce):
            # Late (the pin was released, or a newer pin reuses the id) or forged: it touches nothing.
            self.metrics.rejected_messages.labels(reason="stale").inc()
            logger.info("ignoring a %s message for pin %s: no live pin carries its nonce", message.kind.value,
                        message.request_id)
            return
        if message.kind is MessageKind.RENEW:
            self.leases.renew([message.request_id])
        elif self.leases.release(message.request_id):  # "done" or "free"
            released.append(message.request_id)
            logger.info("pin %s: blocks released (%s)", message.request_id, message.kind.value)
