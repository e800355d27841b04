"""The KV side of a worker's engine: the block manager over the runner's pool, its event recorder
and the offload tier behind it (host memory or files).

Invariant: a tier holds whole pages of this rank's pool (its slots are `--kv-offload-bytes` of them);
under tensor parallelism rank 0's copies are repeated by every rank on its slice, in order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.api.config import WorkerConfig
from pdserve.kv.events import KVEventRecorder
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_host import HostPageStore
from pdserve.kv.offload_writes import SerialExecutor
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan
from pdserve.parallel.channel import LeaderChannel
from pdserve.runner.offload_ranks import RankMirror

logger = logging.getLogger(__name__)
OFFLOAD_STAGING_BYTES = 64 << 20  # host memory a file tier may hold in pages waiting for their write


@dataclass(frozen=True)
class KVCacheSide:
    kv_manager: KVCacheManager
    kv_events: KVEventRecorder
    offload: Optional[OffloadTier]  # None without --kv-offload-bytes


def num_offload_slots(config: WorkerConfig, layout: KVPoolLayout) -> int:
    """Pages the tier behind the pool holds (--kv-offload-bytes of this rank's pages), 0 without one."""
    cache = config.cache
    if cache.kv_offload_dir is not None and cache.kv_offload_bytes is None:
        raise ValueError("--kv-offload-dir needs --kv-offload-bytes (the tier's size)")
    if cache.kv_offload_bytes is None or not cache.enable_prefix_caching:
        return 0
    return cache.kv_offload_bytes // layout.page_bytes


def num_offload_staging_rows(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout) -> int:
    """A file tier's staging rows: about one step's evictions (its token budget in blocks, per group),
    so a burst is written behind the step rather than skipped; at most OFFLOAD_STAGING_BYTES of them."""
    num_step_blocks = -(-config.scheduler.max_num_batched_tokens // config.cache.block_size) * len(plan.groups)
    return max(1, min(num_step_blocks, OFFLOAD_STAGING_BYTES // layout.page_bytes))


def _offload_tier(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout, pool: torch.Tensor,
                  events: KVEventRecorder, channel: Optional[LeaderChannel],
                  wake: Callable[[], None]) -> Optional[OffloadTier]:
    """The tier behind the pool (--kv-offload-bytes; in files with --kv-offload-dir), or None.
    File writes and reads run on the tier's one I/O thread; host-memory copies are a memcpy between steps.
    With tensor parallelism (`channel`) rank 0's copies are repeated by every rank on its slice
    (pdserve/runner/offload_ranks.py); rank 0's pages are in the directory itself, rank r's under rank-<r>/.
    `wake`: a landed load wakes an idle engine loop rather than wait out its poll interval."""
    cache = config.cache
    if not num_offload_slots(config, layout):
        return None
    full_group_ids = [g.group_id for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
    on_files = cache.kv_offload_dir is not None
    mirror = (RankMirror(channel, config.parallel.tensor_parallel_size - 1, others_answer=on_files)
              if channel is not None else None)
    ranks_note = " on every rank" if channel is not None else ""
    if on_files:
        store = FilePageStore(layout.canonical_view(pool), cache.kv_offload_bytes, cache.kv_offload_dir,
                              num_offload_staging_rows(config, plan, layout))
        executor = SerialExecutor()
        logger.info("KV offload tier: %s, %d pages of %d bytes, %d staging rows%s", store.path, store.num_slots,
                    store.page_bytes, store.num_staging_rows, ranks_note)
        return OffloadTier(store, full_group_ids, events, executor=executor, mirror=mirror, wake=wake)
    host = HostPageStore(layout.canonical_view(pool), cache.kv_offload_bytes)
    logger.info("KV offload tier: host memory, %d pages of %d bytes%s", host.num_slots, host.page_bytes, ranks_note)
    return OffloadTier(host, full_group_ids, events, mirror=mirror, wake=wake)


def build_kv_cache_side(config: WorkerConfig, plan: KVGroupPlan, layout: KVPoolLayout, pool: torch.Tensor,
                        channel: Optional[LeaderChannel], wake: Callable[[], None]) -> KVCacheSide:
    """The block manager over the runner's `pool`, with its tier; `wake` wakes the engine loop (its inbox)."""
    events = KVEventRecorder()
    offload = _offload_tier(config, plan, layout, pool, events, channel, wake)
    cache = config.cache
    manager = KVCacheManager(plan, layout.num_blocks, cache.block_size, cache.enable_prefix_caching, events, offload,
                             snapshot_interval_blocks=cache.state_snapshot_interval_blocks)
    return KVCacheSide(manager, events, offload)
