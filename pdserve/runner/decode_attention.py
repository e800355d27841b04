"""Attention of single-token queries over the paged pool, read in place.

Each decode row brings its block table (clipped to the blocks its keys lie in) and the range
of key positions it sees, relative to that table. The native CPU kernel walks the pages the
table names and allocates nothing that grows with the context; the torch path (other devices,
no kernel) gathers at most `DECODE_SLICE_BLOCKS` blocks per row at a time and merges the
slices with an online softmax, so its workspace is bounded too. Invariant: a row attends to
exactly the keys [key_start, key_end) of its table, plus its own new key when one is given.
Attention sinks (one logit per query head, gpt-oss) join every path's softmax denominator and
weigh no value: the online softmax starts from them, the kernel folds them in last.

    a row at position 13, block_size 4, window 6: needs keys 8..13
      block table [0 | 17 | 42 | 9]  ->  clipped table [42 | 9] (first block 2)
      key_start = 8 - 2*4 = 0, key_end = 14 - 2*4 = 6  (relative to the clipped table)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.kv.specs import AttentionSpec

DECODE_SLICE_BLOCKS = 64  # the torch path gathers at most this many blocks per row and call


@dataclass(slots=True)
class DecodeRows:
    """Where each decode row's keys are: device tensors for the kernels, host lists for planning."""

    block_table: torch.Tensor  # int32 [rows, width], null block (0) past a row's own blocks
    key_start: torch.Tensor  # int32 [rows]
    key_end: torch.Tensor  # int32 [rows], exclusive
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)


