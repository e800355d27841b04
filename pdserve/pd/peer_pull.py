"""Puller side of a peer pull, engine thread: READ a prompt's prefix from a peer's pinned blocks into
blocks the scheduler allocated, then let the request compute only the rest.

Wraps the worker's own connector (P's, D's): requests whose `remote` is a peer pull
(`RemoteSource.num_pull_tokens` set, pd/peer_admission.py) are handled here, every other question
goes to the inner connector unchanged. Invariants: a block under an in-flight READ is never handed
back for freeing (an aborted request's blocks are released when the READ ends); a READ that lands
after half the peer's lease counts as failed (the peer may have freed the pages); a failed or
refused pull never fails the request: it is recomputed from scratch, counted by result; the peer
hears "done" (attached to the READ) or "free" whenever this worker will not read, and its lease
covers a message lost. Pulled blocks become ordinary prefix-cache blocks when the request's first
step commits them (the scheduler's `commit`, as for any computed block). Torch-free.

    puller (this worker)                          holder (the peer)
    admission: POST /internal/kv/peer_pin ----->  match its own hash chain (pool, then tier), pin, lease
               <---- ticket {ids, chain, nonce}
    scheduler allocates the prefix's blocks
    start_pull: READ ids -> our blocks             (pinned: its pages cannot change)
    READ landed ------------- "done" ---------->  pin released (blocks stay cached there)
    the request computes tokens [prefix, prompt)

Between TP sizes (and block sizes) the READ is D's (pd/geometry.py `plan_pull_from`): it names block
ids only. The holder pinned on its rank 0, and the pin's ids hold for every rank's slice (the ranks
page the same block ids); each puller rank reads its KV heads of those blocks from the holder ranks
that hold them, and "done" reaches the holder's rank 0 only once every rank's share landed
(transfer/ranked_transport.py):

    holder TP=2:  rank 0 page b = [head 0]    rank 1 page b = [head 1]    (one pin: id b names both)
                              └────────────┬─────────────┘
    puller TP=1:         page b' = [head 0 | head 1]                     (one READ per block and holder rank)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pdserve.api.kv_transfer import KVPullFailed
from pdserve.api.sampling import FinishReason
from pdserve.kv.specs import KVGroupPlan
from pdserve.pd.connector import ADMIT_LOCAL, ADMIT_REMOTE, Admission, FinishAction, KVConnector, KVEvents, LoadFailure
from pdserve.pd.geometry import plan_pull_from
from pdserve.pd.messages import KVMessage, MessageKind
from pdserve.pd.peer_costs import PeerPullCosts
from pdserve.pd.peers import PeerConnections
from pdserve.request import RemoteSource, Request
from pdserve.transfer.transport import KVTransport, TransferError, TransferHandle, TransferState, handshake_address, peer_key

logger = logging.getLogger(__name__)

# (result, tokens): pdserve_kv_peer_pull_tokens_total; results: pulled, failed, refused, miss
CountPeerTokens = Callable[[str, int], None]


@dataclass(slots=True)
class _PeerPull:
    source: RemoteSource
    handle: Optional[TransferHandle] = None
    read_started_s: float = 0.0
    aborted: bool = False

    @property
    def peer_key(self) -> str:
        params = self.source.params
        return peer_key(self.source.agent.engine_id, self.source.agent.epoch,
                        handshake_address(params.remote_host, params.remote_port))

    @property
    def num_tokens(self) -> int:
        return self.source.num_pull_tokens or 0

    def lease_deadline_s(self, own_lease_s: float) -> float:
        # Half the lease as margin, as a P/D pull: the peer's clock started first.
        return self.source.received_s + min(self.source.params.lease_s, own_lease_s) / 2


class PeerPullConnector:
    """A `KVConnector`: peer pulls here, everything else to `inner`."""

    def __init__(self, inner: KVConnector, transport: KVTransport, peers: PeerConnections, plan: KVGroupPlan,
                 block_size: int, count_tokens: CountPeerTokens = lambda result, num_tokens: None,
                 observe_pull_s: Callable[[float], None] = lambda seconds: None, pull_timeout_s: float = 10.0,
                 lease_s: float = 30.0, tp_size: int = 1, clock: Callable[[], float] = time.monotonic,
                 poll_peers: bool = True, costs: Optional[PeerPullCosts] = None):
        """`poll_peers`: whether this connector advances `peers` (False when the inner connector does: D's).
        `costs`: the pull decision's prices, told of every landed pull (shared with the admission)."""
        self.inner = inner
        self.transport = transport
        self.peers = peers
        self.plan = plan
        self.block_size = block_size
        self.count_tokens = count_tokens
        self.observe_pull_s = observe_pull_s
        self.costs = costs or PeerPullCosts()
        self.pull_timeout_s = pull_timeout_s
        self.lease_s = lease_s
        self.tp_size = tp_size
        self.clock = clock
        self.poll_peers = poll_peers
        self._pulls: dict[str, _PeerPull] = {}
        self._failed_to_start: list[LoadFailure] = []

    @property
    def num_pinned_blocks(self) -> int:
        return self.inner.num_pinned_blocks

    @staticmethod
    def _is_peer(request: Request) -> bool:
        return request.remote is not None and request.remote.num_pull_tokens is not None

    # ---- the scheduler's questions --------------------------------------------------

    def request_added(self, request: Request) -> None:
        if self._is_peer(request):
            self._pulls[request.request_id] = _PeerPull(request.remote)
        else:
            self.inner.request_added(request)

    def plan_admission(self, request: Request) -> Admission:
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return self.inner.plan_admission(request)
        if self.clock() > pull.lease_deadline_s(self.lease_s):
            return self._give_up(request.request_id, pull, "the peer's lease may have run out before the pull")
        if self.peers.key_for(pull.peer_key) is None:
            return self._give_up(request.request_id, pull, f"peer {pull.peer_key} is no longer connected")
        return ADMIT_REMOTE

    def start_pull(self, request: Request, block_tables: Sequence[Sequence[int]], num_cached_tokens: int) -> bool:
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return self.inner.start_pull(request, block_tables, num_cached_tokens)
        params = pull.source.params
        # D's plan of a pull from P: the peer's block size and TP size may differ from ours (units, head slices)
        plan = plan_pull_from(pull.source.agent, self.plan, self.block_size, block_tables, params.remote_block_ids,
                              pull.num_tokens, num_cached_tokens, self.tp_size)
        if plan.is_empty:  # this worker's own prefix cache holds it all by now
            del self._pulls[request.request_id]
            self._send(pull, MessageKind.FREE)
            return False
        done = KVMessage(MessageKind.DONE, params.remote_request_id, params.remote_pin_nonce or "")
        try:
            pull.read_started_s = self.clock()
            pull.handle = self.transport.start_read(pull.peer_key, plan.local_ids, plan.remote_ids, done.encode())
        except TransferError as error:
            del self._pulls[request.request_id]
            self._send(pull, MessageKind.FREE)
            self._failed_to_start.append(self._failure(request.request_id, pull, error.message))
        return True

    def request_finished(self, request: Request, reason: FinishReason,
                         block_tables: Sequence[Sequence[int]]) -> FinishAction:
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return self.inner.request_finished(request, reason, block_tables)
        if pull.handle is not None:  # a READ writes into its blocks: freed when it ends
            pull.aborted = True
            return FinishAction(free_blocks=False)
        del self._pulls[request.request_id]
        self._send(pull, MessageKind.FREE)
        return FinishAction()

    # ---- the engine loop's tick -------------------------------------------------------

    def has_pending(self) -> bool:
        return bool(self._pulls) or bool(self._failed_to_start) or self.inner.has_pending()

    def poll(self) -> KVEvents:
        events = self.inner.poll()
        events.failed.extend(self._failed_to_start)
        self._failed_to_start = []
        if self.poll_peers:
            self.peers.poll()
        now = self.clock()
        for request_id, pull in list(self._pulls.items()):
            if pull.handle is not None:
                self._poll_read(request_id, pull, now, events)
        return events

    def _poll_read(self, request_id: str, pull: _PeerPull, now: float, events: KVEvents) -> None:
        state = self.transport.poll(pull.handle)
        deadline_s = min(pull.read_started_s + self.pull_timeout_s, pull.lease_deadline_s(self.lease_s))
        if state is TransferState.PENDING and now > deadline_s:
            state = TransferState.FAILED
        if state is TransferState.DONE and now > pull.lease_deadline_s(self.lease_s):
            state = TransferState.FAILED  # landed too late to trust
        if state is TransferState.PENDING or not self.transport.release(pull.handle):
            return
        del self._pulls[request_id]
        if pull.aborted:
            events.released.append(request_id)
        elif state is TransferState.DONE:
            self.count_tokens("pulled", pull.num_tokens)
            self.observe_pull_s(now - pull.source.received_s)
            self.costs.observe_pull(pull.num_tokens, now - pull.source.received_s)
            events.landed.append(request_id)
            logger.info("request %s: %d prompt tokens pulled from peer %s in %.1f ms", request_id, pull.num_tokens,
                        pull.source.agent.engine_id, (now - pull.read_started_s) * 1e3)
        else:
            self._send(pull, MessageKind.FREE)  # before forgetting the peer: then no message could leave
            self.peers.forget(pull.peer_key)
            error = pull.handle.error
            events.failed.append(self._failure(request_id, pull, "READ failed" + (f": {error}" if error else "")))

    # ---- helpers ------------------------------------------------------------------------

    def _give_up(self, request_id: str, pull: _PeerPull, reason: str) -> Admission:
        logger.warning("request %s: peer pull given up (%s); computing the prompt", request_id, reason)
        del self._pulls[request_id]
        self._send(pull, MessageKind.FREE)
        self.count_tokens("failed", pull.num_tokens)
        return ADMIT_LOCAL

    def _failure(self, request_id: str, pull: _PeerPull, reason: str) -> LoadFailure:
        logger.warning("request %s: peer pull from %s failed (%s); computing the prompt", request_id,
                       pull.source.agent.engine_id, reason)
        self.count_tokens("failed", pull.num_tokens)
        return LoadFailure(request_id, KVPullFailed(f"peer pull failed: {reason}"), recompute=True)

    def _send(self, pull: _PeerPull, kind: MessageKind) -> None:
        """Best effort: the peer's lease frees the pin when a message is lost."""
        key = self.peers.key_for(pull.peer_key)
        if key is None:
            return
        params = pull.source.params
        try:
            self.transport.send_message(key, KVMessage(kind, params.remote_request_id,
                                                       params.remote_pin_nonce or "").encode())
        except TransferError:
            logger.info("peer pin %s: %s not sent; its lease frees it", params.remote_request_id, kind.value)
