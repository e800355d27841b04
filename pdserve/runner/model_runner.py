"""Runs one scheduled step on the device: the `StepRunner` the engine loop hands every step to.

Owns the model, the KV pool tensor and the sampler. Steps made only of
single-token chunks go through `DecodeStep` (a pure, optionally compiled pass)
where the native kernel runs or compilation was asked for (unless they need
prompt logprobs); every other step runs eagerly over `PagedAttention`. Either
way the logits meet the same sampling: penalties, bias, min_tokens, grammar
masks, logprobs, so a request's tokens do not depend on which path ran.
Invariants: it writes K/V only into the blocks the scheduler's chunks name, and
returns exactly one sampled token per chunk that asked for one; after
`synchronize()` no kernel it queued is still running, so any block may be freed,
reused or read remotely.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import torch

from pdserve.runner import prompt_logprobs
from pdserve.runner.decode_step import DecodeStep
from pdserve.runner.grammar_matchers import GrammarMatchers, bitmask_to_allowed
from pdserve.runner.paged_attention import PagedAttention
from pdserve.runner.paged_state import AttentionAndState, PagedState, copy_state_pages, state_views_of
from pdserve.runner.sampler import Sampler, unpack_sampled
from pdserve.engine.schedule_types import ScheduledChunk, SchedulerOutput, StepResult
from pdserve.engine.step_runner import StepCancelled
from pdserve.kernels.native import cpu_kernels_available
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import KVGroupPlan, RecurrentStateSpec
from pdserve.models.base import CausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    # Whether a step may be abandoned between layers (rank 0 of tensor-parallel ranks may not:
    # the other ranks would wait in the next layer's collective).
    cancellable = True
    replays_failed_steps = True  # False for hybrid models: see `StepRunner`

    def __init__(self, model: CausalLM, plan: KVGroupPlan, layout: KVPoolLayout, device: torch.device, seed: int = 0,
                 compile_decode: bool = False, grammar: Optional[GrammarMatchers] = None, shared_pool: bool = False,
                 batch_activation_digits: int = 3, one_row_tiles: bool = True):
        """`batch_activation_digits`, `one_row_tiles`: the fused decode layers' (DecodeStep's)."""
        self.model = model
        # Set by the engine loop for the step about to run: True once its requests are all aborted.
        self.stop_check: Optional[Callable[[], bool]] = None
        self.grammar = grammar  # None: this runner serves no structured outputs
        self.plan = plan
        self.layout = layout
        self.device = device
        self.pool = layout.allocate(device, shared=shared_pool)  # shared: an agent process registers it
        self.layer_caches = self._layer_caches()
        # Recurrent-state layers (Gated DeltaNet, Mamba2): their views into the pool; such models
        # run every step eagerly (the decode step knows attention layers only).
        self.state_views = state_views_of(plan, layout, self.pool) if model.spec.has_recurrent_state else None
        self.replays_failed_steps = self.state_views is None
        self.sampler = Sampler(device, seed, native_greedy=device.type == "cpu" and cpu_kernels_available())
        self.decode_step = None if self.state_views is not None else DecodeStep(
            model, plan, self.pool, self.layer_caches, layout.block_size, device, compile_step=compile_decode,
            batch_activation_digits=batch_activation_digits, one_row_tiles=one_row_tiles)
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

    def _share_step(self, chunks: Sequence[ScheduledChunk], sample_rows: Sequence[int],
                    prompt_rows: Sequence[prompt_logprobs.WantedRows]) -> None:
        """Called with a step's chunks in the order they run, before the forward pass; tensor-parallel
        rank 0 sends them to its other ranks here."""

    def keep_ranks_alive(self) -> None:
        """Called by the engine loop every turn; tensor-parallel rank 0 heartbeats its ranks here."""

    def close(self) -> None:
        """Release what the runner holds beyond memory (tensor-parallel rank 0: its ranks)."""

    def warm_up(self, max_rows: int) -> Optional[float]:
        """Compile what runs per step before serving; seconds spent, None when nothing is compiled."""
        return self.decode_step.warm_up(max_rows) if self.decode_step is not None else None

    def _layer_caches(self) -> list[Optional[tuple[int, torch.Tensor, torch.Tensor]]]:
        """Per layer id: (group id, k_cache, v_cache), None for a recurrent-state layer."""
        caches: list[Optional[tuple[int, torch.Tensor, torch.Tensor]]] = []
        for layer_id in range(self.plan.num_layers):
            group_id, slot = self.plan.locate(layer_id)
            if isinstance(self.plan.groups[group_id].spec, RecurrentStateSpec):
                caches.append(None)
                continue
            k_cache, v_cache = self.layout.layer_view(self.pool, slot)
            caches.append((group_id, k_cache, v_cache))
        return caches

    def copy_state_pages(self, step: SchedulerOutput) -> None:
        """The step's state page copies (snapshots, restores), before anything reads the pages."""
        if step.state_copies:
            copy_state_pages(self.layout.canonical_view(self.pool), step.state_copies)

    def _context(self, chunks: Sequence[ScheduledChunk]):
        """The one object every layer gets: paged attention, plus paged state for hybrid models."""
        attention = PagedAttention(self.plan, self.layer_caches, chunks, self.layout.block_size, self.device)
        if self.state_views is None:
            return attention
        return AttentionAndState(attention, PagedState(self.state_views, chunks, self.device))

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        self.copy_state_pages(step)  # every step, even an empty one: the manager counts on it
        if self.grammar is not None:
            self.grammar.forget(step.finished_request_ids)
        if step.is_empty:
            return StepResult()
        # Single-token chunks first: they share one decode attention call per layer.
        chunks = sorted(step.chunks, key=lambda chunk: chunk.num_tokens != 1)
        row_indices = sample_row_indices(chunks)
        sample_rows, sample_chunks = self._sample_rows(chunks, row_indices)
        # Grammar masks are computed on a helper thread while the model runs.
        masks = self.grammar.start_masks(sample_chunks) if self.grammar is not None and sample_chunks else None
        prompt_rows = prompt_logprobs.wanted_rows(chunks)
        self._share_step(chunks, row_indices, prompt_rows)
        logits, hidden = self._forward(chunks, sample_rows, len(sample_chunks), bool(prompt_rows))
        packed: list[torch.Tensor] = []
        late_rows: list[int] = []  # grammar rows whose masks did not come in time
        if logits is not None:
            # Whichever path made the logits, the sampler gets the same inputs: penalties, bias,
            # min_tokens, grammar masks, logprobs.
            allowed = None
            if masks is not None:
                bitmask, late_rows = self.grammar.result(masks, sample_chunks)  # bounded wait
                allowed = bitmask_to_allowed(bitmask, logits.shape[-1], self.device)
            packed.append(self.sampler.sample_packed(logits, sample_chunks, allowed))
        if prompt_rows:
            packed.append(prompt_logprobs.compute_packed(hidden, prompt_rows, self.model.compute_logits))
        if not packed:
            return StepResult()
        sampled_values, prompt_values = _to_host(packed, bool(sample_chunks))
        sampled = unpack_sampled(sampled_values, sample_chunks)
        for row in late_rows:  # no token was allowed: say why
            sampled[row] = dataclasses.replace(sampled[row], failed=True,
                                               failure="internal error: the grammar took too long to answer")
        if self.grammar is not None:
            self.grammar.consume(sample_chunks, sampled)
        return StepResult(sampled, prompt_logprobs.unpack(prompt_values, prompt_rows) if prompt_rows else [])

    def _forward(self, chunks: Sequence[ScheduledChunk], sample_rows: torch.Tensor, num_sampling: int,
                 wants_prompt_logprobs: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(logits of the sampling rows or None, hidden states or None). Decode-only steps take
        `DecodeStep` where the native kernel runs or compilation was asked for, unless they need
        prompt logprobs, which are read from the eager pass's hidden states."""
        if self.takes_decode_step(chunks, wants_prompt_logprobs):
            logits = self.decode_step.run(chunks)
            if num_sampling == 0:
                return None, None
            # One token per chunk: the sampling rows index the logits directly.
            return (logits if num_sampling == len(chunks) else logits[sample_rows]), None
        input_ids, positions = self._inputs(chunks)
        hidden = self.model(input_ids, positions, self._context(chunks),
                            between_layers=self._stop_if_cancelled if self.stop_check is not None else None)
        return (self.model.compute_logits(hidden[sample_rows]) if num_sampling else None), hidden

    def _stop_if_cancelled(self) -> None:
        if self.stop_check is not None and self.stop_check():
            raise StepCancelled()

    def takes_decode_step(self, chunks: Sequence[ScheduledChunk], wants_prompt_logprobs: bool) -> bool:
        """Whether a step (chunks sorted as `execute` sorts them) runs through `DecodeStep`."""
        decode_only = chunks[-1].num_tokens == 1 and not wants_prompt_logprobs
        return decode_only and self.decode_step is not None and (self.decode_step.native or self.decode_step.compiled)

    @torch.inference_mode()
    def run_shard(self, step: SchedulerOutput, decode_step: bool, logit_rows: Sequence[Sequence[int]]) -> None:
        """A tensor-parallel follower's part of a step: the forward pass over its heads (storing its
        K/V) on the path rank 0 took, and its vocabulary share of every logits computation rank 0
        makes (`logit_rows`, eager path; the decode step computes all its rows'), no sampling. Rows
        line up with rank 0's because the chunks arrive in the order rank 0 runs them, and the
        hidden states are the same on every rank after the last all-reduce."""
        chunks = step.chunks
        self.copy_state_pages(step)
        if not chunks:  # rank 0's step had state page copies and nothing to compute
            return
        if decode_step:
            self.decode_step.run(chunks)
            return
        input_ids, positions = self._inputs(chunks)
        hidden = self.model(input_ids, positions, self._context(chunks))
        for rows in logit_rows:
            self.model.compute_logits(hidden[torch.tensor(list(rows), dtype=torch.int64, device=self.device)])

    def _inputs(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        token_ids: list[int] = []
        positions: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.end_position))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        return as_tensor(token_ids), as_tensor(positions)

    def _sample_rows(self, chunks: Sequence[ScheduledChunk],
                     rows: list[int]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        sampled = [chunk for chunk in chunks if chunk.sample]
        # Asynchronous copy: `torch.tensor(..., device=cuda)` would wait for the device.
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True), sampled


def sample_row_indices(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """The flat-batch row of each sampling chunk: its last token's."""
    rows, offset = [], 0
    for chunk in chunks:
        offset += chunk.num_tokens
        if chunk.sample:
            rows.append(offset - 1)
    return rows


def _to_host(packed: list[torch.Tensor], has_sampled: bool) -> tuple[list[list[float]], list[list[float]]]:
    """The step's one device-to-host transfer: every packed result flattened into one tensor."""
    shapes = [tuple(tensor.shape) for tensor in packed]
    flat = torch.cat([tensor.flatten() for tensor in packed]).tolist() if len(packed) > 1 else None
    parts, offset = [], 0
    for index, (num_rows, width) in enumerate(shapes):
        values = flat[offset : offset + num_rows * width] if flat is not None else packed[index].flatten().tolist()
        offset += num_rows * width
        parts.append([values[row * width : (row + 1) * width] for row in range(num_rows)])
    if has_sampled:
        return parts[0], parts[1] if len(parts) > 1 else []
    return [], parts[0]
