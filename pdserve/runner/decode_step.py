"""The decode step: every chunk is one token, run as one pure forward pass, optionally compiled.

The forward pass reads the pool but never writes it: each layer attends over the cached keys of
each row plus the row's own new key, handed to the kernel directly, and returns the new K/V of
every layer; one scatter per KV group then stores them. A pure pass over a fixed set of tensors
is what `torch.compile` (and CUDA graphs) want: no mutation, no host syncs, shapes that vary
only in the number of rows and the block-table width. Invariant: the tokens, logits and K/V it
produces are those of the eager `PagedAttention` path on the same inputs.

Eager on the CPU with float32 activations and Llama-family layers, each layer is one native
call (`fused_layer.py`: a decode step at one row was mostly Python dispatching ~120 small ops a
layer) that also stores the layer's new K/V in place once it has attended (it reads no slot it
writes); a tensor-parallel rank's layer is two calls, around its all-reduces. Compiled, it runs
one of two ways:

    native (CPU kernels): one graph per layer kind with the rows and table width dynamic
    static (CUDA):        rows and width padded to powers of two, masked torch attention in
                          fixed slices, one CUDA graph per (rows, width) bucket and layer kind
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pdserve.runner.decode_attention import (
    DecodeRows, attend_decode, attend_decode_static, build_decode_rows, uses_native_kernel,
)
from pdserve.runner.fused_layer import FusedDecoderStack, fused_layers, native_final_norm
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.specs import KVGroupPlan
from pdserve.models.base import CausalLM, DecoderLayer

logger = logging.getLogger(__name__)

LayerCaches = Sequence[tuple[int, torch.Tensor, torch.Tensor]]  # per layer: (group_id, k_cache, v_cache)


def _layer_step(
    layer: DecoderLayer, h: torch.Tensor, rope: Any, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: DecodeRows, native: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for single-token rows: (residual out, the rows' new k, new v)."""
    q, k, v = layer.attention_inputs(h, rope)
    attended = attend_decode(q, k_cache, v_cache, rows, layer.attention_scale, k, v, native=native,
                             sinks=layer.attention_sinks)
    return layer.attention_output(h, attended), k, v


