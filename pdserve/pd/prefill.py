"""Prefill side of P/D, engine thread: keep a finished remote-decode prefill's blocks for the decode worker.

Invariants: a pinned request's blocks stay allocated (nothing can reuse them
under a remote READ) until exactly one of: the reader's completion
notification, an early-release message (D's "free", or the proxy's release
call once the decode leg failed, both carrying the pin's nonce), or lease
expiry; only then are they
reported `released` for the scheduler to free (the lease discipline is pd/lending.py's, shared with
every worker that lends). A state model's pin holds, per
state group, the request's handoff page (the state after all but the last
prompt token, kv/state_pages.py) beside its attention blocks: the scheduler
passes the tables with those pages in place of the live ones. Pinned blocks never exceed
`max_pinned_blocks` (but for one request larger than that, pinned alone): a
prefill that would pass it ends with 503 instead of pinning. The block ids a
reader may use come only from the pin's ticket (`claim_ticket`, handed out
once, to the nonce's holder), which names the digest of the prompt the
blocks were computed from. Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional, Sequence

from pdserve.api.handoff import prefill_parts
from pdserve.api.kv_transfer import KVPinnedFull, PinTicket, RemotePrefillParams, prompt_digest
from pdserve.api.sampling import FinishReason
from pdserve.kv.block_pool import NULL_BLOCK_ID, KVInvariantError
from pdserve.kv.specs import KVGroupPlan
from pdserve.metrics import TransferMetrics
from pdserve.pd.connector import ADMIT_LOCAL, FREE_NOW, Admission, FinishAction, KVEvents
from pdserve.pd.geometry import handoff_ranges, handoff_slices
from pdserve.pd.leases import Claim, LeaseTable
from pdserve.pd.lending import LenderIdentity, PinLender
from pdserve.request import Request
from pdserve.transfer.transport import KVTransport

logger = logging.getLogger(__name__)


PrefillIdentity = LenderIdentity  # what a decode worker needs to find and verify this prefill worker


class PrefillConnector(PinLender):
    """The prefill worker's `KVConnector`: a `PinLender` (its P/D pins and its peer pins share one lease
    table) that pins each finished remote-decode prefill."""

    def __init__(self, transport: KVTransport, leases: LeaseTable, identity: LenderIdentity, plan: KVGroupPlan,
                 block_size: int, metrics: TransferMetrics, max_pinned_blocks: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(transport, leases, identity, metrics, max_pinned_blocks)
        self.clock = clock  # the engine's clock: the request's arrival and first token were read on it
        self.plan = plan
        self.block_size = block_size

    # ---- the scheduler's questions --------------------------------------------------

    def request_added(self, request: Request) -> None:
        pass

    def plan_admission(self, request: Request) -> Admission:
        return ADMIT_LOCAL  # a prefill worker computes every prompt itself

    def start_pull(self, request: Request, block_tables: Sequence[Sequence[int]], num_cached_tokens: int) -> bool:
        return False

    def request_finished(self, request: Request, reason: FinishReason,
                         block_tables: Sequence[Sequence[int]]) -> FinishAction:
        # The hook runs in the step that sampled the first token, before the loop stamps it: its start is then
        # when the token was sampled (handoff component p_compute ends here, p_pin starts).
        sampled_s = request.first_token_time_s if request.first_token_time_s is not None else self.clock()
        if not request.remote_decode or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return FREE_NOW
        if request.num_computed_tokens < request.num_prompt_tokens:
            return FREE_NOW
        ranges = handoff_ranges(self.plan, request.num_prompt_tokens, self.block_size)
        block_ids = handoff_slices(block_tables, ranges)
        if any(NULL_BLOCK_ID in ids for ids in block_ids):
            raise KVInvariantError(f"request {request.request_id}: a block the decode worker needs was released")
        if any(len(ids) != len(r) for ids, r in zip(block_ids, ranges)):  # a state group without its handoff page
            self.metrics.pinned_refusals.inc()
            return FinishAction(error=KVPinnedFull(
                "this prefill worker had no free page to keep the prompt's recurrent state for a decode worker: "
                "retry later"))
        num_blocks = sum(len(ids) for ids in block_ids)
        if not self.has_room_to_pin(num_blocks):
            self.metrics.pinned_refusals.inc()
            return FinishAction(error=self._full_error(num_blocks))
        ticket = PinTicket(request_id=request.request_id, block_ids=block_ids, lease_left_s=self.leases.lease_s,
                           num_prompt_tokens=request.num_prompt_tokens,
                           prompt_sha256=prompt_digest(request.prompt_token_ids), first_token=request.first_token)
        lease = self.leases.pin(request.request_id, num_blocks, ticket)
        self.metrics.pinned_blocks.set(self.leases.num_pinned_blocks)
        parts = prefill_parts(request.arrival_time_s, request.first_scheduled_time_s, sampled_s, self.clock())
        self.metrics.observe_handoff(parts)
        logger.info("request %s: %d blocks pinned for a decode worker (lease %.0fs)",
                    request.request_id, lease.num_blocks, self.leases.lease_s)
        return FinishAction(free_blocks=False,
                            kv_transfer_params=self._params(request, block_ids, lease.nonce, parts))

    def _full_error(self, num_blocks: int) -> KVPinnedFull:
        return KVPinnedFull(f"this prefill worker holds {self.leases.num_pinned_blocks} blocks for decode workers; "
                            f"{num_blocks} more would pass its limit of {self.max_pinned_blocks}: retry later")

    def claim_ticket(self, request_id: str, nonce: str) -> Claim[PinTicket]:
        """A reader asks where the pin's blocks are (any thread; answered once per pin). The ticket's
        `lease_left_s` is what remains of the lease now."""
        claim = self.leases.claim(request_id, nonce)
        if claim.ticket is None:
            return claim
        return dataclasses.replace(claim, ticket=claim.ticket.model_copy(update={"lease_left_s": claim.lease_left_s}))

    def _params(self, request: Request, block_ids: list[list[int]], nonce: str,
                handoff_s: dict[str, float]) -> RemotePrefillParams:
        return RemotePrefillParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.identity.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=block_ids,
            remote_host=self.identity.host,
            remote_port=self.identity.port,
            tp_size=self.identity.tp_size,
            remote_epoch=self.identity.epoch,
            num_prompt_tokens=request.num_prompt_tokens,
            lease_s=self.leases.lease_s,
            remote_pin_nonce=nonce,
            handoff_s=handoff_s,
        )

    # ---- the engine loop's tick -------------------------------------------------------

    def poll(self) -> KVEvents:
        """Apply readers' messages and early releases, then expire leases that ran out."""
        return KVEvents(released=self.take_released(self.transport.poll_notifications()))
