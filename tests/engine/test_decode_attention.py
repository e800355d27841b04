"""Decode attention over the paged pool: the native kernel and the sliced torch path against a
dense reference, for full and sliding-window layers, with and without the row's own new key;
and the torch path's workspace bounded by its slice size whatever the context length."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.runner.decode_attention import attend_decode, attend_decode_torch, build_decode_rows, plan_slices
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from tests.models.test_quantized_blocks import require_native_kernels

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 6, 16, 96


def _pool(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as strided views of one pool, like the runner's layer views."""
    pool = torch.randn(NUM_BLOCKS, 3, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    return pool[:, 1, 0], pool[:, 1, 1]


def _tables(lengths: list[int], seed: int = 1) -> list[list[int]]:
    order = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    tables, used = [], 0
    for length in lengths:
        count = math.ceil(length / BLOCK_SIZE)
        tables.append(order[used : used + count])
        used += count
    return tables


def _dense(q, k_cache, v_cache, tables, positions, spec, scale, k_new=None, v_new=None):
    """Reference: gather each row's keys one by one, plain softmax."""
    outputs = []
    for row, (table, position) in enumerate(zip(tables, positions)):
        last = position + 1 if k_new is None else position
        keys = [k_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(spec.needed_from(position), last)]
        values = [v_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(spec.needed_from(position), last)]
        if k_new is not None:
            keys.append(k_new[row])
            values.append(v_new[row])
        keys = torch.stack(keys).repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, heads, dim]
        values = torch.stack(values).repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[row], keys) * scale
        outputs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), values))
    return torch.stack(outputs)


CASES = [
    (FullAttentionSpec(), [1, 7, 30, 61]),
    (SlidingWindowSpec(6), [1, 5, 13, 40]),  # rows inside and far past the window
]


@pytest.mark.parametrize("spec, lengths", CASES)
@pytest.mark.parametrize("with_new_key", [False, True])
@pytest.mark.parametrize("path", ["native", "torch", "torch in slices of 2 blocks"])
def test_decode_attention_matches_a_dense_reference(spec, lengths, with_new_key, path):
    if path == "native":
        require_native_kernels()
    k_cache, v_cache = _pool()
    positions = [n - 1 for n in lengths]
    tables = _tables(lengths)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    k_new = torch.randn(len(lengths), KV_HEADS, HEAD_DIM) if with_new_key else None
    v_new = torch.randn(len(lengths), KV_HEADS, HEAD_DIM) if with_new_key else None
    rows = build_decode_rows(spec, tables, positions, BLOCK_SIZE, torch.device("cpu"), include_query_key=not with_new_key)
    if path == "native":
        out = attend_decode(q, k_cache, v_cache, rows, 0.3, k_new, v_new, native=True)
    else:
        out = attend_decode_torch(q, k_cache, v_cache, rows, 0.3, k_new, v_new, slice_blocks=2 if "slices" in path else 64)
    expected = _dense(q, k_cache, v_cache, tables, positions, spec, 0.3, k_new, v_new)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_rows_carry_only_the_blocks_of_their_window():
    tables = [list(range(1, 11))]  # 40 positions
    rows = build_decode_rows(SlidingWindowSpec(6), tables, [39], BLOCK_SIZE, torch.device("cpu"), include_query_key=True)
    assert rows.block_table.tolist() == [[9, 10]]  # keys 34..39 lie in blocks 8 and 9 (ids 9, 10)
    assert (rows.starts, rows.ends) == ([2], [8])


def test_slices_hold_only_the_rows_that_reach_them():
    short, long = (0, 3), (0, 4 * 40)
    slices = plan_slices([short[0], long[0]], [short[1], long[1]], BLOCK_SIZE, slice_blocks=8)
    assert [s.row_ids for s in slices] == [(0, 1)] + [(1,)] * 4
    assert all(s.num_columns == 8 for s in slices)
    assert plan_slices([5], [5], BLOCK_SIZE) == []  # a row with no cached key joins no slice


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.max_bytes = max(self.max_bytes, value.numel() * value.element_size())
        return out


@pytest.mark.parametrize("context_tokens", [64, 360])
def test_torch_decode_workspace_is_bounded_by_the_slice_and_results_are_unchanged(context_tokens):
    k_cache, v_cache = _pool(seed=3)
    lengths = [context_tokens, 5, 9]  # one long row must not make the short ones pad to it
    tables = _tables(lengths, seed=4)
    positions = [n - 1 for n in lengths]
    rows = build_decode_rows(FullAttentionSpec(), tables, positions, BLOCK_SIZE, torch.device("cpu"), include_query_key=True)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    slice_blocks = 4
    with _LargestTensor() as sliced:
        out = attend_decode_torch(q, k_cache, v_cache, rows, 0.25, slice_blocks=slice_blocks)
    with _LargestTensor() as whole:
        reference = attend_decode_torch(q, k_cache, v_cache, rows, 0.25, slice_blocks=1000)
    bound = len(lengths) * slice_blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4  # one slice of gathered K
    assert sliced.max_bytes <= bound
    assert whole.max_bytes > bound  # without slices the gather grows with the longest row
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _dense(q, k_cache, v_cache, tables, positions, FullAttentionSpec(), 0.25),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (1, 1, 128), (2, 4, 80), (2, 2, 12)])
@pytest.mark.parametrize("lengths", [[1500], [1, 9, 700, 1500]])  # one long row is split among threads
@pytest.mark.parametrize("spec", [FullAttentionSpec(), SlidingWindowSpec(300)])
@pytest.mark.parametrize("with_new_key", [False, True])
def test_native_decode_attention_over_long_contexts_and_every_head_shape(kv_heads, group, head_dim, lengths, spec,
                                                                         with_new_key):
    """Model-sized heads (vector paths and their scalar tails), contexts of many key tiles, and
    the key ranges split among threads and merged, against a float64 softmax."""
    require_native_kernels()
    block_size, heads = 16, kv_heads * group
    num_blocks = sum(math.ceil(n / block_size) for n in lengths) + 1
    generator = torch.Generator().manual_seed(head_dim + len(lengths))
    pool = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=generator)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    order = torch.randperm(num_blocks - 1, generator=generator).add(1).tolist()
    tables, used = [], 0
    for length in lengths:
        count = math.ceil(length / block_size)
        tables.append(order[used : used + count])
        used += count
    positions = [n - 1 for n in lengths]
    q = torch.randn(len(lengths), heads, head_dim, generator=generator)
    k_new = torch.randn(len(lengths), kv_heads, head_dim, generator=generator) if with_new_key else None
    v_new = torch.randn(len(lengths), kv_heads, head_dim, generator=generator) if with_new_key else None
    rows = build_decode_rows(spec, tables, positions, block_size, torch.device("cpu"), include_query_key=not with_new_key)
    out = attend_decode(q, k_cache, v_cache, rows, head_dim**-0.5, k_new, v_new, native=True)
    for row, (table, position) in enumerate(zip(tables, positions)):
        last = position if with_new_key else position + 1
        keys = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(spec.needed_from(position), last)]
                           + ([k_new[row]] if with_new_key else []))
        values = torch.stack([v_cache[table[p // block_size], p % block_size] for p in range(spec.needed_from(position), last)]
                             + ([v_new[row]] if with_new_key else []))
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row].double(), keys) * head_dim**-0.5, -1)
        torch.testing.assert_close(out[row].double(), torch.einsum("hl,lhd->hd", weights, values), rtol=1e-5, atol=1e-5)
