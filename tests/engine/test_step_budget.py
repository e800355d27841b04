"""The step budget: while streams decode, a step takes only the tokens that fit in --max-step-ms,
from a line fitted to the worker's own step times."""

from __future__ import annotations

import pytest

from pdserve.api.config import SchedulerConfig
from pdserve.engine.step_budget import MIN_PREFILL_CHUNK, StepBudget, StepTimeModel
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from tests.engine.checked_scheduler import CheckedScheduler
from tests.engine.test_scheduler import BLOCK, answer, make_request


def test_the_step_time_line_is_fitted_from_mixed_steps_and_forgets_old_ones():
    model = StepTimeModel()
    for tokens in (1, 4, 64, 256, 1, 4, 64, 256):
        model.observe(tokens, 0.010 + 0.002 * tokens)  # 10 ms of overhead, 2 ms a token
    base, per_token = model.line()
    assert base == pytest.approx(0.010) and per_token == pytest.approx(0.002)
    for _ in range(200):
        model.observe(64, 0.010 + 0.004 * 64)  # the machine got busier: steps of one size only now
    base, per_token = model.line()
    assert base + per_token * 64 == pytest.approx(0.010 + 0.004 * 64, rel=0.01)


def test_too_few_or_useless_samples_give_no_line():
    model = StepTimeModel()
    for _ in range(7):
        model.observe(8, 0.01)
    assert model.line() is None
    model.observe(0, 1.0)
    model.observe(8, 0.0)
    assert model.line() is None  # ignored, still seven


def trained(max_step_ms=None, budget=512) -> StepBudget:
    step_budget = StepBudget(budget, None if max_step_ms is None else max_step_ms / 1000)
    for tokens in (1, 8, 128, 512) * 3:
        step_budget.model.observe(tokens, 0.005 + 0.001 * tokens)  # 5 ms + 1 ms a token
    return step_budget


def test_the_budget_fits_the_step_time_only_while_streams_decode():
    assert trained(max_step_ms=25).tokens(num_decoding=4) == 20  # (25 - 5) / 1 ms
    assert trained(max_step_ms=25).tokens(num_decoding=0) == 512  # nothing to protect: the whole budget
    assert trained(max_step_ms=None).tokens(num_decoding=4) == 512  # off
    assert trained(max_step_ms=10_000).tokens(num_decoding=4) == 512  # never above the configured budget
    assert trained(max_step_ms=6).tokens(num_decoding=4) == 4 + MIN_PREFILL_CHUNK  # a prompt always moves
    assert StepBudget(512, 0.025).tokens(num_decoding=4) == 512  # not measured yet


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("max_step_ms, longest_chunk, longest_step_s", [(25, 16, 0.025), (None, 200, 0.209)])
def test_a_prompt_arriving_beside_decoding_streams_is_cut_into_chunks_that_fit_the_step_time(
        max_step_ms, longest_chunk, longest_step_s):
    """Steps cost 5 ms + 1 ms a token (the clock plays the model). Four streams decode; a 200-token
    prompt arrives. Without a step budget it takes one 200-token step (209 ms for every stream);
    with --max-step-ms 25 it goes in chunks of 16 tokens beside the streams' 4, no step past 25 ms."""
    clock = Clock()
    kv = KVCacheManager(plan_groups([FullAttentionSpec()] * 2), 256, BLOCK)
    config = SchedulerConfig(max_num_batched_tokens=512, max_step_ms=max_step_ms)
    scheduler = CheckedScheduler(config, kv, BLOCK, 4096, clock=clock)

    def step() -> list:
        output = scheduler.schedule()
        clock.now += 0.005 + 0.001 * sum(chunk.num_tokens for chunk in output.chunks)
        scheduler.update(output, answer(output))
        return output.chunks

    for index in range(4):
        scheduler.add_request(make_request(f"s{index}", 8 * (index + 1), max_tokens=400))
    for _ in range(12):  # the streams' prompts, then decoding: the model learns the line
        step()
    scheduler.add_request(make_request("long", 200, max_tokens=2, first_token=1000))
    durations, chunk_sizes = [], []
    while scheduler.requests["long"].num_computed_tokens < 199:
        started = clock.now
        chunks = step()
        durations.append(clock.now - started)
        chunk_sizes += [c.num_tokens for c in chunks if c.request_id == "long"]
        assert sum(1 for c in chunks if c.request_id != "long") == 4  # every stream got its token each step
    assert max(chunk_sizes) == longest_chunk and sum(chunk_sizes) == 200
    assert max(durations) == pytest.approx(longest_step_s)
