"""A worker split over tensor-parallel ranks: rank 0's runner, and the loop every other rank runs.

    rank 0                                        rank r > 0
    scheduler.schedule() -> SchedulerOutput
    LeaderRunner.execute(step)
      channel.send(chunks, path) -------------->  receive -> apply transport commands
      forward over its heads   <-- all-reduce -->  forward over its heads (runner.run_shard)
      logits of its vocab rows <-- all-gather -->  logits of its vocab rows (the same rows)
      (all-reduce and all-gather: shared memory where the ranks share a host, else gloo / NCCL)
      sample                                       (no sampling)

Rank 0 keeps the HTTP server, the scheduler, the KV manager and the sampler; the block ids in a
step are the same on every rank (each rank's pool slice holds its own heads of the same blocks).
Invariant: every rank runs the same collectives in the same order, because every collective
follows from a message rank 0 broadcast. Any failure while the ranks run a step is therefore
fatal (`RanksLost`): once a rank stops part-way, no later collective can be trusted, so rank 0's
loop dies, /live fails, and the worker exits non-zero for its orchestrator to restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import uuid
from typing import Optional, Sequence, Union

import torch

from pdserve.api.config import WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.runner import prompt_logprobs
from pdserve.runner.devices import pick_device, pick_dtype, pick_kv_dtype, rank_device, rank_threads
from pdserve.runner.model_runner import ModelRunner
from pdserve.engine.schedule_types import ScheduledChunk, SchedulerOutput, StepResult
from pdserve.runner.offload_ranks import FileTierFollower, HostTierFollower
from pdserve.kv.layout import KVPoolLayout, plan_for_model, plan_page_bytes
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_host import HostPageStore
from pdserve.kv.offload_writes import SerialExecutor
from pdserve.models.loader import load_model, resolve_quantization
from pdserve.models.registry import TensorParallelRank
from pdserve.parallel.channel import LeaderChannel, RankMessage, RankReport, RankSetup
from pdserve.parallel.ranks import RankGroup, RanksLost
from pdserve.pd.wiring import TransportFactory, nixl_transport
from pdserve.transfer.ranked_transport import FollowerTransport, RankReader
from pdserve.transfer.state_ranges import state_splits

logger = logging.getLogger(__name__)

_FOLLOWER_SAMPLING = SamplingParams()

TierFollower = Union[HostTierFollower, FileTierFollower]


def _slim(chunk: ScheduledChunk) -> ScheduledChunk:
    """What a follower needs of a chunk: tokens, positions and blocks (no histories, no sampling)."""
    return dataclasses.replace(chunk, sampling=_FOLLOWER_SAMPLING, prompt_token_ids=(), output_token_ids=(),
                               eos_token_ids=())


class LeaderRunner(ModelRunner):
    """Rank 0's runner: sends each step to the other ranks, then runs its own shard and samples."""

    cancellable = False  # the other ranks run every layer of a step they were sent

    def __init__(self, *args, channel: LeaderChannel, **kwargs):  # type: ignore[no-untyped-def]
        self._state_copies: list[tuple[int, int]] = []  # this step's, for the other ranks' pages
        super().__init__(*args, **kwargs)
        self.channel = channel

    def copy_state_pages(self, step: SchedulerOutput) -> None:
        """Every rank's pages hold its share of the state: each makes the step's copies (snapshots,
        restores, P's handoff page) in its own pool, before its forward pass. A step with copies and
        no chunks sends them alone."""
        super().copy_state_pages(step)
        self._state_copies = list(step.state_copies)
        if self._state_copies and step.is_empty:
            self.channel.send(SchedulerOutput(chunks=[], state_copies=self._state_copies))
            self._state_copies = []

    def _share_step(self, chunks: Sequence[ScheduledChunk], sample_rows: Sequence[int],
                    prompt_rows: Sequence[prompt_logprobs.WantedRows]) -> None:
        path = self.takes_decode_step(chunks, bool(prompt_rows))
        # The eager path's logits computations, in execute's order (the head is split over the ranks).
        logit_rows = () if path else tuple(rows for rows in (
            tuple(sample_rows), tuple(prompt_logprobs.row_indices(prompt_rows))) if rows)
        self.channel.send(SchedulerOutput(chunks=[_slim(chunk) for chunk in chunks], state_copies=self._state_copies),
                          path, logit_rows)
        self._state_copies = []

    def execute(self, step: SchedulerOutput) -> StepResult:
        try:
            return super().execute(step)
        except RanksLost:
            raise
        except Exception as error:  # the ranks' collectives are out of step now: nothing later can be trusted
            raise RanksLost(f"a tensor-parallel step failed on rank 0: {error!r}") from error

    def keep_ranks_alive(self) -> None:
        self.channel.keep_alive()

    def close(self) -> None:
        self.channel.stop()
        self.channel.group.close()


