"""Assembles a worker's engine from its config: device, model, pool, scheduler.

Invariant: the context limit served never exceeds what the pool can hold for
one request, so a lone request can always run to completion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.config import WorkerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.decode_role import DecodeRole
from pdserve.engine.decode_step import should_compile
from pdserve.engine.kv_roles import KVRoleParts, build_kv_role
from pdserve.engine.loop import EngineLoop
from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats
from pdserve.kv.layout import KVPoolLayout, num_blocks_for_budget, page_bytes_for
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan, plan_groups
from pdserve.metrics import Metrics
from pdserve.models.loader import LoadedModel, load_model, resolve_quantization
from pdserve.transfer.handshake import AgentInfo

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def max_tokens_in_pool(plan: KVGroupPlan, num_blocks: int, block_size: int) -> int:
    """Longest sequence whose blocks fit in the pool's usable blocks (all groups together)."""
    usable = num_blocks - 1  # block 0 is the null block

    def blocks_needed(num_tokens: int) -> int:
        per_full = -(-num_tokens // block_size)
        total = 0
        for group in plan.groups:
            if isinstance(group.spec, FullAttentionSpec):
                total += per_full
            else:
                total += min(per_full, -(-group.spec.window_tokens // block_size) + 1)
        return total

    low, high = 0, usable * block_size
    while low < high:  # largest n with blocks_needed(n) <= usable
        mid = (low + high + 1) // 2
        low, high = (mid, high) if blocks_needed(mid) <= usable else (low, mid - 1)
    return low


@dataclass
class BuiltEngine:
    engine: AsyncEngine
    loaded: LoadedModel
    plan: KVGroupPlan
    layout: KVPoolLayout
    kv_manager: KVCacheManager
    runner: ModelRunner
    kv_role: Optional[KVRoleParts] = None  # None for a colocated worker

    @property
    def agent_info(self) -> Optional[AgentInfo]:
        return None if self.kv_role is None else self.kv_role.agent_info

    def close(self) -> None:
        """Stop the engine thread, then release the transport (never the other way round)."""
        self.engine.shutdown()
        if self.kv_role is not None:
            self.kv_role.transport.close()


def build_engine(config: WorkerConfig, metrics: Metrics, loaded: LoadedModel | None = None) -> BuiltEngine:
    """`loaded` lets tests and benchmarks share one set of weights between engines;
    it must have been loaded with the device and dtype `config` implies."""
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    if config.model.num_threads is not None:
        torch.set_num_threads(config.model.num_threads)
    quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
    loaded = loaded or load_model(config.model.path, dtype, device, quantization)
    spec = loaded.model.spec
    plan = plan_groups(spec.layer_specs)
    cache = config.cache
    num_blocks = cache.num_blocks or num_blocks_for_budget(
        cache.kv_memory_bytes,
        page_bytes_for(plan.group_size, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype),
    )
    layout = KVPoolLayout(num_blocks, plan.group_size, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    max_model_len = min(config.model.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    pool_limit = max_tokens_in_pool(plan, num_blocks, cache.block_size)
    if pool_limit < max_model_len:
        logger.warning("KV pool holds at most %d tokens per request; capping the context from %d", pool_limit, max_model_len)
        max_model_len = pool_limit
    kv_manager = KVCacheManager(plan, num_blocks, cache.block_size, cache.enable_prefix_caching)
    compile_decode = should_compile(config.model.compile, device, dtype)
    runner = ModelRunner(loaded.model, plan, layout, device, compile_decode=compile_decode)
    runner.warm_up(config.scheduler.max_num_running)
    model_name = config.model.served_name or loaded.name
    kv_role = None
    if config.role != "colocated":
        kv_role = build_kv_role(config, metrics, kv_manager, plan, layout, runner.pool, spec, model_name, str(dtype))
    role = kv_role.role if kv_role is not None else None
    stats = EngineStats(metrics, kv_manager)
    scheduler = Scheduler(config.scheduler, kv_manager, cache.block_size, max_model_len,
                          on_preempt=stats.record_preemption, role_hooks=role)
    if isinstance(role, DecodeRole):
        role.bind(scheduler)
    loop = EngineLoop(scheduler, runner, OutputProcessor(loaded.tokenizer), loaded.tokenizer.eos_token_ids, stats, role)
    max_in_flight = config.scheduler.max_num_running + config.scheduler.max_num_waiting
    engine = AsyncEngine(loop, model_name, max_model_len, loaded.tokenizer, max_in_flight,
                         frontend=kv_role.frontend if kv_role is not None else None)
    logger.info(
        "engine ready: role=%s model=%s device=%s dtype=%s groups=%d group_size=%d blocks=%d block_size=%d page_bytes=%d max_model_len=%d",
        config.role, engine.model_name, device, dtype, len(plan.groups), plan.group_size, num_blocks, cache.block_size,
        layout.page_bytes, max_model_len,
    )
    return BuiltEngine(engine, loaded, plan, layout, kv_manager, runner, kv_role)
