"""EngineStats' load record: the queue and pool gauges, pdserve's and the GIE protocol's, from one
snapshot of a real scheduler and KV manager (two KV groups sharing one pool)."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.stats import EngineStats
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from pdserve.metrics import Metrics
from tests.engine.test_scheduler import BLOCK, make_request, make_scheduler, run_step


def test_pool_shape_is_exported_before_the_first_loop_turn():
    _, kv = make_scheduler(num_blocks=64)
    metrics = Metrics()
    EngineStats(metrics, kv)
    value = metrics.registry.get_sample_value
    assert value("pdserve_kv_pool_blocks") == 63  # the null block is no capacity
    assert value("vllm:cache_config_info", {"block_size": str(BLOCK), "num_gpu_blocks": "63"}) == 1
    assert value("vllm:kv_cache_usage_perc") == 0


def test_load_counts_requests_waiting_for_kv_as_waiting_and_the_whole_pool_as_usage():
    scheduler, kv = make_scheduler(num_blocks=64, max_running=1,
                                   specs=[FullAttentionSpec(), SlidingWindowSpec(window_tokens=8)])
    metrics = Metrics()
    stats = EngineStats(metrics, kv)
    scheduler.add_request(make_request("a", 22))
    scheduler.add_request(make_request("b", 5))
    run_step(scheduler, kv)  # "a" runs (blocks in both groups), "b" waits for the one running slot
    # Two more whose KV pull is in flight: the protocol's queue and ours count them as waiting.
    stats.record_load(SimpleNamespace(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                                      num_waiting_for_kv=2))
    value = metrics.registry.get_sample_value
    assert value("vllm:num_requests_running") == value("pdserve_scheduler_running_requests") == 1
    assert value("vllm:num_requests_waiting") == value("pdserve_scheduler_waiting_requests") == 1 + 2
    in_use = kv.num_blocks_in_use_by_group()
    assert all(in_use) and len(in_use) == 2
    assert value("vllm:kv_cache_usage_perc") == sum(in_use) / 63
    assert value("vllm:kv_cache_usage_perc") == sum(
        value("pdserve_kv_usage_ratio", {"group": str(group)}) for group in range(2))
