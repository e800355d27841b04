"""Scheduler behaviour over the real (torch-free) KV manager, without a model:
the tests play the runner's part by handing back sampled tokens."""

from __future__ import annotations

import pytest

from pdserve.api.config import SchedulerConfig
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken, SchedulerOutput
from pdserve.engine.scheduler_invariants import SchedulerInvariantError
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.request import Request, RequestStatus
from tests.engine.checked_scheduler import CheckedScheduler

BLOCK = 4


def make_scheduler(num_blocks=64, budget=32, max_running=8, specs=None, max_model_len=1000, prefix=True):
    plan = plan_groups(specs or [FullAttentionSpec()] * 2)
    kv = KVCacheManager(plan, num_blocks, BLOCK, prefix)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_running=max_running)
    return CheckedScheduler(config, kv, BLOCK, max_model_len), kv


def make_request(request_id, num_prompt, max_tokens=4, first_token=1, **sampling):
    prompt = [first_token + i for i in range(num_prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **sampling), (0,), 0.0)


def answer(step: SchedulerOutput, token_id=7) -> list[SampledToken]:
    return [SampledToken(c.request_id, token_id, 0.0) for c in step.chunks if c.sample]


def run_step(scheduler, kv, token_id=7):
    step = scheduler.schedule()
    changed = scheduler.update(step, answer(step, token_id))
    kv.check_invariants()
    return step, changed


def test_prompt_longer_than_budget_is_prefilled_in_chunks():
    scheduler, kv = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 20))
    sizes = []
    for _ in range(3):
        step, _ = run_step(scheduler, kv)
        sizes.append([(c.start_position, c.num_tokens, c.sample) for c in step.chunks])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert scheduler.requests["a"].output_token_ids == [7]


def test_step_never_exceeds_token_budget_or_running_cap():
    scheduler, kv = make_scheduler(budget=10, max_running=3)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 6))
    for _ in range(12):
        step, _ = run_step(scheduler, kv)
        assert step.num_batched_tokens <= 10
        assert scheduler.num_running <= 3


def test_decode_requests_are_batched_with_one_token_each():
    scheduler, kv = make_scheduler(budget=64)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 5))
    run_step(scheduler, kv)  # all four prefills fit in one step
    step, changed = run_step(scheduler, kv)
    assert [c.num_tokens for c in step.chunks] == [1, 1, 1, 1]
    assert len(changed) == 4


def test_request_finishes_at_max_tokens_and_frees_blocks():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    for _ in range(3):
        run_step(scheduler, kv)
    request_finished = not scheduler.has_work()
    assert request_finished
    assert kv.num_free_blocks == 63  # everything but the null block is free or cached


def test_eos_stops_unless_ignored():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    scheduler.add_request(make_request("b", 3, max_tokens=2, ignore_eos=True))
    a = scheduler.requests["a"]
    run_step(scheduler, kv, token_id=0)  # 0 is EOS
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.STOP
    run_step(scheduler, kv, token_id=0)
    assert not scheduler.has_work()


def test_pool_exhaustion_preempts_latest_request_and_it_recomputes():
    # One group; each request computes 7 + 5 = 12 tokens = 3 blocks at its end.
    # 5 usable blocks hold both prompts (2 blocks each) but not both at 3 blocks.
    scheduler, kv = make_scheduler(num_blocks=6, budget=64)
    for name in ("first", "second"):
        scheduler.add_request(make_request(name, 7, max_tokens=6))
    run_step(scheduler, kv)
    preempted = []
    for _ in range(12):
        step, _ = run_step(scheduler, kv)
        preempted += step.preempted_request_ids
        if not scheduler.has_work():
            break
    assert preempted and preempted[0] == "second"
    assert not scheduler.has_work()


def test_prefix_hit_skips_cached_prompt_blocks():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 13, max_tokens=1))
    run_step(scheduler, kv)
    scheduler.add_request(make_request("b", 13, max_tokens=1))
    step, _ = run_step(scheduler, kv)
    (chunk,) = step.chunks
    assert chunk.start_position == 12  # 3 full blocks of 4 reused, last token computed
    assert chunk.num_tokens == 1


def test_sliding_window_group_holds_only_live_window():
    specs = [SlidingWindowSpec(8), FullAttentionSpec()]
    scheduler, kv = make_scheduler(specs=specs, budget=16, num_blocks=200)
    scheduler.add_request(make_request("a", 64, max_tokens=2))
    while scheduler.has_work():
        run_step(scheduler, kv)
        request = scheduler.requests.get("a")
        if request is None:
            break
        full_group, sliding_group = 0, 1  # plan_groups puts full attention first
        # The sliding group keeps the window plus the chunk being computed; the
        # full group keeps every block written so far.
        assert kv.num_blocks_held("a", sliding_group) <= -(-8 // BLOCK) + 1 + 16 // BLOCK
        assert kv.num_blocks_held("a", full_group) == -(-request.num_computed_tokens // BLOCK)
        if request.num_computed_tokens >= 64:
            assert 2 * kv.num_blocks_held("a", sliding_group) < kv.num_blocks_held("a", full_group)


def test_abort_frees_blocks_and_removes_request():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 9, max_tokens=50))
    run_step(scheduler, kv)
    assert scheduler.finish("a", FinishReason.ABORT) is not None
    kv.check_invariants()
    assert not scheduler.has_work()
    assert scheduler.finish("a", FinishReason.ABORT) is None


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_every_prompt_token_is_computed_exactly_once(budget):
    scheduler, kv = make_scheduler(budget=budget, prefix=False)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 11, max_tokens=3, first_token=100 * (i + 1)))
    computed: dict[str, list[int]] = {}
    while scheduler.has_work():
        step, _ = run_step(scheduler, kv)
        for chunk in step.chunks:
            computed.setdefault(chunk.request_id, []).extend(range(chunk.start_position, chunk.end_position))
    for positions in computed.values():
        assert positions == list(range(len(positions)))
        assert len(positions) == 11 + 2  # prompt + every sampled token but the last


def test_check_invariants_names_each_broken_rule():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    run_step(scheduler, kv)
    scheduler.check_invariants()  # a healthy state passes
    scheduler.waiting.append(scheduler.running[0])  # "a" now sits in two queues, with blocks, as RUNNING
    with pytest.raises(SchedulerInvariantError) as raised:
        scheduler.check_invariants()
    message = str(raised.value)
    assert "more than one queue" in message and "waiting requests that hold blocks: ['a']" in message
    assert "queued as waiting with another status: ['a']" in message
