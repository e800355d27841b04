"""Attention that reads and writes K/V straight from the paged block pool.

Built once per step from the scheduled chunks, then called by every layer.
Invariant: a query at position p sees exactly the keys its layer's spec allows
(causal, same request, inside the sliding window); stale data in null or
padding blocks is always masked out.

Token order in the flat batch: single-token chunks first (one attention call
for all of them), then each multi-token chunk. Where the native kernel runs
(the CPU, a float32, bfloat16 or float16 pool) decode rows read their pages in place
(decode_attention.py); elsewhere (CUDA) they share one padded gather and one folded SDPA call,
the path measured on an H100 (docs/benchmarks.md, "GPU").

No SDPA call here ever needs `enable_gqa`: on CUDA, flash attention takes no
mask and the memory-efficient kernel has no GQA, so a masked GQA call falls to
the math kernel (float32 scores heads x n x L, K/V repeated per head). Masked
calls fold the query heads of each KV head into the query axis; the one
unmasked call (a chunk that starts its sequence) repeats its own K/V per head.

    folding, 2 KV heads x 2 query heads each, chunk of n queries:
      q [n, 4 heads, d] -> [1, 2 kv heads, n*2, d]   row i*2+j = query i, head 2*kv+j
      mask [n, L]       -> [1, 1, n*2, L]            row i*2+j = mask row i
      K/V stay          [1, 2 kv heads, L, d]        (never repeated)

    block table of one request, one group (block_size = 4, window = 6):
      positions  0..3   4..7   8..11  12..15
      table     [  0  |  17  |  42  |  9   ]   0 = null (slid out of the window)
    a query at position 13 needs keys 8..13 -> gather blocks [42, 9], keys at
    positions 8..15, mask keeps 8..13.

Attention sinks (gpt-oss) ride on SDPA as one extra key column: a zero key and a zero value,
whose float mask entry is the head's sink logit, so the sink joins each query's softmax
denominator and adds nothing to its output (`with_sink_column`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.runner.decode_attention import DecodeRows, attend_decode, build_decode_rows, uses_native_kernel
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.specs import AttentionSpec, FullAttentionSpec, KVGroupPlan, RecurrentStateSpec


@dataclass(slots=True)
class _GatherPlan:
    """Which blocks to gather for a set of queries and which keys they may see."""

    block_table: torch.Tensor | None  # [rows, gathered_blocks]; None: keys are the chunk's own new k/v
    mask: torch.Tensor | None  # [rows, queries, keys] bool; None: plain causal


@dataclass(slots=True)
class _ChunkPlan:
    """Keys of one multi-token chunk; its mask folded for the query heads on first use."""

    block_table: torch.Tensor | None  # [1, gathered_blocks]; None: keys are the chunk's own new k/v
    mask: torch.Tensor | None  # [1, n, keys] bool; None: plain causal over the chunk itself
    folded_mask: torch.Tensor | None = None  # [1, 1, n * queries_per_kv, keys], built by `fold_mask`

    def fold_mask(self, queries_per_kv: int) -> torch.Tensor:
        # Every layer of a group shares it: fold once per step, not per layer.
        if self.folded_mask is None:
            self.folded_mask = self.mask.repeat_interleave(queries_per_kv, dim=1).unsqueeze(1)
        return self.folded_mask


@dataclass(slots=True)
class _GroupStepData:
    write_block_ids: torch.Tensor  # [num_tokens] block id of each new token
    write_offsets: torch.Tensor  # [num_tokens] slot inside that block
    decode: DecodeRows | _GatherPlan | None  # all single-token chunks at once: in place, or gathered
    prefill: list[_ChunkPlan]  # one per multi-token chunk


def _key_window(spec: AttentionSpec, first_query: int, last_query: int, block_size: int) -> tuple[int, int]:
    """[first_block, last_block] the queries in [first_query, last_query] need."""
    return spec.needed_from(first_query) // block_size, last_query // block_size


def _mask(spec: AttentionSpec, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    allowed = k <= q
    if not isinstance(spec, FullAttentionSpec):
        allowed &= k > q - spec.window_tokens
    return allowed


def _gather_plan(
    spec: AttentionSpec, tables: Sequence[list[int]], queries: Sequence[range], block_size: int
) -> _GatherPlan:
    """One padded gather for several rows; row i has queries at positions queries[i]."""
    spans = [_key_window(spec, q.start, q.stop - 1, block_size) for q in queries]
    width = max(last - first + 1 for first, last in spans)
    table_rows, key_rows = [], []
    for (first, last), table in zip(spans, tables):
        row = table[first : last + 1]
        table_rows.append(row + [0] * (width - len(row)))
        key_rows.append(range(first * block_size, (first + width) * block_size))
    key_positions = torch.tensor(key_rows, dtype=torch.int64)
    query_positions = torch.tensor([list(q) for q in queries], dtype=torch.int64)
    # Padding blocks sit past the last query, so causality already hides them.
    return _GatherPlan(torch.tensor(table_rows, dtype=torch.int64), _mask(spec, query_positions, key_positions))


class PagedAttention:
    """`AttentionContext` over the paged pool for one step."""

    def __init__(
        self,
        plan: KVGroupPlan,
        layer_caches: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        chunks: Sequence[ScheduledChunk],
        block_size: int,
        device: torch.device,
    ):
        """`layer_caches[layer]` = (group_id, k_cache, v_cache), caches [num_blocks, block_size, kv_heads, head_dim].
        `chunks` must already be in flat-batch order (single-token chunks first)."""
        self.layer_caches = layer_caches
        self.num_decode = sum(1 for chunk in chunks if chunk.num_tokens == 1)
        self.prefill_chunks = list(chunks[self.num_decode :])
        attention_caches = [cache for cache in layer_caches if cache is not None]  # None: a recurrent-state layer
        dtype = attention_caches[0][1].dtype if attention_caches else torch.float32
        self.in_place_decode = uses_native_kernel(device, dtype)
        self.groups = [None if isinstance(group.spec, RecurrentStateSpec)
                       else self._build_group(group.group_id, group.spec, chunks, block_size, device)
                       for group in plan.groups]

    def _build_group(self, group_id, spec, chunks, block_size, device) -> _GroupStepData:
        write_blocks, write_offsets = [], []
        for chunk in chunks:
            table = chunk.block_ids[group_id]
            for position in range(chunk.start_position, chunk.end_position):
                write_blocks.append(table[position // block_size])
                write_offsets.append(position % block_size)
        to = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        decode_chunks = chunks[: self.num_decode]
        decode = None
        if decode_chunks and self.in_place_decode:
            decode = build_decode_rows(
                spec, [c.block_ids[group_id] for c in decode_chunks], [c.start_position for c in decode_chunks],
                block_size, device, include_query_key=True,
            )
        elif decode_chunks:
            gather = _gather_plan(spec, [c.block_ids[group_id] for c in decode_chunks],
                                  [range(c.start_position, c.end_position) for c in decode_chunks], block_size)
            decode = _GatherPlan(to(gather.block_table), to(gather.mask))
        prefill = [self._chunk_plan(spec, chunk, group_id, block_size) for chunk in self.prefill_chunks]
        return _GroupStepData(
            to(torch.tensor(write_blocks, dtype=torch.int64)),
            to(torch.tensor(write_offsets, dtype=torch.int64)),
            decode,
            [_ChunkPlan(to(p.block_table), to(p.mask)) for p in prefill],
        )

    @staticmethod
    def _chunk_plan(spec: AttentionSpec, chunk: ScheduledChunk, group_id: int, block_size: int) -> _ChunkPlan:
        if chunk.start_position > 0:
            positions = range(chunk.start_position, chunk.end_position)
            gather = _gather_plan(spec, [chunk.block_ids[group_id]], [positions], block_size)
            return _ChunkPlan(gather.block_table, gather.mask)
        # The chunk starts the sequence: its own new k/v are all the keys, no gather.
        if isinstance(spec, FullAttentionSpec):
            return _ChunkPlan(None, None)
        positions = torch.arange(chunk.num_tokens)
        return _ChunkPlan(None, _mask(spec, positions, positions).unsqueeze(0))

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        group_id, k_cache, v_cache = self.layer_caches[layer_id]
        data = self.groups[group_id]
        # The pool may hold a narrower dtype than the activations (--kv-cache-dtype): cast on store.
        k_cache[data.write_block_ids, data.write_offsets] = k.to(k_cache.dtype)
        v_cache[data.write_block_ids, data.write_offsets] = v.to(v_cache.dtype)
        out = torch.empty_like(q)
        if data.decode is not None:
            out[: self.num_decode] = self._attend_decode(q[: self.num_decode], k_cache, v_cache, data.decode, scale,
                                                         sinks)
        offset = self.num_decode
        for chunk, gather in zip(self.prefill_chunks, data.prefill):
            end = offset + chunk.num_tokens
            out[offset:end] = self._attend_chunk(q[offset:end], k[offset:end], v[offset:end], k_cache, v_cache, gather,
                                                 scale, sinks)
            offset = end
        return out

    @staticmethod
    def _attend_decode(q, k_cache, v_cache, rows: DecodeRows | _GatherPlan, scale: float,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        # The new keys were written above, so each row's range already ends at its own key.
        if isinstance(rows, DecodeRows):
            return attend_decode(q, k_cache, v_cache, rows, scale, sinks=sinks)
        # One query per row: fold the query heads that share a KV head into the
        # "query length" axis, so SDPA needs no GQA expansion of the keys.
        num_rows, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        keys = k_cache[rows.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [rows, kv_heads, L, dim]
        values = v_cache[rows.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        grouped_q = q.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = rows.mask.unsqueeze(1)
        if sinks is not None:  # row (kv head h, query j) is head h*g+j
            keys, values, mask = with_sink_column(keys, values, mask, sinks.view(1, num_kv_heads, -1, 1))
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(num_rows, num_heads, head_dim)

    @staticmethod
    def _attend_chunk(q, k, v, k_cache, v_cache, plan: _ChunkPlan, scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [n, heads, dim]; k, v: [n, kv_heads, dim] -> [n, heads, dim]."""
        num_queries, num_heads, _ = q.shape
        num_kv_heads = k.shape[1]
        queries_per_kv = num_heads // num_kv_heads
        if plan.mask is None:
            # Causal over the chunk's own n keys: repeating them per head costs
            # what q costs and keeps the call free of GQA for flash attention.
            keys = k.repeat_interleave(queries_per_kv, dim=1).transpose(0, 1).unsqueeze(0)
            values = v.repeat_interleave(queries_per_kv, dim=1).transpose(0, 1).unsqueeze(0)
            if sinks is None:
                out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                                     is_causal=True, scale=scale)
            else:
                causal = torch.ones(num_queries, num_queries, dtype=torch.bool, device=q.device).tril()
                keys, values, mask = with_sink_column(keys, values, causal, sinks.view(1, num_heads, 1, 1))
                out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                                     scale=scale)
            return out.squeeze(0).transpose(0, 1)
        if plan.block_table is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            keys = k_cache[plan.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [1, kv_heads, L, dim]
            values = v_cache[plan.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        folded_q = fold_query_heads(q, num_kv_heads)
        mask = plan.fold_mask(queries_per_kv)
        if sinks is not None:  # folded row i*g+j of KV head h is query i of head h*g+j
            per_row = sinks.view(num_kv_heads, 1, queries_per_kv).expand(-1, num_queries, -1)
            keys, values, mask = with_sink_column(keys, values, mask, per_row.reshape(1, num_kv_heads, -1, 1))
        out = F.scaled_dot_product_attention(folded_q, keys, values, attn_mask=mask, scale=scale)
        return unfold_query_heads(out, num_queries, num_heads)


def with_sink_column(keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                     sink_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values [b, h, L, d] with one zero key and value appended, and the float mask
    [b, h, rows, L + 1] that keeps `allowed` (bool, broadcastable to [b, h, rows, L]) and gives the
    extra column the logit `sink_logits` (broadcastable to [b, h, rows, 1]): q . 0 = 0, so that
    column's score is the sink itself, and its zero value adds nothing to the output."""
    batch, heads, _, head_dim = keys.shape
    rows = max(allowed.shape[-2], sink_logits.shape[-2])
    zeros = keys.new_zeros(batch, heads, 1, head_dim)
    keys, values = torch.cat([keys, zeros], dim=2), torch.cat([values, zeros], dim=2)
    shape = (batch, heads, rows, allowed.shape[-1])
    bias = torch.zeros(shape, dtype=keys.dtype, device=keys.device).masked_fill_(~allowed.expand(shape), float("-inf"))
    sink_column = sink_logits.to(keys.dtype).expand(batch, heads, rows, 1)
    return keys, values, torch.cat([bias, sink_column], dim=-1)


def fold_query_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, heads, dim] -> [1, kv_heads, n * heads/kv_heads, dim]: row i*g+j is query i of
    the j-th head sharing that KV head (heads are grouped as in GQA's repeat_interleave)."""
    num_queries, num_heads, head_dim = q.shape
    per_kv = num_heads // num_kv_heads
    return q.view(num_queries, num_kv_heads, per_kv, head_dim).transpose(0, 1).reshape(
        1, num_kv_heads, num_queries * per_kv, head_dim)


def unfold_query_heads(out: torch.Tensor, num_queries: int, num_heads: int) -> torch.Tensor:
    """Inverse of `fold_query_heads`: [1, kv_heads, n * g, dim] -> [n, heads, dim]."""
    num_kv_heads, head_dim = out.shape[1], out.shape[-1]
    per_kv = num_heads // num_kv_heads
    return out.view(num_kv_heads, num_queries, per_kv, head_dim).transpose(0, 1).reshape(
        num_queries, num_heads, head_dim)
