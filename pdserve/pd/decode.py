"""Decode side of P/D, engine thread: pull a remote prompt's KV into blocks the scheduler allocated.

Invariants: a block under an in-flight READ is never handed back for freeing,
even when its request is aborted (it is released when the READ ends); a READ
whose result could postdate the prefill worker's lease is treated as failed,
so D never computes with pages P may have reused; the block ids read are
those of P's own pin record (pd/tickets.py put them in the params: the
client's never get here); a failed pull never yields
tokens from partial KV (policy `recompute` prefills locally, from P's first
token when the ticket carried one, `fail` ends the request with `KVPullFailed`,
and every prompt token so recomputed is counted by reason); P hears "free" whenever D will not read. A state group's page
(P's handoff page) lands in the request's live page (between block or TP sizes,
each state layer's slot into that layer's slot, each rank its heads' bytes: pd/geometry.py
`plan_handoff_pull`): D then
computes the last prompt token from the state after the ones before it.
Leases are renewed for queued requests and for those whose READ is in flight.
With peer pulls on, D also lends: its prefixes (a prompt it pulled or computed and the answer it
decoded, whose full blocks its prefix cache keeps) are pinned for peers under a `PinLender` of its
own (pd/lending.py, pd/peer_pins.py), whose readers' messages `poll` applies. Torch-free.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from pdserve.api.kv_transfer import KVPullFailed, RemotePrefillParams
from pdserve.api.sampling import FinishReason
from pdserve.kv.specs import KVGroupPlan
from pdserve.metrics import TransferMetrics
from pdserve.pd.connector import (ADMIT_LOCAL, ADMIT_REMOTE, FREE_NOW, Admission, AdmissionKind, FinishAction,
                                  KVEvents, LoadFailure)
from pdserve.pd.geometry import plan_pull_from
from pdserve.pd.lending import PinLender
from pdserve.pd.messages import KVMessage, MessageKind
from pdserve.pd.peers import PeerConnections
from pdserve.request import RemoteSource, Request
from pdserve.transfer.transport import (KVTransport, TransferError, TransferHandle, TransferState, handshake_address,
                                       peer_key)

logger = logging.getLogger(__name__)
AGENT_CHECK_INTERVAL_S = 0.1  # how often an idle or busy D asks its transport whether the agent lives

FailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True)
class _Remote:
    """A remote request D knows of: queued (no READ yet) or pulling."""

    source: RemoteSource
    lease_fresh_s: float  # monotonic: when P's lease was last known (or renewed) to be fresh
    handle: Optional[TransferHandle] = None  # set once the READ started
    read_started_s: float = 0.0  # on the connector's clock, not the transport's: one clock times a pull
    aborted: bool = False  # the request ended while its READ was in flight
    uncached_blocks: tuple[int, ...] = ()  # per group: leading table entries the pull left partly unfilled
    takes_first_token: bool = False  # the request starts from P's first token (pd/first_token.py)

    @property
    def peer_key(self) -> str:  # the key admission connected: by handshake address, engine and epoch
        params = self.source.params
        return peer_key(self.source.agent.engine_id, self.source.agent.epoch,
                        handshake_address(params.remote_host, params.remote_port))

    def lease_deadline_s(self, own_lease_s: float) -> float:
        # Half the lease as margin: P's clock started before ours, and a renewal in flight may not
        # have landed yet. The lease is the shorter of P's (on the wire) and D's own configured one:
        # params claiming a long lease cannot make D trust a read that lands after P freed the pages.
        return self.lease_fresh_s + min(self.source.params.lease_s, own_lease_s) / 2


class DecodeConnector:
    """The decode worker's `KVConnector`; with a `lender` (peer pulls on) it also lends its prefixes to peers."""

    def __init__(self, transport: KVTransport, peers: PeerConnections, plan: KVGroupPlan, block_size: int,
                 metrics: TransferMetrics, policy: FailurePolicy = "recompute", pull_timeout_s: float = 10.0,
                 heartbeat_s: float = 5.0, clock: Callable[[], float] = time.monotonic, lease_s: float = 30.0,
                 tp_size: int = 1, lender: Optional[PinLender] = None):
        """`lender`: the lease table of the prefixes this worker pins for peers (pd/peer_pins.py); its
        readers' messages come with the transport's notifications, which `poll` hands to it."""
        self.lender = lender
        self.transport = transport
        self.tp_size = tp_size  # this worker's ranks: a rank's state slot is its heads' share
        self.peers = peers
        self.plan = plan
        self.block_size = block_size
        self.metrics = metrics
        self.policy = policy
        self.pull_timeout_s = pull_timeout_s
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s  # D's own --kv-lease-s: the longest lease it trusts a prefill worker to keep
        self.clock = clock
        self._remotes: dict[str, _Remote] = {}
        self._failed_to_start: list[LoadFailure] = []
        self._last_heartbeat_s = clock()
        self._agent_checked_s = float("-inf")

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks pinned for peers (0 without a lender: a decode worker then holds nothing for others)."""
        return self.lender.num_pinned_blocks if self.lender is not None else 0

    @property
    def num_loading(self) -> int:
        return sum(1 for remote in self._remotes.values() if remote.handle is not None)

    # ---- the scheduler's questions --------------------------------------------------

    def request_added(self, request: Request) -> None:
        if request.remote is not None:
            self._remotes[request.request_id] = _Remote(request.remote, request.remote.received_s)

    def plan_admission(self, request: Request) -> Admission:
        remote = self._remotes.get(request.request_id)
        if request.remote is None or remote is None:
            return ADMIT_LOCAL
        if self.clock() > remote.lease_deadline_s(self.lease_s):
            return self._unusable(request, remote, "the prefill worker's lease may have expired before the pull",
                                  "stale_ticket")
        if self.peers.key_for(remote.peer_key) is None:
            return self._unusable(request, remote, f"prefill worker {remote.peer_key} is no longer connected",
                                  "pull_failed")
        return ADMIT_REMOTE

    def start_pull(self, request: Request, block_tables: Sequence[Sequence[int]], num_cached_tokens: int) -> bool:
        remote = self._remotes[request.request_id]
        remote.takes_first_token = request.first_token is not None
        params = remote.source.params
        num_tokens = request.num_prompt_tokens
        # P's block size and TP size may differ from ours: the pull cuts both into units, each rank its heads
        pull = plan_pull_from(remote.source.agent, self.plan, self.block_size, block_tables, params.remote_block_ids,
                              num_tokens, num_cached_tokens, self.tp_size)
        remote.uncached_blocks = pull.uncached_blocks
        if pull.is_empty:  # D's prefix cache holds everything it needs
            self._count_first_token(remote)
            del self._remotes[request.request_id]
            self._send(remote, MessageKind.FREE)
            return False
        try:
            remote.read_started_s = self.clock()
            # d_admit: from admission's verified source to this READ (the engine's queue and allocation).
            self.metrics.observe_handoff({"d_admit": max(0.0, remote.read_started_s - remote.source.received_s)})
            done = KVMessage(MessageKind.DONE, params.remote_request_id, _nonce(params))
            # State slot by slot (between block or TP sizes) only a RankedTransport reads; P/D wiring makes one.
            extra = {"state_moves": pull.state_moves} if pull.state_moves else {}
            remote.handle = self.transport.start_read(remote.peer_key, pull.local_ids, pull.remote_ids, done.encode(),
                                                      **extra)
        except TransferError as error:
            del self._remotes[request.request_id]
            self._failed_to_start.append(self._failure(request.request_id, f"KV read could not start: {error.message}",
                                                       request.num_prompt_tokens))
        self.metrics.waiting_for_kv.set(self.num_loading)
        return True

    def request_finished(self, request: Request, reason: FinishReason,
                         block_tables: Sequence[Sequence[int]]) -> FinishAction:
        remote = self._remotes.get(request.request_id)
        if remote is None:
            return FREE_NOW
        if remote.handle is not None:  # a READ is writing into its blocks: free them when it ends
            remote.aborted = True
            return FinishAction(free_blocks=False)
        del self._remotes[request.request_id]  # ended before pulling: P can free at once
        self._send(remote, MessageKind.FREE)
        return FREE_NOW

    # ---- the engine loop's tick -------------------------------------------------------

    def has_pending(self) -> bool:
        lends = self.lender is not None and self.lender.has_pending()
        return bool(self._remotes) or self.peers.has_pending() or lends

    def poll(self) -> KVEvents:
        events = KVEvents(failed=self._failed_to_start)
        self._failed_to_start = []
        now = self.clock()
        lending = self.lender is not None and self.lender.leases.num_pinned_requests > 0
        notifications: list[bytes] = []
        if lending or now - self._agent_checked_s >= AGENT_CHECK_INTERVAL_S:
            # Messages come to D only about its pins for peers; the call also notices an agent process
            # that died (then a replacement starts), while D is idle too. Not every step unless D lends:
            # to an agent process it is a round trip.
            self._agent_checked_s = now
            notifications = self.transport.poll_notifications()
        if self.lender is not None:
            events.released.extend(self.lender.take_released(notifications))
        self.peers.poll()
        for request_id, remote in list(self._remotes.items()):
            if remote.handle is not None:
                self._poll_read(request_id, remote, now, events)
        self._heartbeat(now)
        self.metrics.waiting_for_kv.set(self.num_loading)
        return events

    def _poll_read(self, request_id: str, remote: _Remote, now: float, events: KVEvents) -> None:
        handle = remote.handle
        state = self.transport.poll(handle)
        deadline_s = min(remote.read_started_s + self.pull_timeout_s, remote.lease_deadline_s(self.lease_s))
        if state is TransferState.PENDING and now > deadline_s:
            logger.warning("request %s: KV pull gave up after %.1f s", request_id, now - remote.read_started_s)
            state = TransferState.FAILED
        if state is TransferState.DONE and now > remote.lease_deadline_s(self.lease_s):
            state = TransferState.FAILED  # landed too late to trust: P may have reused the pages
        if state is TransferState.PENDING or not self.transport.release(handle):
            return  # still running, or could not be cancelled: its pages stay ours until it ends
        del self._remotes[request_id]
        if remote.aborted:  # the request is gone; its blocks were kept only for the READ
            events.released.append(request_id)
        elif state is TransferState.DONE:
            self.metrics.observe_pull(handle.num_bytes, handle.num_blocks, now - remote.read_started_s)
            self._count_first_token(remote)
            events.landed.append(request_id)
            if any(remote.uncached_blocks):
                events.uncached[request_id] = remote.uncached_blocks
        else:
            self.peers.forget(remote.peer_key)
            events.failed.append(self._failure(request_id, "could not read the prompt's KV from the prefill worker"
                                               + (f": {handle.error}" if handle.error else ""),
                                               remote.source.params.num_prompt_tokens))

    def _heartbeat(self, now: float) -> None:
        """Renew P's leases of every remote request D still needs: queued or pulling."""
        if now - self._last_heartbeat_s < self.heartbeat_s:
            return
        self._last_heartbeat_s = now
        for remote in self._remotes.values():
            if not remote.aborted and self._send(remote, MessageKind.RENEW):
                remote.lease_fresh_s = now

    # ---- helpers ------------------------------------------------------------------------

    def _unusable(self, request: Request, remote: _Remote, reason: str, label: str) -> Admission:
        """The remote KV cannot be used: per policy, compute locally (counted under `label`) or fail;
        P may free at once. A request with P's first token keeps it (the engine counts that)."""
        logger.warning("request %s: %s", request.request_id, reason)
        del self._remotes[request.request_id]
        self._send(remote, MessageKind.FREE)
        self.metrics.failures.labels(policy=self.policy).inc()
        if self.policy == "recompute":
            self.metrics.recomputed_prompt_tokens.labels(reason=label).inc(request.num_prompt_tokens)
            return ADMIT_LOCAL
        return Admission(AdmissionKind.FAIL, KVPullFailed(reason))

    def _count_first_token(self, remote: _Remote) -> None:
        """A request that was to start from P's first token did, with every prompt page here. (A failed
        pull's request goes on from P's token all the same, counted by the engine as it computes the prompt.)"""
        if remote.takes_first_token:
            self.metrics.first_token_from_prefill.inc()

    def _failure(self, request_id: str, reason: str, num_prompt_tokens: int) -> LoadFailure:
        self.metrics.failures.labels(policy=self.policy).inc()
        if self.policy == "recompute":
            logger.warning("request %s: %s; prefilling locally", request_id, reason)
            self.metrics.recomputed_prompt_tokens.labels(reason="pull_failed").inc(num_prompt_tokens)
        return LoadFailure(request_id, KVPullFailed(reason), recompute=self.policy == "recompute")

    def _send(self, remote: _Remote, kind: MessageKind) -> bool:
        """True when the message left; a lost one is covered by P's lease."""
        peer_key = self.peers.key_for(remote.peer_key)
        if peer_key is None:
            return False
        try:
            params = remote.source.params
            self.transport.send_message(peer_key, KVMessage(kind, params.remote_request_id, _nonce(params)).encode())
            return True
        except TransferError:
            self.metrics.notification_failures.inc()
            logger.warning("could not send %s for %s", kind, remote.source.params.remote_request_id)
            return False


def _nonce(params: RemotePrefillParams) -> str:
    return params.remote_pin_nonce or ""  # parsed params always carry one (api/kv_transfer.py)
