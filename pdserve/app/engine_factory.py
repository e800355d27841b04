"""Assembles a worker's engine from its config: device, model, pool, scheduler.

Invariant: the context limit served never exceeds what the pool can hold for
one request, so a lone request can always run to completion.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import httpx
import torch

from pdserve.api.config import WorkerConfig
from pdserve.api.kv_transfer import AgentInfo
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.core_share import CoreShare, open_core_share
from pdserve.runner.decode_step import should_compile
from pdserve.engine.emitter import OutputEmitter
from pdserve.runner.grammar_matchers import GrammarMatchers, GrammarTokenizer
from pdserve.engine.loop import EngineLoop
from pdserve.runner.offload_ranks import RankMirror
from pdserve.runner.memory_budget import StepLimits, free_device_bytes, pool_num_blocks
from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.runner.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats
from pdserve.runner.devices import pick_device, pick_dtype, rank_device, rank_threads
from pdserve.runner.tensor_parallel import LeaderRunner
from pdserve.kv.events import KVEventRecorder
from pdserve.kv.layout import KVPoolLayout, page_bytes_for
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_host import HostPageStore
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan, plan_groups
from pdserve.metrics import Metrics
from pdserve.models.base import ModelSpec
from pdserve.models.loader import LoadedModel, load_model, resolve_quantization
from pdserve.models.registry import TensorParallelRank
from pdserve.parallel.channel import LeaderChannel, RankSetup
from pdserve.parallel.ranks import RankGroup
from pdserve.pd.handshake import compatibility_document, compatibility_hash
from pdserve.pd.prefill import PrefillConnector
from pdserve.pd.wiring import (
    KVSide, PoolDescription, TransportFactory, build_admission, build_kv_side, configured_transport, nixl_transport)
from pdserve.transfer.ranked_transport import RankedTransport

logger = logging.getLogger(__name__)
OFFLOAD_STAGING_BYTES = 64 << 20  # host memory a file tier may hold in pages waiting for their write


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


@dataclass
class BuiltEngine:
    engine: AsyncEngine
    loaded: LoadedModel
    plan: KVGroupPlan
    layout: KVPoolLayout
    kv_manager: KVCacheManager
    runner: ModelRunner
    kv_side: KVSide
    kv_events: KVEventRecorder
    epoch: str  # fresh at every start: the P/D handshake's epoch, or its own for a colocated worker

    @property
    def agent_info(self) -> Optional[AgentInfo]:
        return self.kv_side.agent_info

    def release_pinned(self, request_id: str) -> None:
        """Prefill workers: free a pinned prefill's blocks now (on the engine thread, at its next turn)."""
        connector = self.kv_side.connector
        if isinstance(connector, PrefillConnector):
            self.engine.engine_loop.call_soon(functools.partial(connector.release_early, request_id))

    def close(self) -> None:
        """Stop the engine thread, then release the transport, the offload tier and the other ranks
        (never the other way round)."""
        self.engine.shutdown()
        self.kv_side.close()
        if self.kv_manager.offload is not None:
            self.kv_manager.offload.close()
        self.runner.close()


def _fingerprint(model_name: str, spec: ModelSpec) -> str:
    """What must be equal for two workers to share KV (whatever their TP sizes)."""
    return f"{model_name}|{spec.architecture}|{spec.num_layers}|{spec.hidden_size}|{spec.vocab_size}"


def _pool_description(model_name: str, spec: ModelSpec, plan: KVGroupPlan, layout: KVPoolLayout,
                      dtype: torch.dtype) -> PoolDescription:
    # The model's KV heads, not this rank's share: workers of any TP sizes may pair.
    document = compatibility_document(_fingerprint(model_name, spec), str(dtype), spec.total_kv_heads,
                                      spec.head_dim, plan)
    return PoolDescription(plan, layout.num_blocks, layout.block_size, layout.page_bytes,
                           compatibility_hash(document), document)


