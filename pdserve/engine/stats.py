"""Feeds the engine's Prometheus metrics from the engine thread after each step.

Invariant: counters only ever receive deltas of monotonic engine-side counts,
so a metric never double-counts or goes backwards.
"""

from __future__ import annotations

from typing import Callable

from pdserve.engine.schedule_types import SchedulerOutput
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.manager import KVCacheManager
from pdserve.metrics import LoadSnapshot, Metrics
from pdserve.request import Request


class EngineStats:
    def __init__(self, metrics: Metrics, kv_manager: KVCacheManager,
                 observe_prefill: Callable[[int, float], None] = lambda num_tokens, seconds: None):
        """`observe_prefill(prompt tokens, seconds)`: each step that computed prompt tokens (the peer-pull
        decision's price of computing, pd/peer_costs.py)."""
        self.metrics = metrics
        self.observe_prefill = observe_prefill
        self.kv = kv_manager
        self._num_query_tokens = 0
        self._num_hit_tokens = 0
        self._num_offload_hit_tokens = 0
        self._offload_counts = (0, 0, 0, 0, 0)  # store bytes, load bytes, failed loads, busy, failed stores
        self.num_computed_prompt_tokens = 0  # also read by tests and benchmarks
        # The pool's shape is known from here on, before the loop's first turn.
        self.metrics.load.update(LoadSnapshot(num_blocks_in_use_by_group=kv_manager.num_blocks_in_use_by_group(),
                                              num_pool_blocks=kv_manager.num_usable_blocks,
                                              block_size=kv_manager.block_size))

    def record_load(self, scheduler: Scheduler) -> None:
        """The queues and the pool as they stand, also between steps (a pin released, a pull in
        flight): pdserve's gauges and the GIE protocol's read this one record."""
        self.metrics.load.update(LoadSnapshot(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + scheduler.num_waiting_for_kv,
            num_blocks_in_use_by_group=self.kv.num_blocks_in_use_by_group(),
            num_pool_blocks=self.kv.num_usable_blocks,
            block_size=self.kv.block_size,
        ))

    def record_preemption(self, request: Request) -> None:
        self.metrics.scheduler.count_preemptions()

    def record_first_token(self, request: Request) -> None:
        if request.first_scheduled_time_s is not None:
            self.metrics.scheduler.observe_queue_time(request.first_scheduled_time_s - request.arrival_time_s)

    def record_first_step_after_handoff(self, seconds: float) -> None:
        """D: P's token went out as output token 1, then D's first step sampled token 2 this long after."""
        self.metrics.transfer.observe_handoff({"d_first_step": seconds})

    def record_first_token_kept_recomputing(self) -> None:
        """D: a P/D request whose prompt D computes after all went on from P's token 1 (pd/first_token.py)."""
        self.metrics.transfer.first_token_kept_recomputing.inc()

    def record_step(self, scheduler: Scheduler, step: SchedulerOutput, duration_s: float) -> None:
        self.metrics.engine.observe_step(duration_s)
        num_prompt = sum(chunk.num_prompt_tokens_computed for chunk in step.chunks)
        if num_prompt:
            self.num_computed_prompt_tokens += num_prompt
            self.metrics.engine.count_computed_prompt_tokens(num_prompt)
            self.observe_prefill(num_prompt, duration_s)
        self.record_load(scheduler)
        stats = self.kv.prefix_stats
        if stats.num_query_tokens != self._num_query_tokens:
            self.metrics.kv.count_prefix_lookup(
                stats.num_query_tokens - self._num_query_tokens, stats.num_hit_tokens - self._num_hit_tokens,
                stats.num_offload_hit_tokens - self._num_offload_hit_tokens,
            )
            self._num_query_tokens, self._num_hit_tokens = stats.num_query_tokens, stats.num_hit_tokens
            self._num_offload_hit_tokens = stats.num_offload_hit_tokens
        self._record_offload()

    def _record_offload(self) -> None:
        tier = self.kv.offload
        if tier is None:
            return
        counts = (tier.stats.num_store_bytes, tier.stats.num_load_bytes, tier.stats.num_failed_loads,
                  tier.stats.num_skipped_stores, tier.stats.num_failed_stores)
        store_bytes, load_bytes, failed_loads, busy_stores, failed_stores = [
            now - before for now, before in zip(counts, self._offload_counts)]
        store_s, load_s = tier.stats.store_seconds, tier.stats.load_seconds
        tier.stats.store_seconds, tier.stats.load_seconds = [], []
        self.metrics.offload.record_tier_activity(store_bytes, load_bytes, failed_loads, store_s, load_s, tier.usage_ratio,
                                     busy_stores, failed_stores)
        self._offload_counts = counts
