"""Sizes a worker's KV pool: `--num-blocks`, else `--kv-memory`, else on CUDA the GPU's
free memory after the weights less the measured workspace of the largest step
(the rule is `pdserve/kv/sizing.py`), else 1 GiB of host memory.

Invariant: the workspace is measured by running, through the real runner, the
largest prefill step and the largest decode step the configuration can
schedule, before the pool exists, so whatever they need stays free beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.api.config import WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.runner.model_runner import ModelRunner
from pdserve.engine.schedule_types import ScheduledChunk, SchedulerOutput
from pdserve.kv.layout import KVPoolLayout, num_blocks_for_budget
from pdserve.kv.sizing import DeviceMemory, kv_pool_budget
from pdserve.kv.specs import KVGroupPlan
from pdserve.models.base import CausalLM

logger = logging.getLogger(__name__)

DEFAULT_HOST_KV_MEMORY_BYTES = 1 << 30
_SCRATCH_BLOCK = 1  # every table entry of the worst-case steps: two pages hold any context
# The sampler's costliest path: sort for top-k/top-p, logsumexp for logprobs.
_WORST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=True)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest steps a configuration can schedule."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_running: int
    block_size: int
    num_groups: int
    state_group_ids: tuple[int, ...] = ()  # groups whose table is one live state page


def worst_case_steps(limits: StepLimits) -> list[SchedulerOutput]:
    """The largest prefill step (one chunk of the whole token budget ending at the longest
    context: the widest gather and mask) and the largest decode step (as many rows as can
    run, each at the last position of the longest context)."""
    context = limits.max_model_len
    table = [_SCRATCH_BLOCK] * -(-context // limits.block_size)
    tables = tuple([_SCRATCH_BLOCK] if group_id in limits.state_group_ids else list(table)
                   for group_id in range(limits.num_groups))

    def chunk(name: str, start: int, num_tokens: int) -> ScheduledChunk:
        # Token 1, not 0: 0 is often padding, whose zero embedding would write zero K/V.
        return ScheduledChunk(name, [1] * num_tokens, start, tables, sample=True, sampling=_WORST_SAMPLING,
                              num_prompt_tokens=context)

    num_prefill = min(limits.max_num_batched_tokens, context)
    num_rows = min(limits.max_num_running, limits.max_num_batched_tokens)
    prefill = SchedulerOutput([chunk("prefill", context - num_prefill, num_prefill)])
    decode = SchedulerOutput([chunk(f"decode-{row}", context - 1, 1) for row in range(num_rows)])
    return [prefill, decode]


def run_worst_case_steps(model: CausalLM, plan: KVGroupPlan, limits: StepLimits, dtype: torch.dtype,
                         device: torch.device) -> ModelRunner:
    """Run `worst_case_steps` through a runner over a two-block scratch pool; returns the runner."""
    spec = model.spec
    scratch = KVPoolLayout.for_plan(plan, 2, limits.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    runner = ModelRunner(model, plan, scratch, device)
    for step in worst_case_steps(limits):
        runner.execute(step)
        runner.synchronize()
    return runner


def measure_step_workspace(model: CausalLM, plan: KVGroupPlan, limits: StepLimits, dtype: torch.dtype,
                           device: torch.device) -> int:
    """Peak device memory the worst-case steps take beyond what is held now: the caching
    allocator's peak reservation plus whatever memory outside it they kept (library handles)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    reserved_before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_worst_case_steps(model, plan, limits, dtype, device)
    peak_reserved = torch.cuda.max_memory_reserved(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    reserved_after = torch.cuda.memory_reserved(device)
    outside_allocator = max(0, (free_before - free_after) - (reserved_after - reserved_before))
    torch.cuda.empty_cache()  # the scratch pool and activations go back before the pool is sized
    return peak_reserved - reserved_before + outside_allocator


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Free memory on a CUDA device now (None elsewhere); measure it before loading weights."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def pool_num_blocks(config: WorkerConfig, model: CausalLM, plan: KVGroupPlan, page_bytes: int, limits: StepLimits,
                    dtype: torch.dtype, device: torch.device, free_before_load: Optional[int]) -> int:
    """Number of pages of the pool (the null block included), by the precedence above.
    `free_before_load` None on CUDA (weights loaded by the caller earlier) counts the
    weights as someone else's memory: the pool still fits, the share is not enforced."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_memory_bytes is not None:
        return num_blocks_for_budget(cache.kv_memory_bytes, page_bytes)
    if device.type != "cuda":
        return num_blocks_for_budget(DEFAULT_HOST_KV_MEMORY_BYTES, page_bytes)
    workspace = measure_step_workspace(model, plan, limits, dtype, device)
    free_after, total = torch.cuda.mem_get_info(device)
    memory = DeviceMemory(total, free_before_load if free_before_load is not None else free_after, free_after,
                          workspace)
    budget = kv_pool_budget(memory, cache.gpu_memory_utilization)
    logger.info("KV pool sized from GPU memory: total %.2f GiB, free after weights %.2f GiB, step workspace "
                "%.2f GiB, utilization %.2f -> pool %.2f GiB", total / 2**30, free_after / 2**30,
                workspace / 2**30, cache.gpu_memory_utilization, budget.pool_bytes / 2**30)
    if budget.limited_by_free_memory:
        logger.warning("another process holds part of this worker's GPU share: the KV pool is %.2f GiB instead of "
                       "%.2f GiB", budget.pool_bytes / 2**30, budget.share_bytes / 2**30)
    return num_blocks_for_budget(budget.pool_bytes, page_bytes)
