"""Continuous batching: decides, each step, which tokens of which requests to compute.

Invariants: a step never exceeds the token budget or the running-request cap;
a request is scheduled only when every block its chunk writes is allocated;
when blocks run out the latest-arrived running request is preempted (blocks
freed, recomputed later) so earlier requests always make progress. Torch-free.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Iterable, Optional, Protocol

from pdserve.config import SchedulerConfig
from pdserve.engine.schedule_types import SampledToken, ScheduledChunk, SchedulerOutput
from pdserve.engine.stop_rules import check_stop
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


class KVRoleHooks(Protocol):
    """What a P/D role adds to scheduling (see engine/prefill_role.py, decode_role.py)."""

    def retain(self, request: Request, reason: FinishReason) -> bool:
        """Called as a request finishes; True = the role now owns its blocks
        (pinned for a remote reader, or under an in-flight READ) and frees them later."""
        ...

    def admit_remote(self, request: Request, budget: int) -> Optional[bool]:
        """None: an ordinary request. True: admitted as a remote-KV request
        (blocks allocated, now WAITING_FOR_REMOTE_KV). False: no room yet."""
        ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        block_size: int,
        max_model_len: int,
        on_preempt: Optional[Callable[[Request], None]] = None,
        role_hooks: Optional[KVRoleHooks] = None,
    ):
        self.config = config
        self.kv = kv_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.on_preempt = on_preempt or (lambda request: None)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.role_hooks = role_hooks
        self.num_waiting_for_kv = 0  # maintained by the decode role
        self._finished_since_last_step: list[str] = []

    # ---- queue management -------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.num_waiting_for_kv)

    def add_request(self, request: Request) -> None:
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size, [])
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: FinishReason) -> Optional[Request]:
        """Finish a request now (abort, stop string, error) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, reason)  # a request waiting for remote KV: the role hook decides
        return request

    def _release(self, request: Request, reason: FinishReason) -> None:
        retained = self.role_hooks is not None and self.role_hooks.retain(request, reason)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if not retained:
            self.kv.free(request.request_id)
        self._finished_since_last_step.append(request.request_id)

    def resume_after_remote_kv(self, request: Request, num_computed_tokens: int) -> None:
        """The decode role landed a request's KV: it runs from the next step."""
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def requeue_for_local_prefill(self, request: Request) -> None:
        """The KV pull failed and the policy is recompute: start over locally."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ---- scheduling ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(output, budget)
        if not preempted:
            self._admit_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted = False
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while not (num_new := self._allocate_fitting(request, request.num_computed_tokens, num_new)):
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim, output)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank under index
            output.chunks.append(self._chunk(request, num_new))
            scheduled_ids.add(request.request_id)
            budget -= num_new
            index += 1
        return budget, preempted

    def _allocate_fitting(self, request: Request, num_computed: int, num_new: int, prefix=None) -> int:
        """Allocate for the largest chunk of at most `num_new` tokens the pool can take
        (halving on failure: a prefill chunk of a sliding-window model needs blocks for
        the whole chunk, more than the window it keeps). Returns the chunk size, 0 if none fits."""
        while num_new > 0:
            if self.kv.allocate(request.request_id, num_computed, num_new, prefix):
                return num_new
            if num_new == 1:
                return 0
            num_new //= 2
        return 0

    def _pick_victim(self, scheduled_ids: set[str]) -> Request:
        # Latest arrival loses; never a request already given work this step
        # unless it is the only candidate left (then the current one yields).
        for candidate in reversed(self.running):
            if candidate.request_id not in scheduled_ids:
                return candidate
        return self.running[-1]

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_request_ids.append(request.request_id)
        self.on_preempt(request)
        logger.info("request %s preempted (pool exhausted), will recompute", request.request_id)

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_running:
            request = self.waiting[0]
            if self.role_hooks is not None:
                admitted = self.role_hooks.admit_remote(request, budget)
                if admitted is False:
                    break
                if admitted:
                    self.waiting.popleft()
                    continue
            prefix = self.kv.find_prefix(request.block_hashes, request.num_tokens)
            num_new = self._allocate_fitting(request, prefix.num_tokens, min(request.num_tokens - prefix.num_tokens, budget), prefix)
            if not num_new:
                break  # first come first served: do not let later requests jump the queue
            self.waiting.popleft()
            request.num_computed_tokens = prefix.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = time.monotonic()
            self.running.append(request)
            output.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        token_ids = request.all_token_ids[start:end]
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=tuple(list(ids) for ids in self.kv.block_ids(request.request_id)),
            sample=end == request.num_tokens,
            sampling=request.sampling,
            num_sampled_so_far=len(request.output_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
        )

    # ---- results -------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Iterable[SampledToken]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what must stop.

        Returns the requests that got a new token or finished, in chunk order.
        """
        by_id = {token.request_id: token for token in sampled}
        changed: list[Request] = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.end_position
            # Commit before a possible finish frees the blocks, so they stay cached.
            self.kv.commit(request.request_id, request.block_hashes, request.num_computed_tokens)
            token = by_id.get(chunk.request_id)
            if token is not None:
                self._append_token(request, token.token_id)
                changed.append(request)
        return changed

    def _append_token(self, request: Request, token_id: int) -> None:
        request.output_token_ids.append(token_id)
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        reason = check_stop(request, self.max_model_len)
        if reason is not None:
            self.requests.pop(request.request_id, None)
            self.running.remove(request)
            self._release(request, reason)
