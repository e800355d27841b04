"""Decode-worker side of P/D: admit a request whose prompt KV lives on a prefill
worker, pull exactly the blocks it lacks, then let it run.

Invariants: blocks under an in-flight READ are never freed or reused, even if
the request is aborted (they are freed when the READ ends); a failed pull
never yields tokens from partial KV (policy `recompute` prefills locally,
`fail` ends the request with a distinct error); the prefill worker is told to
free its blocks whenever D will not read them. Runs on the engine thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

from pdserve.kv.manager import KVCacheManager
from pdserve.metrics import TransferMetrics
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.transfer.handshake import AgentInfo
from pdserve.transfer.messages import KVMessage
from pdserve.transfer.params import KV_PULL_FAILED_PREFIX, RemotePrefillParams
from pdserve.transfer.planner import plan_pull
from pdserve.transfer.transport import KVTransport, PeerInfo, TransferError, TransferState

logger = logging.getLogger(__name__)

FailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True)
class RemotePrefill:
    """Verified by the front end: the params and the peer they point at.

    `lease_confirmed_s` (monotonic) is when D last knew P's lease was fresh:
    when the params arrived, then at every heartbeat it sent."""

    params: RemotePrefillParams
    agent: AgentInfo
    lease_confirmed_s: float = field(default_factory=time.monotonic)

    def lease_may_have_expired(self, now_s: float) -> bool:
        # Half the lease as margin: P's clock started before ours, and a
        # renewal in flight may not have landed yet.
        return now_s - self.lease_confirmed_s > self.params.lease_s / 2


@dataclass(slots=True)
class _Pull:
    request: Request
    peer_key: str
    handle: object
    started_s: float
    num_descriptors: int
    num_bytes: int
    aborted: bool = False


class DecodeRole:
    def __init__(self, kv: KVCacheManager, transport: KVTransport, metrics: TransferMetrics,
                 policy: FailurePolicy = "recompute", pull_timeout_s: float = 30.0, heartbeat_s: float = 5.0):
        self.kv = kv
        self.transport = transport
        self.metrics = metrics
        self.policy = policy
        self.pull_timeout_s = pull_timeout_s
        self.heartbeat_s = heartbeat_s
        self.pulls: dict[str, _Pull] = {}
        self._peer_keys: dict[tuple[str, str], str] = {}
        self._last_heartbeat_s = time.monotonic()
        self._failed_early: list[tuple[str, str]] = []
        self.scheduler = None  # set by bind()

    # ---- scheduler hooks -------------------------------------------------------------

    def bind(self, scheduler) -> None:
        """The scheduler whose requests this role resumes or requeues."""
        self.scheduler = scheduler

    def admit_remote(self, request: Request, budget: int) -> Optional[bool]:
        remote: Optional[RemotePrefill] = request.remote_prefill
        if remote is None:
            return None
        if remote.lease_may_have_expired(time.monotonic()):
            # Reading now could return blocks P already freed and reused.
            return self._unusable_peer(request, "the prefill worker's lease may have expired before the pull")
        try:
            peer_key = self._peer_key(remote)
        except TransferError as error:
            return self._unusable_peer(request, f"prefill worker unreachable: {error}")
        num_prompt = request.num_prompt_tokens
        prefix = self.kv.find_prefix(request.block_hashes, num_prompt)
        if not self.kv.allocate(request.request_id, num_prompt - 1, 1, prefix):
            return False
        request.num_cached_tokens = prefix.num_tokens
        plan = plan_pull(remote.params.remote_block_ids, self._local_tails(request, remote),
                         self._skip_blocks(remote, prefix.num_tokens))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if not plan.local_ids:  # everything D needs is in its own prefix cache
            request.remote_prefill = None
            self._send(peer_key, KVMessage("free", remote.params.remote_request_id))
            self.scheduler.resume_after_remote_kv(request, num_prompt - 1)
            return True
        done_message = KVMessage("done", remote.params.remote_request_id).encode()
        try:
            handle = self.transport.start_read(peer_key, plan.local_ids, plan.remote_ids, done_message)
        except TransferError as error:
            self.kv.free(request.request_id)
            request.status = RequestStatus.WAITING
            return self._unusable_peer(request, f"KV read could not start: {error}")
        request.remote_prefill = None  # consumed: a later preemption recomputes locally
        page_bytes = remote.agent.geometry.page_bytes
        self.pulls[request.request_id] = _Pull(request, peer_key, handle, time.monotonic(),
                                               len(plan.local_ids), len(plan.local_ids) * page_bytes)
        self._count_waiting()
        return True

    def _unusable_peer(self, request: Request, reason: str) -> Optional[bool]:
        """Per policy: admit as an ordinary local request (None), or end it (True)."""
        logger.warning("request %s: %s", request.request_id, reason)
        self.metrics.failures.labels(policy=self.policy).inc()
        request.remote_prefill = None
        if self.policy == "recompute":
            return None
        self._failed_early.append((request.request_id, f"{KV_PULL_FAILED_PREFIX} {reason}"))
        return True

    def retain(self, request: Request, reason: FinishReason) -> bool:
        pull = self.pulls.get(request.request_id)
        if pull is not None:  # a READ is writing into its blocks: free them when it ends
            pull.aborted = True
            return True
        remote: Optional[RemotePrefill] = request.remote_prefill
        if remote is not None:  # ended before pulling: P can free at once
            try:
                self._send(self._peer_key(remote), KVMessage("free", remote.params.remote_request_id))
            except TransferError:
                self.metrics.notification_failures.inc()  # P's lease will free them
        return False

    # ---- engine-loop tick --------------------------------------------------------------

    num_pinned_blocks = 0  # a decode worker holds nothing for others

    def has_pending(self) -> bool:
        return bool(self.pulls)

    def tick(self) -> list[tuple[str, str]]:
        """Poll in-flight pulls; returns (request id, message) of requests to end with an error."""
        failed, self._failed_early = self._failed_early, []
        now = time.monotonic()
        for request_id, pull in list(self.pulls.items()):
            state = self.transport.poll(pull.handle)
            if state is TransferState.PENDING and now - pull.started_s > self.pull_timeout_s:
                state = TransferState.FAILED
                logger.warning("request %s: KV pull timed out after %.1fs", request_id, now - pull.started_s)
            if state is TransferState.PENDING:
                continue
            if not self.transport.release(pull.handle):
                continue  # the READ could not be cancelled: its pages stay ours until it ends
            del self.pulls[request_id]
            self._finish_pull(pull, state is TransferState.DONE, now, failed)
        self._count_waiting()
        self._heartbeat(now)
        return failed

    def _finish_pull(self, pull: _Pull, ok: bool, now: float, failed: list[tuple[str, str]]) -> None:
        request = pull.request
        if pull.aborted:  # the request is gone; its blocks were kept only for the READ
            self.kv.free(request.request_id)
            return
        if ok:
            self.metrics.observe_pull(pull.num_bytes, pull.num_descriptors, now - pull.started_s)
            self.scheduler.resume_after_remote_kv(request, request.num_prompt_tokens - 1)
            return
        self.metrics.failures.labels(policy=self.policy).inc()
        if self.policy == "recompute":
            logger.warning("request %s: KV pull failed; prefilling locally", request.request_id)
            self.scheduler.requeue_for_local_prefill(request)
        else:
            failed.append((request.request_id, f"{KV_PULL_FAILED_PREFIX} could not read the prompt's KV from the prefill worker"))

    # ---- helpers ------------------------------------------------------------------------

    def _local_tails(self, request: Request, remote: RemotePrefill) -> list[list[int]]:
        """Per group, D's blocks aligned with the remote lists (same block indices)."""
        num_prompt_blocks = -(-request.num_prompt_tokens // self.kv.block_size)
        tables = self.kv.block_ids(request.request_id)
        return [table[num_prompt_blocks - len(remote_ids) : num_prompt_blocks]
                for table, remote_ids in zip(tables, remote.params.remote_block_ids)]

    def _skip_blocks(self, remote: RemotePrefill, num_cached_tokens: int) -> list[int]:
        """Per group, how many leading entries of the aligned lists D already has."""
        num_prompt_blocks = -(-remote.params.num_prompt_tokens // self.kv.block_size)
        num_cached_blocks = num_cached_tokens // self.kv.block_size
        return [max(0, num_cached_blocks - (num_prompt_blocks - len(ids))) for ids in remote.params.remote_block_ids]

    def _peer_key(self, remote: RemotePrefill) -> str:
        identity = (remote.agent.engine_id, remote.agent.epoch)
        key = self._peer_keys.get(identity)
        if key is None:
            key = self.transport.connect(PeerInfo.from_dict(remote.agent.transport))
            self._peer_keys[identity] = key
        return key

    def _send(self, peer_key: str, message: KVMessage) -> bool:
        """True when the message left; a lost one is covered by P's lease."""
        try:
            self.transport.send_message(peer_key, message.encode())
            return True
        except Exception:
            self.metrics.notification_failures.inc()
            logger.warning("could not send %s for request %s", message.kind, message.request_id, exc_info=True)
            return False

    def _heartbeat(self, now: float) -> None:
        """Renew P's leases for remote requests still queued here."""
        if now - self._last_heartbeat_s < self.heartbeat_s:
            return
        self._last_heartbeat_s = now
        for request in self.scheduler.waiting:
            remote: Optional[RemotePrefill] = request.remote_prefill
            if remote is None:
                continue
            try:
                if self._send(self._peer_key(remote), KVMessage("renew", remote.params.remote_request_id)):
                    remote.lease_confirmed_s = now
            except TransferError:
                self.metrics.notification_failures.inc()

    def _count_waiting(self) -> None:
        self.metrics.waiting_for_kv.set(len(self.pulls))
        if self.scheduler is not None:
            self.scheduler.num_waiting_for_kv = len(self.pulls)
