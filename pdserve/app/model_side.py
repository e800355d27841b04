"""The model side of a worker's engine: device, ranks, weights, pool geometry and the runner. A
recurrent-state model runs any role at any TP size its heads divide (the model refuses the others at
load); P/D between TP sizes moves each rank's heads' share of the state (transfer/state_ranges.py).

Invariant: the context limit served never exceeds what the pool can hold for one request, so a
lone request can always run to completion (`max_tokens_in_pool`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.api.config import BATCH_ACTIVATION_DIGITS, WorkerConfig
from pdserve.app.kv_cache_side import num_offload_slots, num_offload_staging_rows
from pdserve.app.ranks import LocalRanks
from pdserve.kv.layout import KVPoolLayout, plan_for_model, plan_page_bytes
from pdserve.kv.specs import KVGroupPlan
from pdserve.models.base import ModelSpec
from pdserve.models.loader import LoadedModel, load_model, resolve_quantization
from pdserve.models.registry import TensorParallelRank
from pdserve.parallel.channel import LeaderChannel, RankSetup
from pdserve.parallel.ranks import RankGroup
from pdserve.runner.decode_step import should_compile
from pdserve.runner.devices import pick_device, pick_dtype, pick_kv_dtype, rank_device, rank_threads
from pdserve.runner.grammar_matchers import GrammarMatchers, GrammarTokenizer
from pdserve.runner.memory_budget import StepLimits, free_device_bytes, pool_num_blocks
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.tensor_parallel import LeaderRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSide:
    """What the KV and P/D sides are built over."""

    device: torch.device
    dtype: torch.dtype  # the weights' and activations'
    loaded: LoadedModel
    plan: KVGroupPlan
    layout: KVPoolLayout
    max_model_len: int
    runner: ModelRunner
    grammar_tokenizer: GrammarTokenizer
    channel: Optional[LeaderChannel]  # rank 0's messages to its other ranks; None with one rank
    follower_transports: list  # the other ranks' transport descriptors (empty with one rank)
    shared_pool: bool  # the pool is shared memory an isolated NIXL agent process maps

    @property
    def kv_dtype(self) -> torch.dtype:
        """The pool's element type (--kv-cache-dtype)."""
        return self.layout.dtype

    @property
    def spec(self) -> ModelSpec:
        return self.loaded.model.spec


def max_tokens_in_pool(plan: KVGroupPlan, num_blocks: int, block_size: int) -> int:
    """Longest sequence whose blocks fit in the pool's usable blocks (all groups together)."""
    usable = num_blocks - 1  # block 0 is the null block

    def blocks_needed(num_tokens: int) -> int:
        return sum(group.spec.max_blocks_held(num_tokens, block_size) for group in plan.groups)

    low, high = 0, usable * block_size
    while low < high:  # largest n with blocks_needed(n) <= usable
        mid = (low + high + 1) // 2
        low, high = (mid, high) if blocks_needed(mid) <= usable else (low, mid - 1)
    return low


