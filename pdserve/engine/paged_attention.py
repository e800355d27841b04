"""Attention that reads and writes K/V straight from the paged block pool.

Built once per step from the scheduled chunks, then called by every layer.
Invariant: a query at position p sees exactly the keys its layer's spec allows
(causal, same request, inside the sliding window); stale data in null or
padding blocks is always masked out.

Token order in the flat batch: single-token chunks first (one decode attention
call for all of them, reading the pages in place: see decode_attention.py),
then each multi-token chunk.

    block table of one request, one group (block_size = 4, window = 6):
      positions  0..3   4..7   8..11  12..15
      table     [  0  |  17  |  42  |  9   ]   0 = null (slid out of the window)
    a query at position 13 needs keys 8..13 -> gather blocks [42, 9], keys at
    positions 8..15, mask keeps 8..13.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.decode_attention import DecodeRows, attend_decode, build_decode_rows
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.specs import AttentionSpec, FullAttentionSpec, KVGroupPlan


@dataclass(slots=True)
class _GatherPlan:
    """Which blocks to gather for a set of queries and which keys they may see."""

    block_table: torch.Tensor | None  # [rows, gathered_blocks]; None: keys are the chunk's own new k/v
    mask: torch.Tensor | None  # [rows, queries, keys] bool; None: plain causal


@dataclass(slots=True)
class _GroupStepData:
    write_block_ids: torch.Tensor  # [num_tokens] block id of each new token
    write_offsets: torch.Tensor  # [num_tokens] slot inside that block
    decode: DecodeRows | None  # all single-token chunks at once
    prefill: list[_GatherPlan]  # one per multi-token chunk


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
        self.groups = [self._build_group(group.group_id, group.spec, chunks, block_size, device) for group in plan.groups]

    def _build_group(self, group_id, spec, chunks, block_size, device) -> _GroupStepData:
        write_blocks, write_offsets = [], []
        for chunk in chunks:
            table = chunk.block_ids[group_id]
            for position in range(chunk.start_position, chunk.end_position):
                write_blocks.append(table[position // block_size])
                write_offsets.append(position % block_size)
        decode_chunks = chunks[: self.num_decode]
        decode = None
        if decode_chunks:
            decode = build_decode_rows(
                spec, [c.block_ids[group_id] for c in decode_chunks], [c.start_position for c in decode_chunks],
                block_size, device, include_query_key=True,
            )
        prefill = [self._chunk_plan(spec, chunk, group_id, block_size) for chunk in self.prefill_chunks]
        to = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return _GroupStepData(
            to(torch.tensor(write_blocks, dtype=torch.int64)),
            to(torch.tensor(write_offsets, dtype=torch.int64)),
            decode,
            [_GatherPlan(to(p.block_table), to(p.mask)) for p in prefill],
        )

    @staticmethod
    def _chunk_plan(spec: AttentionSpec, chunk: ScheduledChunk, group_id: int, block_size: int) -> _GatherPlan:
        if chunk.start_position > 0:
            positions = range(chunk.start_position, chunk.end_position)
            return _gather_plan(spec, [chunk.block_ids[group_id]], [positions], block_size)
        # The chunk starts the sequence: its own new k/v are all the keys, no gather.
        if isinstance(spec, FullAttentionSpec):
            return _GatherPlan(None, None)
        positions = torch.arange(chunk.num_tokens)
        return _GatherPlan(None, _mask(spec, positions, positions).unsqueeze(0))

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        group_id, k_cache, v_cache = self.layer_caches[layer_id]
        data = self.groups[group_id]
        k_cache[data.write_block_ids, data.write_offsets] = k
        v_cache[data.write_block_ids, data.write_offsets] = v
        out = torch.empty_like(q)
        if data.decode is not None:
            out[: self.num_decode] = self._attend_decode(q[: self.num_decode], k_cache, v_cache, data.decode, scale)
        offset = self.num_decode
        for chunk, gather in zip(self.prefill_chunks, data.prefill):
            end = offset + chunk.num_tokens
            out[offset:end] = self._attend_chunk(q[offset:end], k[offset:end], v[offset:end], k_cache, v_cache, gather, scale)
            offset = end
        return out

    @staticmethod
    def _attend_decode(q, k_cache, v_cache, rows: DecodeRows, scale: float) -> torch.Tensor:
        # The new keys were written above, so each row's range already ends at its own key.
        return attend_decode(q, k_cache, v_cache, rows, scale)

    @staticmethod
    def _attend_chunk(q, k, v, k_cache, v_cache, gather: _GatherPlan, scale: float) -> torch.Tensor:
        q_heads = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if gather.block_table is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            keys = k_cache[gather.block_table].flatten(1, 2).transpose(1, 2)
            values = v_cache[gather.block_table].flatten(1, 2).transpose(1, 2)
        if gather.mask is None:
            kwargs = {"is_causal": True}
        else:
            kwargs = {"attn_mask": gather.mask.unsqueeze(1)}
        out = F.scaled_dot_product_attention(q_heads, keys, values, scale=scale, enable_gqa=True, **kwargs)
        return out.squeeze(0).transpose(0, 1)