def build_decode_rows(
    spec: AttentionSpec, tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int,
    device: torch.device, include_query_key: bool, min_width: int = 1,
) -> DecodeRows:
    """Rows for queries at `positions`: keys from `spec.needed_from(p)` up to p (inclusive when the
    query's own key is already in the pool, exclusive when it is passed to `attend_decode` apart).
    The table is at least `min_width` columns wide (null blocks pad it)."""
    rows, starts, ends = [], [], []
    for table, position in zip(tables, positions):
        first_block = spec.needed_from(position) // block_size
        end = position + 1 if include_query_key else position
        last_block = max(first_block, (max(end, 1) - 1) // block_size)
        rows.append(list(table[first_block : last_block + 1]))
        starts.append(spec.needed_from(position) - first_block * block_size)
        ends.append(max(end - first_block * block_size, starts[-1]))
    width = max(min_width, max(len(row) for row in rows))
    padded = [row + [0] * (width - len(row)) for row in rows]
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return DecodeRows(as_int32(padded), as_int32(starts), as_int32(ends), starts, ends)


# Pool element types the native kernel reads in place (16-bit ones widened in registers).
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def uses_native_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention over a pool of `dtype` on this device runs the native kernel (for
    float32 queries; `attend_decode` sends other queries to the torch path)."""
    return device.type == "cpu" and dtype in NATIVE_KV_DTYPES and cpu_kernels_available()


def attend_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows, scale: float,
    k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None, native: Optional[bool] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [rows, heads, dim]; caches [blocks, block_size, kv_heads, dim]; k_new, v_new
    [rows, kv_heads, dim] or None; sinks float32 [heads] or None. Returns [rows, heads, dim].
    `native` (decided once by the caller, so that compiled code holds no such check) defaults
    to `uses_native_kernel`; queries other than float32 take the torch path either way."""
    if native is None:
        native = uses_native_kernel(q.device, k_cache.dtype)
    if native and q.dtype == torch.float32:
        return ops().paged_decode_attention(q, k_cache, v_cache, rows.block_table, rows.key_start, rows.key_end,
                                            k_new, v_new, scale, sinks)
    return attend_decode_torch(q, k_cache, v_cache, rows, scale, k_new, v_new, sinks=sinks)


@dataclass(frozen=True, slots=True)
class DecodeSlice:
    """Table columns [first_column, first_column + num_columns) for the rows that have keys there."""

    row_ids: tuple[int, ...]
    first_column: int
    num_columns: int


def plan_slices(starts: Sequence[int], ends: Sequence[int], block_size: int,
                slice_blocks: int = DECODE_SLICE_BLOCKS) -> list[DecodeSlice]:
    """Cut the rows' key ranges into column slices; a row joins only the slices its keys reach,
    so a short row never pays for a long one's padding beyond one slice."""
    spans = [(s // block_size, (e - 1) // block_size) for s, e in zip(starts, ends) if e > s]
    if not spans:
        return []
    slices = []
    for first in range(min(f for f, _ in spans), max(last for _, last in spans) + 1, slice_blocks):
        last = first + slice_blocks - 1
        members = tuple(r for r, (s, e) in enumerate(zip(starts, ends))
                        if e > s and s // block_size <= last and (e - 1) // block_size >= first)
        if members:
            slices.append(DecodeSlice(members, first, slice_blocks))
    return slices


class _OnlineSoftmax:
    """Running max, sum and weighted values per (row, kv head, query head), merged slice by slice."""

    def __init__(self, rows: int, kv_heads: int, group: int, head_dim: int, device: torch.device,
                 sinks: Optional[torch.Tensor] = None):
        """`sinks` [kv_heads * group]: each head starts as if it had seen one key of that logit
        and a zero value, which is what an attention sink is."""
        self.acc = torch.zeros(rows, kv_heads, group, head_dim, dtype=torch.float32, device=device)
        if sinks is None:
            self.max = torch.full((rows, kv_heads, group), float("-inf"), device=device)
            self.sum = torch.zeros(rows, kv_heads, group, device=device)
        else:
            self.max = sinks.float().reshape(1, kv_heads, group).repeat(rows, 1, 1)
            self.sum = torch.ones(rows, kv_heads, group, device=device)

    def merge_slice(self, index: torch.Tensor, scores: torch.Tensor, values: torch.Tensor) -> None:
        """scores [r, kv_heads, group, L] (every row sees at least one key); values [r, kv_heads, L, dim]."""
        old_max = self.max[index]
        new_max = torch.maximum(old_max, scores.amax(-1))
        correction = torch.exp(old_max - new_max)
        weights = torch.exp(scores - new_max.unsqueeze(-1))
        self.sum[index] = self.sum[index] * correction + weights.sum(-1)
        self.acc[index] = self.acc[index] * correction.unsqueeze(-1) + weights @ values
        self.max[index] = new_max

    def result(self) -> torch.Tensor:
        return self.acc / self.sum.unsqueeze(-1)


def attend_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows, scale: float,
    k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None,
    slice_blocks: int = DECODE_SLICE_BLOCKS, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    grouped_q = q.reshape(num_rows, num_kv_heads, group, head_dim).float()
    state = _OnlineSoftmax(num_rows, num_kv_heads, group, head_dim, q.device, sinks)
    key_start, key_end = rows.key_start.long(), rows.key_end.long()
    for part in plan_slices(rows.starts, rows.ends, block_size, slice_blocks):
        index = torch.tensor(part.row_ids, dtype=torch.int64).to(q.device, non_blocking=True)
        columns = slice(part.first_column, part.first_column + part.num_columns)
        table = rows.block_table[index, columns].long()  # [r, n]; past the table's width: fewer columns
        keys = k_cache[table].flatten(1, 2).transpose(1, 2).float()  # [r, kv_heads, L, dim]
        values = v_cache[table].flatten(1, 2).transpose(1, 2).float()
        positions = part.first_column * block_size + torch.arange(keys.shape[2], device=q.device)
        visible = (positions >= key_start[index, None]) & (positions < key_end[index, None])  # [r, L]
        scores = (grouped_q[index] @ keys.transpose(-1, -2)) * scale
        state.merge_slice(index, scores.masked_fill(~visible[:, None, None, :], float("-inf")), values)
    if k_new is not None and v_new is not None:
        every_row = torch.arange(num_rows, device=q.device)
        own_scores = (grouped_q * k_new.float().unsqueeze(2)).sum(-1, keepdim=True) * scale  # [R, kv, group, 1]
        state.merge_slice(every_row, own_scores, v_new.float().unsqueeze(2))
    return state.result().reshape(num_rows, num_heads, head_dim).to(q.dtype)


def attend_decode_static(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows, scale: float,
    k_new: torch.Tensor, v_new: torch.Tensor, slice_blocks: int = DECODE_SLICE_BLOCKS,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The torch path over tensors only, for graphs with fixed shapes (CUDA graphs): every row
    walks every column slice of the table, masked, so the slices are known at trace time; the
    workspace stays one slice. Needs the rows' own new keys, so that no row sees nothing."""
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    grouped_q = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    every_row = torch.arange(num_rows, device=q.device)
    state = _OnlineSoftmax(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim, q.device, sinks)
    own_scores = (grouped_q * k_new.float().unsqueeze(2)).sum(-1, keepdim=True) * scale
    state.merge_slice(every_row, own_scores, v_new.float().unsqueeze(2))  # first, so every row's max is finite
    key_start, key_end = rows.key_start.long()[:, None], rows.key_end.long()[:, None]
    for first_column in range(0, rows.block_table.shape[1], slice_blocks):
        table = rows.block_table[:, first_column : first_column + slice_blocks].long()
        keys = k_cache[table].flatten(1, 2).transpose(1, 2).float()
        values = v_cache[table].flatten(1, 2).transpose(1, 2).float()
        positions = first_column * block_size + torch.arange(keys.shape[2], device=q.device)
        visible = (positions >= key_start) & (positions < key_end)
        scores = (grouped_q @ keys.transpose(-1, -2)) * scale
        state.merge_slice(every_row, scores.masked_fill(~visible[:, None, None, :], float("-inf")), values)
    return state.result().reshape(num_rows, num_heads, head_dim).to(q.dtype)
