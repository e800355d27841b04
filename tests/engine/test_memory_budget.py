"""KV pool sizing: which setting wins, the worst-case steps the workspace is measured on,
and on CUDA a pool sized from free memory that leaves the largest step room to run."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.runner.memory_budget import (
    DEFAULT_HOST_KV_MEMORY_BYTES, StepLimits, pool_num_blocks, run_worst_case_steps, worst_case_steps)
from pdserve.kv.specs import plan_groups
from pdserve.models.loader import load_model
from tests.devices import cuda_available
from tests.tiny_models import make_tiny_gemma3

LIMITS = StepLimits(max_model_len=200, max_num_batched_tokens=48, max_num_running=5, block_size=4, num_groups=3)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_gemma3(directory)
    return directory


def test_worst_case_steps_are_the_longest_chunk_at_the_longest_context_and_the_fullest_decode_batch():
    prefill, decode = worst_case_steps(LIMITS)
    [chunk] = prefill.chunks
    assert (chunk.start_position, chunk.end_position) == (200 - 48, 200)
    assert len(decode.chunks) == 5 and all(c.start_position == 199 and c.num_tokens == 1 for c in decode.chunks)
    for c in [*prefill.chunks, *decode.chunks]:
        assert len(c.block_ids) == 3 and all(len(table) * 4 >= 200 for table in c.block_ids)
        assert c.sample and c.sampling.top_k and c.sampling.top_p < 1 and c.sampling.logprobs
    budget_bound = StepLimits(200, 3, 64, 4, 1)
    assert len(worst_case_steps(budget_bound)[1].chunks) == 3  # never more rows than tokens in a step


def test_worst_case_steps_run_through_the_runner_and_never_touch_the_null_page(device, gemma_dir):
    loaded = load_model(gemma_dir, torch.float32, torch.device(device))
    plan = plan_groups(loaded.model.spec.layer_specs)
    limits = StepLimits(200, 48, 5, 4, len(plan.groups))
    runner = run_worst_case_steps(loaded.model, plan, limits, torch.float32, torch.device(device))
    assert runner.pool.shape[0] == 2
    assert not runner.pool[0].any() and runner.pool[1].any()


def test_num_blocks_wins_then_kv_memory_then_the_device_default(gemma_dir):
    loaded = load_model(gemma_dir, torch.float32, torch.device("cpu"))
    plan = plan_groups(loaded.model.spec.layer_specs)
    page_bytes = 4096

    def blocks(**cache) -> int:
        config = WorkerConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(**cache))
        return pool_num_blocks(config, loaded.model, plan, page_bytes, LIMITS, torch.float32, torch.device("cpu"), None)

    assert blocks(num_blocks=10, kv_memory_bytes=1 << 30) == 10
    assert blocks(kv_memory_bytes=3 << 20) == (3 << 20) // page_bytes
    assert blocks() == DEFAULT_HOST_KV_MEMORY_BYTES // page_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_cuda_pool_sized_from_free_memory_keeps_the_share_and_room_for_the_largest_step(gemma_dir):
    from pdserve.app.engine_factory import build_engine
    from pdserve.metrics import Metrics

    torch.cuda.empty_cache()
    free_at_start, total = torch.cuda.mem_get_info()
    utilization = min(0.3, 0.8 * free_at_start / total)
    config = WorkerConfig(model=ModelConfig(path=gemma_dir, device="cuda", dtype="bfloat16", max_model_len=512),
                          cache=CacheConfig(block_size=16, gpu_memory_utilization=utilization),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_running=32))
    built = build_engine(config, Metrics())
    try:
        pool_bytes = built.layout.pool_bytes
        assert pool_bytes > 0.5 * utilization * total  # a tiny model: nearly all of the share is pool
        assert total - torch.cuda.mem_get_info()[0] - (total - free_at_start) <= utilization * total
        limits = StepLimits(512, 512, 32, 16, len(built.plan.groups))
        run_worst_case_steps(built.loaded.model, built.plan, limits, torch.bfloat16, torch.device("cuda"))
    finally:
        built.close()
