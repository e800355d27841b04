"""Continuous batching: decides, each step, which tokens of which requests to compute.

Invariants: a step never exceeds the token budget; running plus loading
(waiting for remote KV) requests never exceed the running cap; a request is
scheduled only when every block its chunk writes is allocated; when blocks
run out the latest-arrived running request is preempted (blocks freed,
recomputed later) so earlier requests always make progress. The scheduler
owns every request-state change: the P/D connector only answers its
questions and reports events (pdserve/pd/connector.py). A prefix hit that
needs pages from the offload tier waits in the same loading state until the
KV manager reports the load (`poll_offload`). A decode worker's P/D request
may wait for both at once, its prefix from its own tier and the rest from
the prefill worker: it runs when both landed; if either failed it recomputes
(or fails, if the pull said so) once neither writes its blocks any more. A
decode leg sent beside its prefill leg holds its prompt's blocks in the same
loading state while P computes; its pull starts the moment its ticket is
delivered (`take_ticket`). A fault while handling one request fails that
request only. Torch-free.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Iterable, Optional

from pdserve.api.config import SchedulerConfig
from pdserve.api.errors import EngineFailure, PdserveError, RequestFailed
from pdserve.api.kv_transfer import FirstToken
from pdserve.api.sampling import FinishReason
from pdserve.engine.pending_load import PendingLoad
from pdserve.engine.schedule_types import PromptLogprobs, SampledToken, ScheduledChunk, SchedulerOutput
from pdserve.engine.scheduler_invariants import check_scheduler
from pdserve.engine.state_chunks import is_snapshot_point, snapshot_chunk_tokens
from pdserve.engine.step_budget import StepBudget
from pdserve.engine.stop_rules import check_stop
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.prefix import PrefixHit
from pdserve.kv.specs import RecurrentStateSpec
from pdserve.pd.connector import FREE_NOW, AdmissionKind, KVConnector, KVEvents, NoConnector
from pdserve.pd.first_token import first_draw_key
from pdserve.request import RemoteSource, Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        block_size: int,
        max_model_len: int,
        connector: Optional[KVConnector] = None,
        on_preempt: Optional[Callable[[Request], None]] = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config
        self.clock = clock
        max_step_s = config.max_step_ms / 1000.0 if config.max_step_ms is not None else None
        self.step_budget = StepBudget(config.max_num_batched_tokens, max_step_s)
        self._step_started: Optional[tuple[SchedulerOutput, float]] = None  # the step being timed
        self.last_step: Optional[tuple[SchedulerOutput, int]] = None  # the last schedule() and its token budget
        self.kv = kv_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.connector: KVConnector = connector or NoConnector()
        self.on_preempt = on_preempt or (lambda request: None)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.loading: dict[str, PendingLoad] = {}  # WAITING_FOR_REMOTE_KV: blocks allocated, KV on its way
        self._finished_since_last_step: list[str] = []
        self._ended: list[Request] = []  # ended here with an error, for the engine loop to report
        self._released_ids: list[str] = []  # requests whose blocks are all back in the pool
        self._first_tokens: list[tuple[Request, SampledToken]] = []  # D: P's token 1 became output, to emit
        # Hybrid models with prefix caching end prefill chunks where their state can be snapshotted.
        self._snapshots_state = kv_manager.enable_prefix_caching and any(
            isinstance(group.spec, RecurrentStateSpec) for group in kv_manager.plan.groups)
        # P/D with state: a prefill-role request keeps its state after all but the last prompt token.
        self._hands_off_state = bool(kv_manager.plan.state_group_ids)

    # ---- queue management -------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.loading)

    @property
    def num_awaiting_ticket(self) -> int:
        """D: loading requests that hold their blocks for a ticket P has not sent yet (no pull yet)."""
        return sum(1 for load in self.loading.values() if load.awaiting_ticket)

    def has_offload_loads(self) -> bool:
        """Whether prefix pages are loading from the offload tier (the loop polls, not sleeps): a request's,
        or a peer pin's (pd/peer_pins.py: the holder loads its tier's pages before a peer reads them)."""
        return any(load.reading_tier for load in self.loading.values()) or self.kv.has_tier_reads()

    def has_work(self) -> bool:
        # Tier loads land from `schedule`'s own poll, so they count as work (remote pulls land from the loop's).
        return bool(self.waiting or self.running or self.has_offload_loads())

    def add_request(self, request: Request) -> None:
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size, [])
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.connector.request_added(request)

    def finish(self, request_id: str, reason: FinishReason, error: Optional[PdserveError] = None) -> Optional[Request]:
        """Finish a request now (abort, stop string, error) and free its blocks (or let the connector hold them)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.loading.pop(request_id, None)
        if error is not None:
            request.error = error
        self._release(request, reason)
        return request

    def check_invariants(self) -> None:
        """Raise `SchedulerInvariantError` unless every invariant above holds (see scheduler_invariants.py):
        each request in one queue with its status, loads with a part in flight, running plus loading
        within the cap, blocks held exactly by running and loading requests, the last step within its budget."""
        check_scheduler(self)

    def take_ended(self) -> list[Request]:
        """Requests the scheduler ended on its own (failed admission or load, internal fault) since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def take_first_tokens(self) -> list[tuple[Request, SampledToken]]:
        """D: requests whose output token 1 came from P's ticket since the last call, with that token
        (the engine loop emits it before any token D samples for them)."""
        seeded, self._first_tokens = self._first_tokens, []
        return seeded

    def take_released_ids(self) -> list[str]:
        """Ids whose blocks were all freed since the last call: nothing refers to them any more."""
        released, self._released_ids = self._released_ids, []
        return released

    def _release(self, request: Request, reason: FinishReason) -> None:
        try:
            action = self.connector.request_finished(
                request, reason, self.kv.block_ids(request.request_id, handoff=request.remote_decode))
        except Exception:
            logger.exception("request %s: the P/D finish hook failed", request.request_id)
            action = FREE_NOW
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                reason = FinishReason.ERROR
                request.error = RequestFailed("internal error while handing the request's KV over")
        if action.error is not None:
            reason = FinishReason.ERROR
            request.error = action.error
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.kv_transfer_params = action.kv_transfer_params
        if action.free_blocks:
            self._free(request.request_id)
        self._finished_since_last_step.append(request.request_id)

    def _free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self._released_ids.append(request_id)

    def _fail(self, request: Request, error: PdserveError) -> None:
        """End a request the scheduler cannot serve; the engine loop reports it."""
        if self.finish(request.request_id, FinishReason.ERROR, error) is not None:
            self._ended.append(request)

    # ---- P/D events ------------------------------------------------------------

    def apply_kv_events(self, events: KVEvents) -> None:
        """What the connector reported: held blocks to free, loads that landed or failed."""
        for request_id in events.released:
            self._free(request_id)
        for request_id in events.landed:
            if request_id in events.uncached:
                self.kv.withhold_from_cache(request_id, events.uncached[request_id])
            self._pull_ended(request_id)
        for failure in events.failed:
            self._pull_ended(failure.request_id, failed=True, error=None if failure.recompute else failure.error)

    def _apply_offload_loads(self) -> None:
        """Tier loads that landed start running after their prefix; failed ones recompute it all."""
        results = self.kv.poll_offload()
        for request_id in results.landed:
            self._tier_read_ended(request_id)
        for request_id in results.failed:
            self._tier_read_ended(request_id, failed=True)

    def _start_loading(self, request: Request, resume_at: int, *, pulling: bool, reading_tier: bool,
                       peer: bool = False, awaiting_ticket: bool = False) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = PendingLoad(request, resume_at, pulling, reading_tier, peer=peer,
                                                       awaiting_ticket=awaiting_ticket)

    def take_ticket(self, request_id: str, key: str, remote: Optional[RemoteSource],
                    first_token: Optional[FirstToken], pd_recomputed: bool) -> bool:
        """D: what admission made of P's ticket for the request with `awaited_ticket` == `key`. A reserved
        request pulls into its blocks at once, a queued one is admitted as any decode request; without a
        P/D source it recomputes like a failed pull. False when no request awaits it (ended meanwhile)."""
        request = self.requests.get(request_id)
        if request is None or request.awaited_ticket != key:
            return False
        request.awaited_ticket = None
        request.pd_recomputed = pd_recomputed
        request.remote = remote
        request.first_token = first_token  # without a source: a recompute that keeps P's token 1 (`_admit`)
        self.connector.request_added(request)
        load = self.loading.get(request_id)
        if load is None:
            return True  # still queued: `_admit` takes it as it is now
        load.awaiting_ticket = False
        if remote is None or remote.num_pull_tokens is not None:
            self._load_part_ended(load, True, None)  # the reserved blocks go back; a local admission follows
            return True
        admission = self.connector.plan_admission(request)
        if admission.kind is not AdmissionKind.REMOTE:
            request.pd_recomputed, request.remote = admission.kind is AdmissionKind.LOCAL, None
            error = admission.error or EngineFailure("the prompt's KV cannot be used")
            self._load_part_ended(load, True, error if admission.kind is AdmissionKind.FAIL else None)
            return True
        load.pulling = self.connector.start_pull(request, self.kv.block_ids(request_id), request.num_cached_tokens)
        request.remote = None  # consumed: a later preemption recomputes locally
        load.resume_at = request.num_prompt_tokens - (1 if request.first_token is None else 0)
        self._load_part_ended(load, False, None)  # runs now if nothing is left to land (all cached here)
        return True

    def _pull_ended(self, request_id: str, *, failed: bool = False, error: Optional[PdserveError] = None) -> None:
        load = self.loading.get(request_id)
        if load is None or not load.pulling:
            return  # ended meanwhile, or a late report
        load.pulling = False
        if failed and not load.peer:
            load.request.pd_recomputed = True  # a P/D request whose prompt this worker computes after all
        self._load_part_ended(load, failed, error)

    def _tier_read_ended(self, request_id: str, *, failed: bool = False) -> None:
        load = self.loading.get(request_id)
        if load is None or not load.reading_tier:
            return  # ended meanwhile, or a late report
        load.reading_tier = False
        self._load_part_ended(load, failed, None)

    def _load_part_ended(self, load: PendingLoad, failed: bool, error: Optional[PdserveError]) -> None:
        """One part of a load (the pull, or the tier's pages) ended. A failed part recomputes the
        request, or fails it with `error`. It moves on when no part still writes its blocks."""
        if failed:
            load.part_failed(error)
        if load.in_flight:
            return
        request = load.request
        del self.loading[request.request_id]
        if load.error is not None:
            self._fail(request, load.error)
        elif load.failed:  # start over as an ordinary local request (that keeps P's token 1: `_admit`)
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            self._resume_after_load(request, load.resume_at)

    def _resume_after_load(self, request: Request, resume_at: int) -> None:
        """Run a request whose prompt KV is in place; one that starts from P's first token gets it as
        output token 1 first (and may end there: max_tokens, a stop token)."""
        if request.first_token is None:
            self._start_running(request, resume_at)
            return
        request.num_computed_tokens = resume_at
        if self._take_first_token(request):
            self._start_running(request, resume_at)

    def _take_first_token(self, request: Request) -> bool:
        """P's token 1 becomes output token 1, counted by every stop rule; False when that ended the request."""
        first, request.first_token = request.first_token, None
        request.output_token_ids.append(first.token_id)
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        # The pulled prompt's full blocks join the prefix cache now, as a computed prompt's would after its step
        # (the siblings of an n > 1 request start on this output and share them).
        self.kv.commit(request.request_id, request.block_hashes, request.num_computed_tokens)
        self._first_tokens.append((request, SampledToken(
            request.request_id, first.token_id, first.logprob if first.logprob is not None else 0.0,
            tuple((int(token_id), float(logprob)) for token_id, logprob in first.top_logprobs))))
        reason = check_stop(request, self.max_model_len)
        if reason is None:
            return True
        self.requests.pop(request.request_id, None)
        self._release(request, reason)
        return False

    def _start_running(self, request: Request, num_computed_tokens: int) -> None:
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    # ---- scheduling ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        if self.has_offload_loads():
            self._apply_offload_loads()
        num_decoding = sum(1 for request in self.running if request.num_computed_tokens >= request.num_tokens - 1)
        step_budget = budget = self.step_budget.tokens(num_decoding)
        budget, preempted = self._schedule_running(output, budget)
        if not preempted:
            self._admit_waiting(output, budget)
        self._step_started = (output, self.clock()) if output.chunks else None
        self.last_step = (output, step_budget)
        output.state_copies = self.kv.take_state_copies()
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted = False
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            try:
                num_new, preempted_now = self._fit_running(request, output, budget, scheduled_ids)
            except Exception:
                logger.exception("request %s: scheduling failed", request.request_id)
                self._fail(request, RequestFailed("internal error while scheduling the request"))
                continue  # the list shrank under index
            preempted |= preempted_now
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank under index
            if num_new:
                output.chunks.append(self._chunk(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
            index += 1
        return budget, preempted

    def _fit_running(self, request: Request, output: SchedulerOutput, budget: int,
                     scheduled_ids: set[str]) -> tuple[int, bool]:
        """Allocate for the request's next chunk, preempting later arrivals while the pool is full."""
        num_new = self._chunk_tokens(request, request.num_computed_tokens,
                                     min(request.num_tokens - request.num_computed_tokens, budget))
        preempted = False
        if num_new <= 0:
            return 0, preempted
        while not (num_new := self._allocate_fitting(request, request.num_computed_tokens, num_new)):
            num_new = self._chunk_tokens(request, request.num_computed_tokens,
                                         min(request.num_tokens - request.num_computed_tokens, budget))
            victim = self._pick_victim(scheduled_ids)
            self._preempt(victim, output)
            preempted = True
            if victim is request:
                return 0, preempted
        return num_new, preempted

    def _allocate_fitting(self, request: Request, num_computed: int, num_new: int, prefix=None) -> int:
        """Allocate for the largest chunk of at most `num_new` tokens the pool can take
        (halving on failure: a prefill chunk of a sliding-window model needs blocks for
        the whole chunk, more than the window it keeps). Returns the chunk size, 0 if none fits."""
        while num_new > 0:
            if self.kv.allocate_slots(request.request_id, num_computed, num_new, prefix):
                return num_new
            if num_new == 1:
                return 0
            num_new //= 2
        return 0

    def _chunk_tokens(self, request: Request, num_computed: int, num_new: int) -> int:
        if self._hands_off_state and request.remote_decode:  # a chunk ends where D takes over (`_chunk`)
            handoff = request.num_prompt_tokens - 1
            if num_computed < handoff < num_computed + num_new:
                num_new = handoff - num_computed
        if not self._snapshots_state:
            return num_new
        num_new = snapshot_chunk_tokens(num_computed, num_new, request.num_prompt_tokens, self.block_size)
        # Also end a prompt's chunk at the next periodic snapshot (--state-snapshot-interval): the state
        # exists only where a step ended, so a snapshot inside one long chunk could never be taken.
        if num_computed + num_new < request.num_prompt_tokens:
            due = self.kv.next_snapshot_tokens(num_computed, request.num_prompt_tokens)
            if due is not None and num_computed < due < num_computed + num_new:
                num_new = due - num_computed
        return num_new

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
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_running:
            request = self.waiting[0]
            try:
                num_scheduled = self._admit(request, output, budget)
            except Exception:
                logger.exception("request %s: admission failed", request.request_id)
                self._fail(request, RequestFailed("internal error while scheduling the request"))
                continue
            if num_scheduled is None:
                break  # first come first served: do not let later requests jump the queue
            budget -= num_scheduled

    def _admit(self, request: Request, output: SchedulerOutput, budget: int) -> Optional[int]:
        """Admit the head of the queue; returns the tokens it takes from the budget, None if it must wait.
        A P/D request whose prompt is computed here after all (a failed pull, a stale ticket, P's data path gone)
        keeps P's token 1 as output token 1: its prefill computes that token too and draws token 2."""
        if request.awaited_ticket is not None:
            return self._reserve(request)
        if request.remote is not None:
            admission = self.connector.plan_admission(request)
            if admission.kind is AdmissionKind.FAIL:
                self._fail(request, admission.error or EngineFailure("the prompt's KV cannot be used"))
                return 0
            if admission.kind is AdmissionKind.REMOTE:
                return self._admit_remote(request)
            request.pd_recomputed = request.remote.num_pull_tokens is None  # a peer pull given up is no P/D leg
            request.remote = None  # given up: the prompt is computed here
        if request.first_token is not None and not self._take_first_token(request):
            self.waiting.popleft()  # P's token 1 ended it (the client may hold that token already)
            return 0
        prefix = self._prefix_for(request)
        num_new = self._chunk_tokens(request, prefix.num_tokens, min(request.num_tokens - prefix.num_tokens, budget))
        num_new = self._allocate_fitting(request, prefix.num_tokens, num_new, prefix)
        if not num_new:
            return None
        self.waiting.popleft()
        if request.num_preemptions == 0:
            request.num_cached_tokens = prefix.num_tokens
        self._mark_scheduled(request)
        if self.kv.start_tier_read(request.request_id):  # part of the prefix comes from the tier
            request.num_computed_tokens = prefix.num_tokens
            self._start_loading(request, prefix.num_tokens, pulling=False, reading_tier=True)
            return 0
        self._start_running(request, prefix.num_tokens)
        output.chunks.append(self._chunk(request, num_new))
        return num_new

    def _prefix_for(self, request: Request) -> PrefixHit:
        # A cached position yields no logits: a request that wants its prompt's logprobs computes it all.
        if request.sampling.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
            return PrefixHit.empty(self.kv.num_groups)
        return self.kv.find_prefix(request.block_hashes, request.num_tokens)

    def _admit_remote(self, request: Request) -> Optional[int]:
        """Allocate the whole prompt, then let the connector pull what the prefix cache lacks.
        With P's first token (pd/first_token.py) the pull brings every prompt token's KV and the token
        becomes output token 1: the first step here is a decode step. Without it the last prompt token
        is computed here (its logits give the first output token).
        Prefix pages from this worker's offload tier load alongside the pull."""
        prefix = self.kv.find_prefix(request.block_hashes, request.num_prompt_tokens)
        num_pull_tokens = request.remote.num_pull_tokens  # a peer pull: a prefix, the rest computed here
        if num_pull_tokens is None:
            filled, num_new = request.num_prompt_tokens - 1, 1
        else:
            filled, num_new = max(num_pull_tokens, prefix.num_tokens), 0
        if not self.kv.allocate_slots(request.request_id, filled, num_new, prefix):
            return None
        self.waiting.popleft()
        request.num_cached_tokens = prefix.num_tokens
        self._mark_scheduled(request)
        pulling = self.connector.start_pull(request, self.kv.block_ids(request.request_id), prefix.num_tokens)
        request.remote = None  # consumed: a later preemption recomputes locally
        reading_tier = self.kv.start_tier_read(request.request_id)
        resume_at = filled if num_pull_tokens is not None else (
            request.num_prompt_tokens - (1 if request.first_token is None else 0))
        if pulling or reading_tier:
            self._start_loading(request, resume_at, pulling=pulling, reading_tier=reading_tier,
                                peer=num_pull_tokens is not None)
        else:
            self._resume_after_load(request, resume_at)
        return 0

    def _reserve(self, request: Request) -> Optional[int]:
        """D, before P's ticket: allocate what `_admit_remote` would (a prefix hit here counts) and hold it,
        loading, until `take_ticket` says what to pull into it. Tier pages of the prefix load meanwhile."""
        prefix = self.kv.find_prefix(request.block_hashes, request.num_prompt_tokens)
        if not self.kv.allocate_slots(request.request_id, request.num_prompt_tokens - 1, 1, prefix):
            return None
        self.waiting.popleft()
        request.num_cached_tokens = prefix.num_tokens
        self._mark_scheduled(request)
        reading_tier = self.kv.start_tier_read(request.request_id)
        self._start_loading(request, prefix.num_tokens, pulling=False, reading_tier=reading_tier,
                            awaiting_ticket=True)
        return 0

    @staticmethod
    def _mark_scheduled(request: Request) -> None:
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = time.monotonic()

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        if self._hands_off_state and request.remote_decode and start == request.num_prompt_tokens - 1 > 0:
            # The copy runs before this chunk's forward pass: the state D needs to compute the last token.
            if not self.kv.keep_state_handoff(request.request_id):
                logger.warning("request %s: no free page for its state handoff", request.request_id)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_ids=tuple(list(ids) for ids in self.kv.block_ids(request.request_id)),
            sample=end == request.num_tokens,
            sampling=request.sampling,
            num_sampled_so_far=len(request.output_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
        )

    # ---- results -------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Iterable[SampledToken],
               prompt_logprobs: Iterable[PromptLogprobs] = ()) -> list[Request]:
        """Advance computed counts, append sampled tokens (and prompt logprobs), finish what must stop.

        Returns the requests that got a new token or finished, in chunk order.
        """
        if self._step_started is not None and self._step_started[0] is output:  # the step's own duration
            self.step_budget.model.record_step(sum(chunk.num_tokens for chunk in output.chunks),
                                           self.clock() - self._step_started[1])
            self._step_started = None
        by_id = {token.request_id: token for token in sampled}
        for computed in prompt_logprobs:
            request = self.requests.get(computed.request_id)
            # Positions arrive in order; a recompute after preemption repeats ones already kept.
            if request is not None and computed.first_position == len(request.prompt_logprobs) + 1:
                request.prompt_logprobs.extend(computed.entries)
        changed: list[Request] = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                if self._advance(request, chunk, by_id.get(chunk.request_id)):
                    changed.append(request)
            except Exception:
                logger.exception("request %s: updating after the step failed", request.request_id)
                self._fail(request, RequestFailed("internal error while updating the request"))
        return changed

    def _advance(self, request: Request, chunk: ScheduledChunk, token: Optional[SampledToken]) -> bool:
        request.num_computed_tokens = chunk.end_position
        # Commit before a possible finish frees the blocks, so they stay cached.
        self.kv.commit(request.request_id, request.block_hashes, request.num_computed_tokens,
                       prompt_boundary=self._snapshots_state and is_snapshot_point(
                           request.num_computed_tokens, request.num_prompt_tokens, self.block_size))
        if token is None:
            return False
        if request.remote_decode and not request.output_token_ids:  # P: D starts from this token (the ticket)
            request.first_token = _first_token_record(request, token)
        request.output_token_ids.append(token.token_id)
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        reason = check_stop(request, self.max_model_len)
        if reason is not None:
            self.requests.pop(request.request_id, None)
            self.running.remove(request)
            self._release(request, reason)
        return True


def _first_token_record(request: Request, token: SampledToken) -> FirstToken:
    """P's first token as its ticket carries it: the logprobs only when the request asked (else the
    sampler computed none)."""
    key = first_draw_key(request.sampling)
    if not request.sampling.logprobs:
        return FirstToken(token_id=token.token_id, sampling_sha256=key)
    return FirstToken(token_id=token.token_id, logprob=token.logprob, num_top_logprobs=request.sampling.top_logprobs,
                      top_logprobs=list(token.top_logprobs), sampling_sha256=key)
