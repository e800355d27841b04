"""The engine loop waits for the device at the end of every step, before any block is
freed, evicted, published to a decode worker or reused: on success and on failure.

A recording runner stands in for the model (the loop's contract with the device is
`execute` then `synchronize`); the scheduler, KV manager and prefill connector are real.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.api.config import SchedulerConfig
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.emitter import OutputEmitter
from pdserve.engine.loop import EngineLoop
from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.schedule_types import SampledToken, SchedulerOutput, StepResult
from pdserve.engine.stats import EngineStats
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.metrics import Metrics
from pdserve.pd.leases import LeaseTable
from pdserve.pd.prefill import PrefillConnector, PrefillIdentity
from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from tests.devices import cuda_available
from tests.engine.checked_scheduler import CheckedScheduler
from tests.server.fake_engine import FakeTokenizer

BLOCK_SIZE, NUM_BLOCKS = 4, 32
PLAN = plan_groups([FullAttentionSpec()])


class Tokenizer(FakeTokenizer):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids)


class RecordingRunner:
    """Answers every sampling chunk with token 7; logs what it is asked to do (a `StepRunner`)."""

    cancellable = False  # its steps are never abandoned between layers
    stop_check = None
    replays_failed_steps = True

    def __init__(self, events: list[str], fail_execute: bool = False, fail_sync: bool = False):
        self.events = events
        self.fail_execute = fail_execute
        self.fail_sync = fail_sync

    def execute(self, step: SchedulerOutput) -> StepResult:
        self.events.append("execute")
        if self.fail_execute:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return StepResult([SampledToken(chunk.request_id, 7, 0.0) for chunk in step.chunks if chunk.sample])

    def synchronize(self) -> None:
        self.events.append("synchronize")
        if self.fail_sync:
            raise RuntimeError("CUDA error: sticky")

    def bind_thread(self) -> None:
        pass

    def keep_ranks_alive(self) -> None:
        pass


class RecordingKV(KVCacheManager):
    def __init__(self, events: list[str]):
        super().__init__(PLAN, NUM_BLOCKS, BLOCK_SIZE)
        self.events = events

    def free(self, request_id: str) -> None:
        if self.block_ids(request_id) and any(self.block_ids(request_id)):
            self.events.append(f"free {request_id}")
        super().free(request_id)


class RecordingPrefillConnector(PrefillConnector):
    def __init__(self, events: list[str], *args):
        super().__init__(*args)
        self.events = events

    def request_finished(self, request, reason, block_tables):
        action = super().request_finished(request, reason, block_tables)
        if action.kv_transfer_params is not None:
            self.events.append(f"publish {request.request_id}")
        return action


def make_loop(runner_kwargs: dict, prefill: bool = False) -> tuple[EngineLoop, list[str], list]:
    events: list[str] = []
    kv = RecordingKV(events)
    connector = None
    if prefill:
        transport = FakeTransport(torch.zeros(NUM_BLOCKS, 8, dtype=torch.int8), "P", FakeFabric())
        connector = RecordingPrefillConnector(events, transport, LeaseTable(30.0),
                                              PrefillIdentity("P", "e", "127.0.0.1", 1), PLAN, BLOCK_SIZE,
                                              Metrics().transfer)
    scheduler = CheckedScheduler(SchedulerConfig(), kv, BLOCK_SIZE, 1000, connector=connector)
    loop = EngineLoop(scheduler, RecordingRunner(events, **runner_kwargs), OutputEmitter(OutputProcessor(Tokenizer())),
                      (2,), EngineStats(Metrics(), kv))
    outputs: list = []
    return loop, events, outputs


def submit(loop: EngineLoop, outputs: list, request_id: str, **extra) -> None:
    sampling = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    loop.submit(GenerationRequest(request_id, tuple(range(10, 19)), sampling, **extra), outputs.append)


def test_a_finishing_request_frees_its_blocks_only_after_the_step_synchronized():
    loop, events, outputs = make_loop({})
    submit(loop, outputs, "r1")
    loop.run_until_idle()
    assert events == ["execute", "synchronize", "free r1"]
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH


def test_prefill_publishes_kv_transfer_params_only_after_the_step_synchronized():
    loop, events, outputs = make_loop({}, prefill=True)
    submit(loop, outputs, "r1", remote_decode=True)
    loop.run_until_idle()
    assert events == ["execute", "synchronize", "publish r1"]
    assert outputs[-1].kv_transfer_params.do_remote_prefill is True


@pytest.mark.parametrize("fail_sync", [False, True], ids=["execute-raises", "sync-raises-too"])
def test_a_failed_step_synchronizes_before_freeing_and_fails_only_its_requests(fail_sync):
    loop, events, outputs = make_loop({"fail_execute": True, "fail_sync": fail_sync})
    submit(loop, outputs, "r1")
    loop.run_until_idle()
    assert events == ["execute", "synchronize", "free r1"]
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert loop.scheduler.kv.num_free_blocks == NUM_BLOCKS - 1


def test_a_step_whose_synchronize_raises_is_a_failed_step():
    """An asynchronous device error surfaces at the synchronisation: the step's requests fail."""
    loop, events, outputs = make_loop({"fail_sync": True})
    submit(loop, outputs, "r1")
    loop.run_until_idle()
    assert events == ["execute", "synchronize", "synchronize", "free r1"]
    assert outputs[-1].finish_reason is FinishReason.ERROR


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_runner_synchronize_leaves_the_compute_stream_idle():
    from pdserve.kv.layout import KVPoolLayout
    from pdserve.models.base import ModelSpec
    from pdserve.runner.model_runner import ModelRunner

    class BusyModel(torch.nn.Module):  # no layers: the runner only needs its spec (attention-only)
        spec = ModelSpec("llama", 1, 16, 2, 2, 16, 32, 64, (FullAttentionSpec(),))
        layers = ()

    device = torch.device("cuda")
    layout = KVPoolLayout(8, 1, BLOCK_SIZE, 2, 16, torch.float32)
    runner = ModelRunner(BusyModel(), PLAN, layout, device)
    big = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        big = big @ big / 64  # queued, not yet run
    runner.synchronize()
    assert torch.cuda.current_stream(device).query()
