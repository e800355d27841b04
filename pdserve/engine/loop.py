"""The engine loop: one thread, synchronous steps.

schedule -> run the model -> update requests -> emit outputs, repeated while
there is work; it sleeps on its inbox when idle. Invariant: only this thread
touches the scheduler, the KV manager and the runner; other threads talk to it
through the inbox and receive outputs through per-request sinks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats
from pdserve.request import FinishReason, GenerationRequest, LoadReport, Request, RequestOutput

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


class KVRole(Protocol):
    """The P or D side of disaggregation, ticked by the loop every iteration."""

    def has_pending(self) -> bool:
        """True while pinned blocks or pulls need polling even with no step to run."""
        ...

    def tick(self) -> list[tuple[str, str]]:
        """Poll the transport; returns (request id, message) of requests to end with an error."""
        ...

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held for remote readers (prefill side; 0 on the decode side)."""
        ...


@dataclass(frozen=True, slots=True)
class _Submit:
    request: GenerationRequest
    sink: OutputSink
    arrival_time_s: float


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: Optional[str]  # None: every request


@dataclass(frozen=True, slots=True)
class _Shutdown:
    pass


_Command = Union[_Submit, _Abort, _Shutdown]


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: OutputProcessor,
        eos_token_ids: tuple[int, ...],
        stats: EngineStats,
        role: Optional[KVRole] = None,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.role = role
        self.inbox: queue.Queue[_Command] = queue.Queue()
        self.sinks: dict[str, OutputSink] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    # ---- called from other threads ---------------------------------------------

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.inbox.put(_Submit(request, sink, time.monotonic()))

    def abort(self, request_id: str) -> None:
        self.inbox.put(_Abort(request_id))

    def abort_all(self) -> None:
        self.inbox.put(_Abort(None))

    def load_report(self) -> LoadReport:
        scheduler = self.scheduler
        return LoadReport(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_waiting_for_kv=scheduler.num_waiting_for_kv,
            kv_usage=sum(scheduler.kv.usage_by_group()),
            num_pinned_blocks=self.role.num_pinned_blocks if self.role is not None else 0,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.inbox.put(_Shutdown())
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the engine thread -------------------------------------------------------

    def run_forever(self) -> None:
        self.runner.bind_thread()
        while not self._stopping:
            self._drain_inbox(block=not self.scheduler.has_work())
            self._tick_role()
            if self.scheduler.has_work():
                self.step()

    def _tick_role(self) -> None:
        if self.role is None:
            return
        try:
            failed = self.role.tick()
        except Exception:  # a transport fault must not take the worker down
            logger.exception("KV role tick failed")
            return
        for request_id, message in failed:
            self._finish(request_id, FinishReason.ERROR, message)

    def run_until_idle(self) -> None:
        """Drive the loop on the calling thread until no request is left
        (tests and offline benchmarks; never while the thread runs)."""
        self._drain_inbox(block=False)
        while self.scheduler.has_work():
            self._tick_role()
            self.step()
            self._drain_inbox(block=False)

    def _drain_inbox(self, block: bool) -> None:
        # With pinned blocks or pulls in flight the loop must keep polling them.
        timeout_s = 0.005 if self.role is not None and self.role.has_pending() else 1.0
        while True:
            try:
                command = self.inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return
            block = False
            self._apply(command)

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Submit):
            self._add(command)
        elif isinstance(command, _Abort):
            for request_id in [command.request_id] if command.request_id is not None else list(self.sinks):
                self._finish(request_id, FinishReason.ABORT)
        else:
            self._stopping = True

    def _add(self, command: _Submit) -> None:
        generation = command.request
        request = Request(
            request_id=generation.request_id,
            prompt_token_ids=list(generation.prompt_token_ids),
            sampling=generation.sampling,
            eos_token_ids=self.eos_token_ids,
            arrival_time_s=command.arrival_time_s,
            kv_transfer_params=generation.kv_transfer_params,
            remote_prefill=generation.remote_prefill,
        )
        self.sinks[request.request_id] = command.sink
        self.scheduler.add_request(request)

    def _finish(self, request_id: str, reason: FinishReason, error: Optional[str] = None) -> None:
        request = self.scheduler.finish(request_id, reason)
        sink = self.sinks.pop(request_id, None)
        self.outputs.forget(request_id)
        if request is not None and sink is not None:
            sink(RequestOutput(request_id, (), "", finished=True, finish_reason=reason, error=error or request.error,
                               num_prompt_tokens=request.num_prompt_tokens,
                               num_output_tokens=len(request.output_token_ids)))

    def step(self) -> None:
        started = time.monotonic()
        scheduled = self.scheduler.schedule()
        try:
            sampled = self.runner.execute(scheduled)
            # KV complete: from here the step's blocks may be freed, evicted,
            # read by a decode worker (update() publishes kv_transfer_params on
            # a prefill worker) or overwritten by the next NIXL READ.
            self.runner.synchronize()
        except Exception:  # a model failure must not take the worker down
            logger.exception("engine step failed; failing its %d requests", len(scheduled.chunks))
            self._settle_device()
            for chunk in scheduled.chunks:
                self._finish(chunk.request_id, FinishReason.ERROR, "internal error while running the model")
            return
        changed = self.scheduler.update(scheduled, sampled)
        logprobs = {token.request_id: token.logprob for token in sampled}
        now = time.monotonic()
        for request in changed:
            self._emit(request, logprobs, now)
        self.stats.record_step(self.scheduler, scheduled, now - started)

    def _settle_device(self) -> None:
        """After a failed step: wait for its queued kernels before its blocks are freed."""
        try:
            self.runner.synchronize()
        except Exception:  # a sticky device error: every later step fails too, and says so
            logger.exception("device synchronisation after a failed step failed")

    def _emit(self, request: Request, logprobs: dict[str, float], now: float) -> None:
        if request.first_token_time_s is None:
            request.first_token_time_s = now
            self.stats.record_first_token(request)
        new_logprobs = (logprobs[request.request_id],) if request.sampling.logprobs else ()
        output, stop_reason = self.outputs.process(request, new_logprobs)
        if stop_reason is not None:
            self.scheduler.finish(request.request_id, stop_reason)
        sink = self.sinks.get(request.request_id)
        if output.finished:
            self.sinks.pop(request.request_id, None)
        if sink is not None:
            sink(output)