def _configured_context(config: WorkerConfig, spec: ModelSpec) -> int:
    return min(config.model.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def _context_limit(config: WorkerConfig, spec: ModelSpec, plan: KVGroupPlan, num_blocks: int) -> int:
    max_model_len = _configured_context(config, spec)
    pool_limit = max_tokens_in_pool(plan, num_blocks, config.cache.block_size)
    if pool_limit < max_model_len:
        logger.warning("KV pool holds at most %d tokens per request; capping the context from %d", pool_limit, max_model_len)
        max_model_len = pool_limit
    return max_model_len


def _num_offload_slots(config: WorkerConfig, layout: KVPoolLayout) -> int:
    """Pages the tier behind the pool holds (--kv-offload-bytes of this rank's pages), 0 without one."""
    cache = config.cache
    if cache.kv_offload_dir is not None and cache.kv_offload_bytes is None:
        raise ValueError("--kv-offload-dir needs --kv-offload-bytes (the tier's size)")
    if cache.kv_offload_bytes is None or not cache.enable_prefix_caching:
        return 0
    return cache.kv_offload_bytes // layout.page_bytes


def _num_offload_staging_rows(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout) -> int:
    """A file tier's staging rows: about one step's evictions (its token budget in blocks, per group),
    so a burst is written behind the step rather than skipped; at most OFFLOAD_STAGING_BYTES of them."""
    num_step_blocks = -(-config.scheduler.max_num_batched_tokens // config.cache.block_size) * len(plan.groups)
    return max(1, min(num_step_blocks, OFFLOAD_STAGING_BYTES // layout.page_bytes))


def _offload_tier(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout, pool: torch.Tensor,
                  events: KVEventRecorder, channel: Optional[LeaderChannel]) -> Optional[OffloadTier]:
    """The tier behind the pool (--kv-offload-bytes; in files with --kv-offload-dir), or None.
    File writes and reads run on the tier's one I/O thread; host-memory copies are a memcpy between steps.
    With tensor parallelism (`channel`) rank 0's copies are repeated by every rank on its slice
    (pdserve/runner/offload_ranks.py); rank 0's pages are in the directory itself, rank r's under rank-<r>/."""
    cache = config.cache
    if not _num_offload_slots(config, layout):
        return None
    full_group_ids = [g.group_id for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
    on_files = cache.kv_offload_dir is not None
    mirror = (RankMirror(channel, config.parallel.tensor_parallel_size - 1, others_answer=on_files)
              if channel is not None else None)
    ranks_note = " on every rank" if channel is not None else ""
    if on_files:
        store = FilePageStore(layout.canonical_view(pool), cache.kv_offload_bytes, cache.kv_offload_dir,
                              _num_offload_staging_rows(config, plan, layout))
        executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-offload")
        logger.info("KV offload tier: %s, %d pages of %d bytes, %d staging rows%s", store.path, store.num_slots,
                    store.page_bytes, store.num_staging_rows, ranks_note)
        return OffloadTier(store, full_group_ids, events, executor=executor, mirror=mirror)
    host = HostPageStore(layout.canonical_view(pool), cache.kv_offload_bytes)
    logger.info("KV offload tier: host memory, %d pages of %d bytes%s", host.num_slots, host.page_bytes, ranks_note)
    return OffloadTier(host, full_group_ids, events, mirror=mirror)


def _core_share(config: WorkerConfig, metrics: Metrics) -> CoreShare:
    """--core-ledger: this worker's threads follow the other worker's work (P and D on one host)."""
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--core-ledger is for single-rank workers (-tp 1)")
    narrow = config.model.num_threads or torch.get_num_threads()
    wide = config.model.num_threads_alone or len(os.sched_getaffinity(0))

    def set_threads(num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        metrics.engine.cpu_threads.set(num_threads)

    return open_core_share(config.model.core_ledger, config.role, narrow, max(narrow, wide), set_threads)


def _meet_ranks(config: WorkerConfig, device: torch.device, rendezvous_fd: Optional[int]) -> Optional[RankGroup]:
    """Rank 0's group when the worker is tensor-parallel (waits for every rank to join), else None.
    `rendezvous_fd`: a socket already listening on the rendezvous port, which the group's store takes."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return None
    if parallel.tp_master_port is None:
        raise ValueError("a tensor-parallel worker needs its rendezvous port (--tp-master-port)")
    return RankGroup(0, parallel.tensor_parallel_size, parallel.tp_master_addr, parallel.tp_master_port,
                     parallel.tp_timeout_s, device, parallel.tp_join_timeout_s, listen_fd=rendezvous_fd)


def _ranked(factory: TransportFactory, channel: Optional[LeaderChannel], followers: list,
            num_kv_heads: int, num_layer_slots: int) -> TransportFactory:
    """Rank 0's transport (every P/D worker's, TP=1 included): its own slice's, reading each head
    from the peer rank that holds it, and commanding the other ranks' agents too."""
    def make(pool_view, agent_name: str):  # type: ignore[no-untyped-def]
        return RankedTransport(factory(pool_view, agent_name), channel, followers, num_kv_heads, num_layer_slots)

    return make


def build_engine(config: WorkerConfig, metrics: Metrics, loaded: LoadedModel | None = None, *,
                 request_ids: Optional[RequestIdRegistry] = None,
                 transport_factory: TransportFactory = nixl_transport,
                 http_transport: Optional[httpx.AsyncBaseTransport] = None,
                 rendezvous_fd: Optional[int] = None) -> BuiltEngine:
    """`rendezvous_fd` is rank 0's listening socket of a tensor-parallel worker (app.ranks).
    `loaded` lets tests and benchmarks share one set of weights between engines;
    it must have been loaded with the device and dtype `config` implies. The
    transport factory and the handshake's HTTP transport let in-process tests
    replace NIXL and the network."""
    parallel = config.parallel
    device = rank_device(pick_device(config.model.device), 0)
    dtype = pick_dtype(config.model.dtype, device)
    ranks = _meet_ranks(config, device, rendezvous_fd)
    if ranks is not None:
        torch.set_num_threads(rank_threads(config.model.num_threads, parallel.tensor_parallel_size))
    elif config.model.num_threads is not None:
        torch.set_num_threads(config.model.num_threads)
    quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
    free_before_load = None if loaded is not None else free_device_bytes(device)
    shard = TensorParallelRank(0, ranks.size, ranks.all_reduce, ranks.all_gather) if ranks is not None else None
    loaded = loaded or load_model(config.model.path, dtype, device, quantization, parallel=shard)
    spec = loaded.model.spec
    plan = plan_groups(spec.layer_specs)
    cache = config.cache
    limits = StepLimits(_configured_context(config, spec), config.scheduler.max_num_batched_tokens,
                        config.scheduler.max_num_running, cache.block_size, len(plan.groups))
    page_bytes = page_bytes_for(plan.group_size, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    num_blocks = pool_num_blocks(config, loaded.model, plan, page_bytes, limits, dtype, device, free_before_load)
    layout = KVPoolLayout(num_blocks, plan.group_size, cache.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    max_model_len = _context_limit(config, spec, plan, num_blocks)
    kv_events = KVEventRecorder()
    grammar_tokenizer = GrammarTokenizer(loaded.tokenizer, spec.vocab_size)
    # A compiled step would need its collectives traced; tensor-parallel ranks run eagerly.
    compile_decode = should_compile(config.model.compile, device, dtype) and ranks is None
    grammar = GrammarMatchers(grammar_tokenizer)
    isolated_agent = config.role != "colocated" and config.transfer.isolates_agent(device.type)
    transport_factory = configured_transport(transport_factory, isolated_agent, metrics)
    if ranks is not None:
        num_offload_slots = _num_offload_slots(config, layout)
        offload_dir = cache.kv_offload_dir if num_offload_slots else None
        ranks.broadcast(RankSetup(num_blocks, with_transport=config.role != "colocated",
                                  num_offload_slots=num_offload_slots, offload_dir=offload_dir,
                                  num_offload_staging_rows=_num_offload_staging_rows(config, plan, layout)
                                  if offload_dir is not None else 0))
        channel: Optional[LeaderChannel] = LeaderChannel(ranks)
        runner: ModelRunner = LeaderRunner(loaded.model, plan, layout, device, grammar=grammar, channel=channel,
                                           shared_pool=isolated_agent)
        follower_transports = (ranks.gather(None) or [None])[1:]
        transport_factory = _ranked(transport_factory, channel, follower_transports, spec.total_kv_heads, plan.group_size)
    else:
        channel = None
        runner = ModelRunner(loaded.model, plan, layout, device, compile_decode=compile_decode, grammar=grammar,
                             shared_pool=isolated_agent)
        transport_factory = _ranked(transport_factory, None, [], spec.total_kv_heads, plan.group_size)
    runner.warm_up(config.scheduler.max_num_running)
    offload = _offload_tier(config, plan, layout, runner.pool, kv_events, channel)
    kv_manager = KVCacheManager(plan, num_blocks, cache.block_size, cache.enable_prefix_caching, kv_events, offload)
    model_name = config.model.served_name or loaded.name
    pool = _pool_description(model_name, spec, plan, layout, dtype)
    kv_side = build_kv_side(config, metrics, pool, layout.canonical_view(runner.pool), transport_factory)
    stats = EngineStats(metrics, kv_manager)
    scheduler = Scheduler(config.scheduler, kv_manager, cache.block_size, max_model_len,
                          connector=kv_side.connector, on_preempt=stats.record_preemption)
    loop = EngineLoop(scheduler, runner, OutputEmitter(OutputProcessor(loaded.tokenizer)),
                      loaded.tokenizer.eos_token_ids, stats, request_ids)
    if offload is not None:  # a landed tier load wakes an idle loop rather than wait out its poll interval
        offload.wake_on_results(loop.wake)
    metrics.engine.cpu_threads.set(torch.get_num_threads())
    if config.model.core_ledger is not None:
        loop.core_share = _core_share(config, metrics)
    metrics.engine.watch_progress(loop.progress_age_s)
    metrics.engine.watch_ranks(parallel.tensor_parallel_size, loop.is_alive)
    admission = build_admission(config, metrics, pool, kv_side, loop.call_soon, http_transport)
    max_in_flight = config.scheduler.max_num_running + config.scheduler.max_num_waiting
    engine = AsyncEngine(loop, model_name, max_model_len, loaded.tokenizer, max_in_flight, admission,
                         grammar_tokenizer)
    logger.info(
        "engine ready: role=%s model=%s device=%s dtype=%s tp=%d groups=%d group_size=%d blocks=%d block_size=%d "
        "page_bytes=%d max_model_len=%d", config.role, engine.model_name, device, dtype,
        parallel.tensor_parallel_size, len(plan.groups), plan.group_size, num_blocks, cache.block_size,
        layout.page_bytes, max_model_len,
    )
    epoch = kv_side.base_epoch
    return BuiltEngine(engine, loaded, plan, layout, kv_manager, runner, kv_side, kv_events, epoch)
