"""The engine loop: one thread, synchronous steps, supervised.

poll the P/D connector -> schedule -> run the model -> update requests -> emit
outputs, repeated while there is work; it sleeps on its inbox when idle and
when its last step could schedule nothing (queued work that cannot run until a
command or a P/D event changes something), so it never spins a core.
Invariants: only this thread touches the scheduler, the KV manager, the
connector and the runner; other threads talk to it through the inbox and
receive outputs through per-request sinks. A fault while serving some
requests fails those requests only; a fault of the loop itself stops it,
fails every request it held, and is reported by `is_alive()` so the worker
can say so on /live and exit.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Optional

from pdserve.api.errors import EngineFailure, RequestFailed
from pdserve.api.kv_transfer import FirstToken
from pdserve.api.sampling import FinishReason
from pdserve.engine.emitter import OutputEmitter, OutputSink
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.engine.core_share import CoreShare
from pdserve.engine.inbox import Abort, Call, Command, EngineInbox, Shutdown, Submit
from pdserve.engine.schedule_types import SampledToken, SchedulerOutput, StepResult
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats
from pdserve.engine.step_runner import StepCancelled, StepRunner
from pdserve.parallel.errors import RanksLost
from pdserve.request import GenerationRequest, LoadReport, Request

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # inbox wait with nothing to do
POLL_WAIT_S = 0.005  # inbox wait while transfers or leases need polling
OFFLOAD_SPIN_S = 0.0002  # run_until_idle's pause while only tier reads are pending


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, emitter: OutputEmitter,
                 eos_token_ids: tuple[int, ...], stats: EngineStats, request_ids: Optional[RequestIdRegistry] = None,
                 *, inbox: Optional[EngineInbox] = None, core_share: Optional[CoreShare] = None,
                 check_invariants: bool = False):
        """`inbox`: made first when something built before the loop must wake it (the offload tier);
        `core_share`: --core-ledger, this worker's threads follow its colocated peer's work;
        `check_invariants`: run `Scheduler.check_invariants()` after every step (a debug aid:
        PDSERVE_CHECK_INVARIANTS=1; a broken invariant stops the loop)."""
        self.scheduler = scheduler
        self.runner = runner
        self.emitter = emitter
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.request_ids = request_ids or RequestIdRegistry()
        self.inbox = inbox or EngineInbox()
        self.core_share = core_share
        self.check_invariants = check_invariants
        self.fatal_error: Optional[BaseException] = None
        self.last_progress_s = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stalled = False  # the last step scheduled nothing: wait for news before trying again
        self._abort_requested: set[str] = set()  # added to by other threads, emptied by Abort commands

    # ---- called from other threads ---------------------------------------------

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.inbox.submit(request, sink)

    def abort(self, request_id: str) -> None:
        # Seen by the step in flight too: a step whose requests are all aborted stops at the next
        # layer instead of computing a whole chunk for no one (the _Abort below then finishes them).
        self._abort_requested.add(request_id)
        self.inbox.put(Abort(request_id))

    def abort_all(self) -> None:
        self.inbox.put(Abort(None))

    def deliver_ticket(self, key: str, admitted: GenerationRequest) -> None:
        """D: what admission made of P's ticket for the request submitted with `awaited_ticket` == `key`
        (its blocks reserved meanwhile); the engine thread starts its pull at its next iteration."""
        self.inbox.call_soon(functools.partial(self._take_ticket, key, admitted))

    def call_soon(self, function: Callable[[], None]) -> None:
        """Run `function` on the engine thread at its next iteration (it must not block)."""
        self.inbox.call_soon(function)

    def wake(self) -> None:
        """Make an idle engine thread run its next iteration now rather than after its inbox wait
        (from any thread, e.g. when a tier load it polls for has a result)."""
        self.inbox.wake()

    def load_report(self) -> LoadReport:
        scheduler = self.scheduler
        return LoadReport(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_waiting_for_kv=scheduler.num_waiting_for_kv,
            kv_usage=sum(scheduler.kv.usage_by_group()),
            num_pinned_blocks=scheduler.connector.num_pinned_blocks,
        )

    def is_alive(self) -> bool:
        """False once the loop died (or was never started)."""
        return self.fatal_error is None and self._thread is not None and self._thread.is_alive()

    def progress_age_s(self) -> float:
        return time.monotonic() - self.last_progress_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the engine thread -------------------------------------------------------

    def run_forever(self) -> None:
        try:
            self.runner.bind_thread()
            while not self._stopping:
                self.iterate()
        except BaseException as error:  # noqa: BLE001 - the loop itself is broken: stop and say so
            self._die(error)

    def iterate(self) -> None:
        """One turn of the loop: commands, P/D events, at most one step."""
        self._drain_inbox(block=self._stalled or not self.scheduler.has_work())
        self._poll_connector()
        self._stalled = self.scheduler.has_work() and not self.step()
        self._settle()
        self.stats.record_load(self.scheduler)  # also while idle: pins released, pulls landing
        self.runner.keep_ranks_alive()
        self.last_progress_s = time.monotonic()

    def run_until_idle(self) -> None:
        """Drive the loop on the calling thread until no request is left
        (tests and offline benchmarks; never while the thread runs)."""
        self._drain_inbox(block=False)
        while self.scheduler.has_work() or self.scheduler.num_waiting_for_kv:
            self._poll_connector()
            if self.scheduler.has_work() and not self.step() and self.scheduler.has_offload_loads():
                time.sleep(OFFLOAD_SPIN_S)  # let the tier's I/O thread have the GIL for its reads
            self._settle()
            self._drain_inbox(block=False)
        self._settle()

    def _die(self, error: BaseException) -> None:
        self.fatal_error = error
        logger.critical("the engine loop stopped: %r", error, exc_info=error)
        self.emitter.fail_all(EngineFailure("the engine stopped unexpectedly; the worker will restart"))

    def _drain_inbox(self, block: bool) -> None:
        pending = self.scheduler.connector.has_pending() or self.scheduler.has_offload_loads()
        timeout_s = POLL_WAIT_S if pending else IDLE_WAIT_S
        while (command := self.inbox.take(timeout_s if block else None)) is not None:
            block = False
            self._apply(command)

    def _apply(self, command: Command) -> None:
        if isinstance(command, Submit):
            self._add(command)
        elif isinstance(command, Abort):
            for request_id in [command.request_id] if command.request_id is not None else self.emitter.request_ids():
                self._finish(request_id, FinishReason.ABORT)
            self._abort_requested.discard(command.request_id)
        elif isinstance(command, Call):
            command.function()
        else:
            self._stopping = True

    def _add(self, command: Submit) -> None:
        generation = command.request
        request = Request(
            request_id=generation.request_id,
            prompt_token_ids=list(generation.prompt_token_ids),
            sampling=generation.sampling,
            eos_token_ids=self.eos_token_ids,
            arrival_time_s=command.arrival_time_s,
            remote_decode=generation.remote_decode,
            remote=generation.remote,
            pd_recomputed=generation.pd_recomputed,
            first_token=_ps_first_token(generation),
            awaited_ticket=generation.awaited_ticket,
        )
        self.emitter.register(request.request_id, command.sink)
        self.scheduler.add_request(request)

    def _take_ticket(self, key: str, admitted: GenerationRequest) -> None:
        first_token = _ps_first_token(admitted)
        try:
            if self.scheduler.take_ticket(admitted.request_id, key, admitted.remote, first_token,
                                          admitted.pd_recomputed):
                self._emit_first_tokens()  # a prompt all cached here needs no pull: P's token goes out now
            elif admitted.remote is not None:  # the request ended while P computed: P may free its pin now
                orphan = Request(admitted.request_id, list(admitted.prompt_token_ids), admitted.sampling,
                                 self.eos_token_ids, time.monotonic(), remote=admitted.remote)
                self.scheduler.connector.request_added(orphan)
                self.scheduler.connector.request_finished(orphan, FinishReason.ABORT, ())
        except Exception:  # a fault while starting one request's pull fails that request only
            logger.exception("request %s: taking its ticket failed", admitted.request_id)
            self._finish(admitted.request_id, FinishReason.ERROR,
                         RequestFailed("internal error while starting the request's KV pull"))

    def _poll_connector(self) -> None:
        try:
            events = self.scheduler.connector.poll()
        except RanksLost:  # the worker's own ranks are gone: nothing can be served
            raise
        except Exception:  # a transport fault must not take the worker down; the next poll retries
            logger.exception("the P/D connector's poll failed")
            return
        if events:
            self.scheduler.apply_kv_events(events)
            self._emit_first_tokens()

    def _emit_first_tokens(self) -> None:
        """Output token 1 of P/D requests that start from P's token (their pull landed, or D computes
        their prompt after all and continues from P's token): sent before any token D samples for them."""
        seeded = self.scheduler.take_first_tokens()
        now = time.monotonic()
        for request, token in seeded:
            if request.pd_recomputed:  # its first step here computes the whole prompt: no handoff component
                self.stats.record_first_token_kept_recomputing()
            else:
                request.first_token_from_prefill_s = now
            self._emit(request, {request.request_id: token}, now)

    def _finish(self, request_id: str, reason: FinishReason, error: Optional[EngineFailure] = None) -> None:
        request = self.scheduler.finish(request_id, reason, error)
        if request is not None:
            self.emitter.emit_final(request)
        elif error is not None:  # already finished in the scheduler; its final output never left
            self.emitter.fail(request_id, error)

    def _settle(self) -> None:
        """Report requests the scheduler ended on its own; free the ids nothing refers to any more."""
        for request in self.scheduler.take_ended():
            self.emitter.emit_final(request)
        for request_id in self.scheduler.take_released_ids():
            self.request_ids.release(request_id)

    def step(self) -> bool:
        """Schedule, run, update, emit. False when nothing could be scheduled: no request was
        computed, admitted, preempted or ended (only a command or a P/D event can change that)."""
        started = time.monotonic()
        queues = self._queue_sizes()
        if self.core_share is not None:
            self.core_share.before_step(any(queues[:3]))
        scheduled = self.scheduler.schedule()
        self._emit_first_tokens()  # landed inside schedule() (tier reads) or started with nothing to pull
        result = self._execute(scheduled)
        if result is None:  # abandoned: every request in it was aborted while it ran
            for chunk in scheduled.chunks:
                self._finish(chunk.request_id, FinishReason.ABORT)
            logger.info("step of %d requests abandoned mid-model: all of them were aborted", len(scheduled.chunks))
            if self.check_invariants:
                self.scheduler.check_invariants()
            return True
        result.sampled = self._drop_failed_rows(result.sampled)
        changed = self.scheduler.update(scheduled, result.sampled, result.prompt_logprobs)
        sampled = {token.request_id: token for token in result.sampled}
        now = time.monotonic()
        for request in changed:
            self._emit(request, sampled, now)
        self.stats.record_step(self.scheduler, scheduled, now - started)
        after = self._queue_sizes()
        if self.core_share is not None:  # the step that ended this worker's work says so at once
            self.core_share.publish(any(after[:3]))
        if self.check_invariants:
            self.scheduler.check_invariants()
        return bool(scheduled.chunks or scheduled.preempted_request_ids) or after != queues

    def _drop_failed_rows(self, sampled: list[SampledToken]) -> list[SampledToken]:
        """Rows the sampler could not draw from fail their own requests; the rest go on."""
        for token in sampled:
            if token.failed:
                reason = token.failure or "internal error: the model produced invalid logits for this request"
                logger.error("request %s: no token could be drawn (%s); failing it", token.request_id, reason)
                self._finish(token.request_id, FinishReason.ERROR, RequestFailed(reason))
        return [token for token in sampled if not token.failed]

    def _queue_sizes(self) -> tuple[int, int, int, int, int]:
        """Waiting, loading, running, and legs awaiting P's ticket (holding their reservation, queued for
        it): the first three are work for the cores (--core-ledger); a leg awaiting its ticket is not, or
        D would narrow P while P computes that very prompt (queued, it would even flap D's byte busy then
        idle within one step while P reads it)."""
        scheduler = self.scheduler
        num_reserved = scheduler.num_awaiting_ticket
        num_queued = sum(1 for request in scheduler.waiting if request.awaited_ticket is not None)
        return (scheduler.num_waiting - num_queued, scheduler.num_waiting_for_kv - num_reserved,
                scheduler.num_running, num_reserved, num_queued)

    def _execute(self, scheduled: SchedulerOutput) -> Optional[StepResult]:
        """The step's result; None if it was abandoned (`StepCancelled`)."""
        if self.runner.cancellable and scheduled.chunks:
            ids = frozenset(chunk.request_id for chunk in scheduled.chunks)
            self.runner.stop_check = lambda: ids <= self._abort_requested
        try:
            return self._execute_synchronized(scheduled)
        except StepCancelled:
            self._settle_device()  # its queued kernels finish before its blocks are freed
            return None
        except RanksLost:  # not one request's fault, and no retry can help: the loop dies
            raise
        except Exception:
            self._settle_device()
            if len(scheduled.chunks) <= 1 or not self.runner.replays_failed_steps:
                self._fail_chunks(scheduled, "while running the model")
                return StepResult()
        # Find the culprit: run each chunk alone, fail those that fail alone.
        logger.warning("engine step of %d requests failed; retrying them one by one", len(scheduled.chunks))
        result = StepResult()
        for chunk in scheduled.chunks:
            alone = SchedulerOutput(chunks=[chunk])
            try:
                result.extend(self._execute_synchronized(alone))
            except Exception:
                self._settle_device()
                self._fail_chunks(alone, "while running the model")
        return result

    def _execute_synchronized(self, scheduled: SchedulerOutput) -> StepResult:
        try:
            sampled = self.runner.execute(scheduled)
        finally:
            if self.runner.cancellable:
                self.runner.stop_check = None
        # KV complete: from here the step's blocks may be freed, evicted, read by a
        # decode worker (update() publishes kv_transfer_params on a prefill worker)
        # or overwritten by the next NIXL READ.
        self.runner.synchronize()
        return sampled

    def _settle_device(self) -> None:
        """After a failed step: wait for its queued kernels before its blocks are freed."""
        try:
            self.runner.synchronize()
        except Exception:  # a sticky device error: every later step fails too, and says so
            logger.exception("device synchronisation after a failed step failed")

    def _fail_chunks(self, scheduled: SchedulerOutput, where: str) -> None:
        for chunk in scheduled.chunks:
            logger.exception("request %s failed %s", chunk.request_id, where)
            self._finish(chunk.request_id, FinishReason.ERROR, RequestFailed(f"internal error {where}"))

    def _emit(self, request: Request, sampled: dict[str, SampledToken], now: float) -> None:
        try:
            if request.first_token_time_s is None:
                request.first_token_time_s = now
                self.stats.record_first_token(request)
            elif request.first_token_from_prefill_s is not None:  # D's first step after P's token
                self.stats.record_first_step_after_handoff(now - request.first_token_from_prefill_s)
                request.first_token_from_prefill_s = None
            stop_reason = self.emitter.emit(request, sampled.get(request.request_id))
        except Exception:
            logger.exception("request %s: producing its output failed", request.request_id)
            self._finish(request.request_id, FinishReason.ERROR, RequestFailed("internal error while producing the output"))
            return
        if stop_reason is not None:
            self.scheduler.finish(request.request_id, stop_reason)


def _ps_first_token(generation: GenerationRequest) -> Optional[FirstToken]:
    """The token P sampled, as admission passed it on from P's ticket (never from the client's params): for a
    request that pulls from P, or one whose prompt D computes after all (it still continues from P's token)."""
    return generation.first_token if generation.remote is not None or generation.pd_recomputed else None