def _layer_step_over_tensors(
    layer: DecoderLayer, h: torch.Tensor, rope: Any, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_layer_step` with the native kernel and tensors only: what gets compiled, once for all layers."""
    return _layer_step(layer, h, rope, k_cache, v_cache, DecodeRows(block_table, key_start, key_end), True)


def _layer_step_static(
    layer: DecoderLayer, h: torch.Tensor, rope: Any, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_layer_step` for fixed-shape graphs: masked torch attention over the whole (padded) table."""
    q, k, v = layer.attention_inputs(h, rope)
    rows = DecodeRows(block_table, key_start, key_end)
    attended = attend_decode_static(q, k_cache, v_cache, rows, layer.attention_scale, k, v,
                                    sinks=layer.attention_sinks)
    return layer.attention_output(h, attended), k, v


def _bucket(value: int) -> int:
    """The power of two at or above `value`: the shapes static graphs are built for."""
    return 1 << max(0, value - 1).bit_length()


@dataclass(slots=True)
class DecodeInputs:
    """Tensors of one decode step, all on the device."""

    input_ids: torch.Tensor  # int64 [rows]
    positions: torch.Tensor  # int64 [rows]
    rows: tuple[DecodeRows, ...]  # per KV group
    write_block_ids: tuple[torch.Tensor, ...]  # per KV group: int64 [rows]
    write_offsets: torch.Tensor  # int64 [rows], slot of each new token inside its block
    num_rows: int  # real rows; static shapes pad the tensors above (but the writes) past them


_MIN_TABLE_WIDTH = 2  # width 1 would get its own compiled graph (size-1 dims are specialised)


class DecodeStep:
    """Builds the inputs of a decode-only step, runs the (compiled) pure pass, stores the new K/V."""

    def __init__(self, model: CausalLM, plan: KVGroupPlan, pool: torch.Tensor, layer_caches: LayerCaches,
                 block_size: int, device: torch.device, compile_step: bool, native: Optional[bool] = None,
                 fuse_layers: bool = True, batch_activation_digits: int = 3, one_row_tiles: bool = True):
        """`native` None: the native kernels wherever they run (tests pass False to take the
        path other devices take). `fuse_layers`: run each layer as one native call where the
        kernels and the model allow it (eager steps only; False keeps the per-op path).
        `batch_activation_digits`: the fused layers' Q4_1 batches round activations to this many
        7-bit digits (3: 22 bits, as one row; `--batch-activation-bits`). `one_row_tiles`: the fused
        layers keep their Q4_1 weights a second time for steps of 1-2 rows (`--one-row-tiles`)."""
        self.model = model
        self.plan = plan
        self.pool = pool
        self.layer_caches = layer_caches
        self.block_size = block_size
        self.device = device
        # Per KV group: the page slot of each of its layers, and those layers' ids.
        self.group_slots = [
            (torch.tensor([plan.locate(layer)[1] for layer in group.layer_ids], device=device), list(group.layer_ids))
            for group in plan.groups
        ]
        self.native = uses_native_kernel(device, pool.dtype) if native is None else native
        self.compiled = compile_step
        # One native call per layer (engine/fused_layer.py) where the whole model allows it.
        self._fused = fused_layers(model, device) if fuse_layers and self.native and not compile_step else None
        self._fused_stack = None
        if self._fused is not None:
            self._fused_stack = FusedDecoderStack(self._fused, layer_caches, native_final_norm(model),
                                                  batch_activation_digits, one_row_tiles)
            tile_bytes = self._fused_stack.one_row_tile_bytes
            if tile_bytes:
                logger.info("decode steps of 1-2 rows keep the Q4_1 weights a second time as one-row tiles: %.1f MiB",
                            tile_bytes / 2**20)
        self._stack_norms = self._fused_stack is not None and self._fused_stack.applies_final_norm
        self.static_shapes = compile_step and not self.native
        # One compiled graph serves every layer of a kind (dynamo guards on the layer's type and
        # settings, not on which layer it is), so compile time does not grow with depth.
        self._compiled_layer = None
        if compile_step and self.native:
            self._compiled_layer = torch.compile(_layer_step_over_tensors, dynamic=None, fullgraph=True)
        elif compile_step:
            for _, k_cache, v_cache in layer_caches:  # graph inputs that must never be copied
                torch._dynamo.mark_static_address(k_cache)
                torch._dynamo.mark_static_address(v_cache)
            mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs
            self._compiled_layer = torch.compile(_layer_step_static, dynamic=False, fullgraph=True, mode=mode)

    def inputs(self, chunks: Sequence[ScheduledChunk]) -> DecodeInputs:
        positions = [chunk.start_position for chunk in chunks]
        token_ids = [chunk.token_ids[0] for chunk in chunks]
        as_int64 = lambda values: torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        group_rows, write_blocks = [], []
        for group in self.plan.groups:
            group_tables = [chunk.block_ids[group.group_id] for chunk in chunks]
            rows = build_decode_rows(group.spec, group_tables, positions, self.block_size, self.device,
                                     include_query_key=False, min_width=_MIN_TABLE_WIDTH)
            group_rows.append(self._padded(rows) if self.static_shapes else rows)
            write_blocks.append(as_int64([table[p // self.block_size] for table, p in zip(group_tables, positions)]))
        if self.static_shapes:  # padding rows: token 0 at position 0, attending to their own key only
            padding = [0] * (_bucket(len(chunks)) - len(chunks))
            token_ids, positions = token_ids + padding, positions + padding
        return DecodeInputs(
            as_int64(token_ids), as_int64(positions), tuple(group_rows), tuple(write_blocks),
            as_int64([p % self.block_size for p in positions[: len(chunks)]]), len(chunks),
        )

    @staticmethod
    def _padded(rows: DecodeRows) -> DecodeRows:
        num_rows, width = rows.block_table.shape
        table = torch.nn.functional.pad(rows.block_table, (0, _bucket(width) - width, 0, _bucket(num_rows) - num_rows))
        pad_rows = lambda t: torch.nn.functional.pad(t, (0, _bucket(num_rows) - num_rows))  # noqa: E731
        return DecodeRows(table, pad_rows(rows.key_start), pad_rows(rows.key_end), rows.starts, rows.ends)

    def run(self, chunks: Sequence[ScheduledChunk], with_logits: bool = True) -> Optional[torch.Tensor]:
        """Logits [len(chunks), vocab] of single-token `chunks` (None without `with_logits`: a
        tensor-parallel follower), their K/V stored in the pool."""
        step = self.inputs(chunks)
        h, rope = self.model.embed(step.input_ids, step.positions)
        if self._fused is not None:  # one native call for every layer; each stores its own new K/V
            h = self._fused_stack(h, rope, step.rows, step.write_block_ids, step.write_offsets)
            if not with_logits:
                return None
            return self.model.compute_logits(h if self._stack_norms else self.model.final_norm(h))
        new_keys, new_values = [], []
        for layer, (group_id, k_cache, v_cache) in zip(self.model.layers, self.layer_caches):
            rows = step.rows[group_id]
            if self._compiled_layer is not None:
                h, k, v = self._compiled_layer(layer, h, rope, k_cache, v_cache, rows.block_table, rows.key_start,
                                               rows.key_end)
            else:
                h, k, v = _layer_step(layer, h, rope, k_cache, v_cache, rows, self.native)
            new_keys.append(k)
            new_values.append(v)
        logits = self.model.compute_logits(self.model.final_norm(h[: step.num_rows])) if with_logits else None
        self._store(step, new_keys, new_values)
        return logits

    def _store(self, step: DecodeInputs, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """keys[layer], values[layer]: [rows, kv_heads, head_dim] -> the page slots of each layer, one
        scatter per KV group and K/V."""
        real = step.num_rows
        for (slots, layer_ids), block_ids in zip(self.group_slots, step.write_block_ids):
            blocks, offsets = block_ids[:, None], step.write_offsets[:, None]
            # pool[block, :, slot, kv, offset] is [rows, layers, kv_heads, head_dim] (the indexed dims lead).
            # Cast to the pool's dtype (--kv-cache-dtype may be narrower than the activations).
            self.pool[blocks, :, slots[None, :], 0, offsets] = torch.stack(
                [keys[i][:real] for i in layer_ids], dim=1).to(self.pool.dtype)
            self.pool[blocks, :, slots[None, :], 1, offsets] = torch.stack(
                [values[i][:real] for i in layer_ids], dim=1).to(self.pool.dtype)

    def warm_up(self, max_rows: int) -> Optional[float]:
        """Compile the layer step for one row and for any number of rows (both with any table
        width) before a request waits on it; seconds spent, None when not compiled. Touches no
        block but the null block's contents, which nothing ever reads unmasked."""
        if self._compiled_layer is None or self.static_shapes:
            return None  # static graphs are built per bucket, as buckets first occur
        started_s = time.monotonic()
        for num_rows in sorted({1, min(2, max_rows)}):
            ids = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
            with torch.inference_mode():
                h, rope = self.model.embed(ids, ids)
                for layer in self._distinct_layers():
                    _, k_cache, v_cache = self.layer_caches[layer.layer_id]
                    table = torch.zeros(num_rows, _MIN_TABLE_WIDTH, dtype=torch.int32, device=self.device)
                    start = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
                    end = torch.ones(num_rows, dtype=torch.int32, device=self.device)
                    dynamic_dims = [(table, 1)] + ([(t, 0) for t in (h, *_tensors_of(rope), table, start, end)]
                                                   if num_rows > 1 else [])
                    for tensor, dim in dynamic_dims:
                        torch._dynamo.mark_dynamic(tensor, dim)
                    self._compiled_layer(layer, h, rope, k_cache, v_cache, table, start, end)
        elapsed_s = time.monotonic() - started_s
        logger.info("compiled the decode step in %.1f s", elapsed_s)
        return elapsed_s

    def _distinct_layers(self) -> list[DecoderLayer]:
        """One layer per compiled graph: layers that differ only in their weights share one."""
        seen, distinct = set(), []
        for layer in self.model.layers:
            key = (type(layer), tuple(sorted((k, repr(v)) for k, v in vars(layer).items()
                                             if isinstance(v, (bool, int, float, str)) and k != "layer_id")))
            if key not in seen:
                seen.add(key)
                distinct.append(layer)
        return distinct


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_of(item)]
    return []


def compile_unsupported_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when the compiled decode step is supported on this device and dtype, else why not."""
    if device.type == "cuda" or (dtype == torch.float32 and uses_native_kernel(device, dtype)):
        return None
    return "on the CPU the compiled decode step needs the native kernels and float32 activations"


def should_compile(choice: Optional[bool], device: torch.device, dtype: torch.dtype) -> bool:
    """The configured `compile` made concrete for this device and dtype. None compiles nowhere
    yet. On a 2-core CPU a cold compile took 26 s quiet and 115 s under load, which every fresh
    worker (and every CI run) would pay before its first request; on an H100 the CUDA-graph
    variant failed its requests (one graph's outputs overwritten by the next layer's replay,
    then dynamo's recompile limit: docs/benchmarks.md "GPU"), so it stays opt-in until fixed."""
    reason = compile_unsupported_reason(device, dtype)
    if choice and reason is not None:
        logger.warning("not compiling the decode step: %s", reason)
    wanted = bool(choice)
    return wanted and reason is None
