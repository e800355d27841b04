"""Runs one scheduled step on the device: the only engine code that touches torch.

Owns the model, the KV pool tensor and the sampler. Steps made only of
single-token chunks go through `DecodeStep` (a pure, optionally compiled pass)
where the native kernel runs or compilation was asked for; every other step
runs eagerly over `PagedAttention`.
Invariants: it writes K/V only into the blocks the scheduler's chunks name, and
returns exactly one sampled token per chunk that asked for one; after
`synchronize()` no kernel it queued is still running, so any block may be freed,
reused or read remotely.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from pdserve.engine.decode_step import DecodeStep
from pdserve.engine.paged_attention import PagedAttention
from pdserve.engine.sampler import Sampler
from pdserve.engine.schedule_types import SampledToken, ScheduledChunk, SchedulerOutput
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import KVGroupPlan
from pdserve.models.base import CausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: CausalLM, plan: KVGroupPlan, layout: KVPoolLayout, device: torch.device, seed: int = 0,
                 compile_decode: bool = False):
        self.model = model
        self.plan = plan
        self.layout = layout
        self.device = device
        self.pool = layout.allocate(device)
        self.layer_caches = self._layer_caches()
        self.sampler = Sampler(device, seed)
        self.decode_step = DecodeStep(model, plan, self.pool, self.layer_caches, layout.block_size, device,
                                      compile_step=compile_decode)
        self.synchronize()  # the pool's zeros land before NIXL registers it or a peer reads it

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current CUDA device (it is per
        thread): what runs on the engine thread without naming a device, such as UCX
        copies started by NIXL calls, then uses the pool's GPU. A no-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        """Block until every kernel this runner queued has finished.

        Kernels run asynchronously on CUDA: without this, a block freed after a
        step (finished, aborted, preempted or evicted request) could be handed
        to a NIXL READ, or published to a decode worker, while the step's
        kernels still write it. Waits on this thread's compute stream only,
        never on NIXL's own copies. A no-op on the CPU, where work is synchronous."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def warm_up(self, max_rows: int) -> Optional[float]:
        """Compile what runs per step before serving; seconds spent, None when nothing is compiled."""
        return self.decode_step.warm_up(max_rows)

    def _layer_caches(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        caches = []
        for layer_id in range(self.plan.num_layers):
            group_id, slot = self.plan.locate(layer_id)
            k_cache, v_cache = self.layout.layer_view(self.pool, slot)
            caches.append((group_id, k_cache, v_cache))
        return caches

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[SampledToken]:
        self.sampler.forget(step.finished_request_ids)
        if step.is_empty:
            return []
        # Single-token chunks first: they share one decode attention call per layer.
        chunks = sorted(step.chunks, key=lambda chunk: chunk.num_tokens != 1)
        if chunks[-1].num_tokens == 1 and (self.decode_step.native or self.decode_step.compiled):
            return self._execute_decode(chunks)
        input_ids, positions = self._inputs(chunks)
        attention = PagedAttention(self.plan, self.layer_caches, chunks, self.layout.block_size, self.device)
        hidden = self.model(input_ids, positions, attention)
        sample_rows, sample_chunks = self._sample_rows(chunks)
        if not sample_chunks:
            return []
        logits = self.model.compute_logits(hidden[sample_rows])
        return self.sampler.sample(logits, sample_chunks)

    def _execute_decode(self, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        logits = self.decode_step.run(chunks)
        sample_chunks = [chunk for chunk in chunks if chunk.sample]
        if not sample_chunks:
            return []
        if len(sample_chunks) != len(chunks):
            rows = [row for row, chunk in enumerate(chunks) if chunk.sample]
            logits = logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)]
        return self.sampler.sample(logits, sample_chunks)

    def _inputs(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        token_ids: list[int] = []
        positions: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.end_position))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        return as_tensor(token_ids), as_tensor(positions)

    def _sample_rows(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        rows, sampled = [], []
        offset = 0
        for chunk in chunks:
            offset += chunk.num_tokens
            if chunk.sample:
                rows.append(offset - 1)
                sampled.append(chunk)
        # Asynchronous copy: `torch.tensor(..., device=cuda)` would wait for the device.
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True), sampled
