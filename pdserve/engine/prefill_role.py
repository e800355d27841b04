"""Prefill-worker side of P/D: pin a finished remote-decode prefill's blocks for
the decode worker and free them when it has read them or its lease runs out.

Invariant: a pinned request's blocks stay allocated (so nothing can reuse
them under a remote READ) until exactly one of: the reader's completion
notification, an early-release message, or lease expiry. Runs on the engine
thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.manager import KVCacheManager
from pdserve.metrics import TransferMetrics
from pdserve.request import FinishReason, Request
from pdserve.transfer.leases import LeaseTable
from pdserve.transfer.messages import parse_message
from pdserve.transfer.params import RemotePrefillParams
from pdserve.transfer.transport import KVTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillIdentity:
    """What a decode worker needs to find and verify this prefill worker."""

    engine_id: str
    epoch: str
    host: str  # the address decode workers reach this worker's HTTP server on
    port: int


def wants_remote_decode(request: Request) -> bool:
    params = request.kv_transfer_params
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def remote_block_ids_for(kv: KVCacheManager, request_id: str, num_prompt_tokens: int) -> list[list[int]]:
    """Per group, the blocks a decode worker must pull to compute the last
    prompt token itself: sliding groups clipped to that token's window.
    Each list is the tail of the group's table ending at the prompt's last block."""
    tables = kv.live_block_ids(request_id, num_prompt_tokens - 1)
    num_prompt_blocks = -(-num_prompt_tokens // kv.block_size)
    return [[b for b in table[:num_prompt_blocks] if b != NULL_BLOCK_ID] for table in tables]


class PrefillRole:
    def __init__(self, kv: KVCacheManager, transport: KVTransport, leases: LeaseTable,
                 identity: PrefillIdentity, metrics: TransferMetrics):
        self.kv = kv
        self.transport = transport
        self.leases = leases
        self.identity = identity
        self.metrics = metrics

    # ---- scheduler hooks ---------------------------------------------------------

    def admit_remote(self, request: Request, budget: int) -> Optional[bool]:
        return None  # a prefill worker never pulls

    def retain(self, request: Request, reason: FinishReason) -> bool:
        if not wants_remote_decode(request) or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return False
        if request.num_computed_tokens < request.num_prompt_tokens:
            return False
        block_ids = remote_block_ids_for(self.kv, request.request_id, request.num_prompt_tokens)
        lease = self.leases.pin(request.request_id, sum(len(ids) for ids in block_ids))
        request.kv_transfer_params = RemotePrefillParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.identity.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=block_ids,
            remote_host=self.identity.host,
            remote_port=self.identity.port,
            tp_size=1,
            remote_epoch=self.identity.epoch,
            num_prompt_tokens=request.num_prompt_tokens,
            lease_s=self.leases.lease_s,
        ).to_wire()
        self.metrics.pinned_blocks.set(self.leases.num_pinned_blocks)
        logger.info("request %s: %d blocks pinned for a decode worker (lease %.0fs)",
                    request.request_id, lease.num_blocks, self.leases.lease_s)
        return True

    # ---- engine-loop tick ----------------------------------------------------------

    @property
    def num_pinned_blocks(self) -> int:
        return self.leases.num_pinned_blocks

    def has_pending(self) -> bool:
        return self.leases.num_pinned_requests > 0

    def tick(self) -> list[tuple[str, str]]:
        """Apply readers' messages, then expire leases that ran out. Ends no request."""
        for payload in self.transport.poll_notifications():
            self._apply_message(payload)
        for request_id in self.leases.expire():
            self.kv.free(request_id)
            self.metrics.expired_leases.inc()
            logger.warning("request %s: lease expired before a decode worker read it; blocks freed", request_id)
        self.metrics.pinned_blocks.set(self.leases.num_pinned_blocks)
        return []

    def _apply_message(self, payload: bytes) -> None:
        message = parse_message(payload)
        if message is None:
            logger.warning("ignoring malformed KV message %r", payload[:80])
            return
        if message.kind == "renew":
            self.leases.renew([message.request_id])
        elif self.leases.release(message.request_id):  # "done" or "free"
            self.kv.free(message.request_id)
            logger.info("request %s: blocks released (%s)", message.request_id, message.kind)
