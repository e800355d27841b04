"""The scheduler with an offload tier: a prefix hit from the tier waits in the loading state, then
computes only the rest; a failed load recomputes everything; no tier means today's behaviour."""

from __future__ import annotations

from pdserve.api.config import SchedulerConfig
from pdserve.api.sampling import FinishReason
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.request import RequestStatus
from tests.engine.checked_scheduler import CheckedScheduler
from tests.engine.test_scheduler import BLOCK, make_request, run_step
from tests.kv.test_offload import FakePages


def make_offload_scheduler(num_blocks=9, num_slots=32):
    plan = plan_groups([FullAttentionSpec()])
    pages = FakePages(num_blocks, num_slots)
    kv = KVCacheManager(plan, num_blocks, BLOCK, offload=OffloadTier(pages, [0]))
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_running=4)
    return CheckedScheduler(config, kv, BLOCK, 1000), kv, pages


def finish_alone(scheduler, kv, request):
    scheduler.add_request(request)
    steps = []
    while scheduler.has_work():
        steps.append(run_step(scheduler, kv)[0])
    return steps


def test_a_prefix_in_the_tier_is_loaded_while_the_request_waits_then_only_the_rest_is_computed():
    scheduler, kv, _ = make_offload_scheduler()
    finish_alone(scheduler, kv, make_request("a", 17, max_tokens=1))
    finish_alone(scheduler, kv, make_request("b", 32, max_tokens=1, first_token=500))  # evicts a's pages
    scheduler.add_request(make_request("again", 17, max_tokens=1))
    step, _ = run_step(scheduler, kv)
    assert step.chunks == [] and scheduler.num_waiting_for_kv == 1
    assert scheduler.requests["again"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    step, _ = run_step(scheduler, kv)
    (chunk,) = step.chunks
    assert (chunk.start_position, chunk.num_tokens) == (16, 1)
    assert not scheduler.has_work() and scheduler.num_waiting_for_kv == 0
    assert kv.prefix_stats.num_offload_hit_tokens == 16


def test_a_failed_tier_load_recomputes_the_whole_prompt():
    scheduler, kv, pages = make_offload_scheduler()
    finish_alone(scheduler, kv, make_request("a", 17, max_tokens=1))
    finish_alone(scheduler, kv, make_request("b", 32, max_tokens=1, first_token=500))
    pages.fail_reads = True
    steps = finish_alone(scheduler, kv, make_request("again", 17, max_tokens=1))
    computed = [(c.start_position, c.num_tokens) for step in steps for c in step.chunks]
    assert computed == [(0, 17)]
    assert kv.offload.stats.num_failed_loads == 1


def test_an_abort_while_loading_frees_the_blocks():
    scheduler, kv, _ = make_offload_scheduler()
    finish_alone(scheduler, kv, make_request("a", 17, max_tokens=1))
    finish_alone(scheduler, kv, make_request("b", 32, max_tokens=1, first_token=500))
    scheduler.add_request(make_request("again", 17, max_tokens=1))
    run_step(scheduler, kv)
    assert scheduler.num_waiting_for_kv == 1
    scheduler.finish("again", FinishReason.ABORT)
    run_step(scheduler, kv)
    assert not scheduler.has_work() and kv.pool.num_in_use == 0
    kv.check_invariants()