def outlive_sigterm(rank: int) -> None:
    """A rank > 0 keeps serving after SIGTERM. Where every rank of a worker gets it at once (the pods
    of a LeaderWorkerSet, a systemd unit), rank 0 drains its requests first, and they need every rank
    to compute: rank 0 then stops the ranks (or, if it dies, they notice within the collective
    timeout). Main thread only (signal handlers live there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum: int, frame: object) -> None:
        logger.info("rank %d: SIGTERM; serving on until rank 0 has drained and stops the ranks", rank)

    signal.signal(signal.SIGTERM, note)


def serve_follower(config: WorkerConfig, transport_factory: TransportFactory = nixl_transport) -> int:
    """Run rank `config.parallel.tp_rank` (> 0) until rank 0 stops it (0) or is lost (1)."""
    parallel = config.parallel
    rank, size = parallel.tp_rank or 0, parallel.tensor_parallel_size
    outlive_sigterm(rank)
    device = rank_device(pick_device(config.model.device), rank)
    dtype = pick_dtype(config.model.dtype, device)
    torch.set_num_threads(rank_threads(config.model.num_threads, size))
    group = RankGroup(rank, size, parallel.tp_master_addr, parallel.tp_master_port or 0, parallel.tp_timeout_s, device,
                      parallel.tp_join_timeout_s, internal_token=config.server.internal_token)
    transport = None
    tier: Optional[TierFollower] = None
    try:
        group.share_host_memory(parallel.tp_shared_memory, device, native=parallel.tp_native_all_reduce)
        quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
        loaded = load_model(config.model.path, dtype, device, quantization,
                            parallel=TensorParallelRank(rank, size, group.all_reduce, group.all_gather))
        spec = loaded.model.spec
        kv_dtype = pick_kv_dtype(config.cache.kv_cache_dtype, config.model.dtype, loaded.model, dtype,
                                 device)
        plan = plan_for_model(spec.layer_specs, config.cache.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype)
        setup: RankSetup = group.broadcast()
        page_bytes = plan_page_bytes(plan, config.cache.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype)
        layout = KVPoolLayout.for_plan(plan, setup.num_blocks, config.cache.block_size, spec.num_kv_heads,
                                       spec.head_dim, kv_dtype)
        runner = ModelRunner(loaded.model, plan, layout, device, one_row_tiles=config.keeps_one_row_tiles)
        runner.bind_thread()
        logger.info("rank %d/%d ready: %d blocks of %d bytes, %d heads and %d KV heads here", rank, size,
                    setup.num_blocks, page_bytes, spec.num_heads, spec.num_kv_heads)
        if setup.num_offload_slots:
            tier = _tier_follower(setup, layout, runner.pool, rank)
        if setup.with_transport:
            agent = f"{config.transfer.engine_id or config.role}-rank{rank}-{uuid.uuid4().hex[:12]}"
            local = transport_factory(layout.canonical_view(runner.pool), agent)
            transport = FollowerTransport(RankReader(local, rank, size, spec.total_kv_heads, plan.group_size,
                                                     layout.block_size, layout.kv_page_bytes,
                                                     state_splits(plan, size)))
        group.gather(transport.descriptor() if transport is not None else None)  # rank 0 builds its transport
        return _follow(group, runner, transport, tier)
    except RanksLost as error:
        logger.critical("rank %d/%d: %s; exiting", rank, size, error)
        return 1
    except Exception:  # noqa: BLE001 - e.g. a model that cannot be split: rank 0 says why as well
        logger.critical("rank %d/%d could not start", rank, size, exc_info=True)
        return 1
    finally:
        if transport is not None:
            transport.close()
        if tier is not None:
            tier.close()
        group.close()


def _tier_follower(setup: RankSetup, layout: KVPoolLayout, pool: torch.Tensor, rank: int) -> TierFollower:
    """This rank's side of rank 0's offload tier: as many slots of this rank's pages, in host memory or
    in a file of its own under the tier's directory."""
    view = layout.canonical_view(pool)
    capacity_bytes = setup.num_offload_slots * layout.page_bytes
    if setup.offload_dir is None:
        return HostTierFollower(HostPageStore(view, capacity_bytes), rank)
    store = FilePageStore(view, capacity_bytes, os.path.join(setup.offload_dir, f"rank-{rank}"),
                          setup.num_offload_staging_rows)
    logger.info("rank %d: KV offload tier %s, %d pages of %d bytes", rank, store.path, store.num_slots,
                store.page_bytes)
    return FileTierFollower(store, rank, SerialExecutor(f"pdserve-kv-offload-rank{rank}"))


def _follow(group: RankGroup, runner: ModelRunner, transport: Optional[FollowerTransport],
            tier: Optional[TierFollower]) -> int:
    while True:
        message: RankMessage = group.broadcast()
        if message.stop:
            logger.info("rank %d: rank 0 is shutting down", group.rank)
            return 0
        if tier is not None:  # first: a page leaves a block before a pull or a step overwrites it
            tier.apply(message.commands)
        if transport is not None:
            transport.apply(message.commands)
        if message.step is not None:
            try:
                runner.run_shard(message.step, message.decode_step, message.logit_rows)
                runner.synchronize()
            except RanksLost:
                raise
            except Exception as error:  # out of step with the other ranks from here on
                raise RanksLost(f"rank {group.rank}: a step failed: {error!r}") from error
        if message.want_report:
            group.gather(RankReport(transport.report() if transport is not None else None,
                                    tier.report() if tier is not None else ()))