def _configured_context(config: WorkerConfig, spec: ModelSpec) -> int:
    return min(config.model.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def _context_limit(config: WorkerConfig, spec: ModelSpec, plan: KVGroupPlan, num_blocks: int) -> int:
    max_model_len = _configured_context(config, spec)
    pool_limit = max_tokens_in_pool(plan, num_blocks, config.cache.block_size)
    if pool_limit < max_model_len:
        logger.warning("KV pool holds at most %d tokens per request; capping the context from %d", pool_limit, max_model_len)
        max_model_len = pool_limit
    return max_model_len


def _meet_ranks(config: WorkerConfig, device: torch.device, local_ranks: Optional[LocalRanks]) -> Optional[RankGroup]:
    """Rank 0's group when the worker is tensor-parallel (waits for every rank to join), else None.
    `local_ranks`: the ranks rank 0 started, with the socket already listening on the rendezvous port
    (the group's store takes it); the wait ends as soon as one of them exits."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return None
    if parallel.tp_master_port is None:
        raise ValueError("a tensor-parallel worker needs its rendezvous port (--tp-master-port)")
    ranks = RankGroup(0, parallel.tensor_parallel_size, parallel.tp_master_addr, parallel.tp_master_port,
                      parallel.tp_timeout_s, device, parallel.tp_join_timeout_s,
                      listen_fd=local_ranks.rendezvous_fd if local_ranks is not None else None,
                      internal_token=config.server.internal_token,
                      ranks_lost=local_ranks.lost if local_ranks is not None else None)
    ranks.share_host_memory(parallel.tp_shared_memory, device, native=parallel.tp_native_all_reduce)
    return ranks


def _set_threads(config: WorkerConfig, ranks: Optional[RankGroup]) -> None:
    if ranks is not None:
        torch.set_num_threads(rank_threads(config.model.num_threads, config.parallel.tensor_parallel_size))
    elif config.model.num_threads is not None:
        torch.set_num_threads(config.model.num_threads)


def _pool_layout(config: WorkerConfig, loaded: LoadedModel, plan: KVGroupPlan, dtype: torch.dtype,
                 device: torch.device, free_before_load: Optional[int]) -> KVPoolLayout:
    spec, cache = loaded.model.spec, config.cache
    limits = StepLimits(_configured_context(config, spec), config.scheduler.max_num_batched_tokens,
                        config.scheduler.max_num_running, cache.block_size, len(plan.groups),
                        tuple(plan.state_group_ids))
    page_bytes = plan_page_bytes(plan, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    num_blocks = pool_num_blocks(config, loaded.model, plan, page_bytes, limits, dtype, device, free_before_load)
    return KVPoolLayout.for_plan(plan, num_blocks, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype)


def _rank_setup(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout) -> RankSetup:
    """What every other rank needs to build its slice of the pool, transport and tier."""
    num_slots = num_offload_slots(config, layout)
    offload_dir = config.cache.kv_offload_dir if num_slots else None
    return RankSetup(layout.num_blocks, with_transport=config.role != "colocated", num_offload_slots=num_slots,
                     offload_dir=offload_dir,
                     num_offload_staging_rows=num_offload_staging_rows(config, plan, layout) if offload_dir is not None else 0)


def build_model_side(config: WorkerConfig, loaded: Optional[LoadedModel] = None,
                     local_ranks: Optional[LocalRanks] = None) -> ModelSide:
    """Meet the other ranks, load the weights (unless `loaded`, made for the same device and dtype),
    size the pool and build the warmed-up runner over it."""
    device = rank_device(pick_device(config.model.device), 0)
    dtype = pick_dtype(config.model.dtype, device)
    ranks = _meet_ranks(config, device, local_ranks)
    _set_threads(config, ranks)
    quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
    free_before_load = None if loaded is not None else free_device_bytes(device)
    shard = TensorParallelRank(0, ranks.size, ranks.all_reduce, ranks.all_gather) if ranks is not None else None
    loaded = loaded or load_model(config.model.path, dtype, device, quantization, parallel=shard)
    spec = loaded.model.spec
    kv_dtype = pick_kv_dtype(config.cache.kv_cache_dtype, config.model.dtype, loaded.model, dtype,
                             device)
    plan = plan_for_model(spec.layer_specs, config.cache.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype)
    if plan.geometry is not None:
        logger.info("recurrent-state pages: %s", plan.geometry.describe())
    layout = _pool_layout(config, loaded, plan, kv_dtype, device, free_before_load)
    grammar_tokenizer = GrammarTokenizer(loaded.tokenizer, spec.vocab_size)
    grammar = GrammarMatchers(grammar_tokenizer)
    shared_pool = config.role != "colocated" and config.transfer.isolates_agent(device.type)
    channel, followers = None, []
    if ranks is not None:
        ranks.broadcast(_rank_setup(config, plan, layout))
        channel = LeaderChannel(ranks)
        runner: ModelRunner = LeaderRunner(loaded.model, plan, layout, device, grammar=grammar, channel=channel,
                                           shared_pool=shared_pool, one_row_tiles=config.keeps_one_row_tiles)
        followers = (ranks.gather(None) or [None])[1:]
    else:
        # A compiled step would need its collectives traced; tensor-parallel ranks run eagerly.
        runner = ModelRunner(loaded.model, plan, layout, device, grammar=grammar, shared_pool=shared_pool,
                             compile_decode=should_compile(config.model.compile, device, dtype),
                             batch_activation_digits=BATCH_ACTIVATION_DIGITS[config.model.batch_activation_bits],
                             one_row_tiles=config.keeps_one_row_tiles)
    runner.warm_up(config.scheduler.max_num_running)
    return ModelSide(device, dtype, loaded, plan, layout, _context_limit(config, spec, plan, layout.num_blocks),
                     runner, grammar_tokenizer, channel, followers, shared_pool)
