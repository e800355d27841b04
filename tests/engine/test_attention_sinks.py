"""Attention sinks (gpt-oss) in every attention path: prefill chunks over the paged pool, decode rows
read in place by the native kernel, the sliced torch path, the fixed-shape (CUDA-graph) path and the
gathered SDPA path, each against a dense float64 reference in which the sink is one more logit per
head that weighs no value. Full and sliding-window layers alike."""

from __future__ import annotations

import pytest
import torch

import pdserve.runner.paged_attention as paged_attention
from pdserve.runner.decode_attention import (
    attend_decode, attend_decode_static, attend_decode_torch, build_decode_rows,
)
from pdserve.runner.paged_attention import PagedAttention
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from tests.engine.test_decode_attention import BLOCK_SIZE as ROW_BLOCK_SIZE
from tests.engine.test_decode_attention import HEAD_DIM as ROW_HEAD_DIM
from tests.engine.test_decode_attention import HEADS as ROW_HEADS
from tests.engine.test_decode_attention import KV_HEADS as ROW_KV_HEADS
from tests.engine.test_decode_attention import _pool, _tables
from tests.engine.test_paged_attention import (
    BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SPECS, RequestKV, _caches, _chunk, _store,
)
from tests.models.test_quantized_blocks import require_native_kernels


def _sinks(num_heads: int, seed: int = 3) -> torch.Tensor:
    # Large enough that a path which dropped them would miss the tolerance by far.
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def _attend_with_sink(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q_row [heads, dim], keys/values [L, heads, dim] -> [heads, dim], float64, sink as an extra logit."""
    scores = torch.einsum("hd,khd->hk", q_row.double(), keys.double()) * scale
    with_sink = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
    return torch.einsum("hk,khd->hd", with_sink.softmax(-1)[:, :-1], values.double())


def _reference(q: torch.Tensor, seq: RequestKV, positions: range, spec, scale: float, sinks) -> torch.Tensor:
    per_kv = NUM_HEADS // NUM_KV_HEADS
    keys = seq.k.repeat_interleave(per_kv, dim=1)
    values = seq.v.repeat_interleave(per_kv, dim=1)
    rows = []
    for row, position in enumerate(positions):
        first = spec.needed_from(position)
        rows.append(_attend_with_sink(q[row], keys[first : position + 1], values[first : position + 1], sinks, scale))
    return torch.stack(rows)


@pytest.mark.parametrize("spec_name", ["full", "sliding"])
@pytest.mark.parametrize("decode_path", ["in place", "gathered"])
def test_paged_chunks_with_sinks_match_dense_attention(device, spec_name, decode_path, monkeypatch):
    if decode_path == "gathered":  # the path CUDA and bf16 take: one padded gather, one SDPA call
        monkeypatch.setattr(paged_attention, "uses_native_kernel", lambda device, dtype: False)
    spec = SPECS[spec_name]
    generator = torch.Generator().manual_seed(1)
    k_cache, v_cache = _caches(device)
    continued = RequestKV("continued", [21, 3, 17, 4, 9, 30, 12], 27, generator)
    if spec_name == "sliding":
        continued.table = [0, 0, 17, 4, 9, 30, 12]
    fresh = RequestKV("fresh", [5, 6, 7, 8], 13, generator)  # starts its sequence: the unmasked causal call
    decoding = RequestKV("decoding", [11, 2, 25], 10, generator)
    _store(k_cache, v_cache, continued, range(0, 14), device)
    _store(k_cache, v_cache, decoding, range(0, 9), device)
    work = [(decoding, range(9, 10)), (continued, range(14, 27)), (fresh, range(0, 13))]
    chunks = [_chunk(seq, span.start, span.stop) for seq, span in work]
    attention = PagedAttention(plan_groups([spec]), [(0, k_cache, v_cache)], chunks, BLOCK_SIZE, torch.device(device))
    queries = [torch.randn(len(span), NUM_HEADS, HEAD_DIM, generator=generator) for _, span in work]
    q = torch.cat(queries).to(device)
    k = torch.cat([seq.k[span.start : span.stop] for seq, span in work]).to(device)
    v = torch.cat([seq.v[span.start : span.stop] for seq, span in work]).to(device)
    sinks = _sinks(NUM_HEADS)
    scale = HEAD_DIM ** -0.5
    out = attention.attend(0, q, k, v, scale, sinks=sinks.to(device)).cpu()
    offset = 0
    for (seq, span), q_rows in zip(work, queries):
        expected = _reference(q_rows, seq, span, spec, scale, sinks)
        torch.testing.assert_close(out[offset : offset + len(span)].double(), expected, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{seq.name}: {m}")
        offset += len(span)


def _dense_rows(q, k_cache, v_cache, tables, positions, spec, scale, k_new, v_new, sinks):
    per_kv = ROW_HEADS // ROW_KV_HEADS
    out = []
    for row, (table, position) in enumerate(zip(tables, positions)):
        span = range(spec.needed_from(position), position)
        keys = [k_cache[table[p // ROW_BLOCK_SIZE], p % ROW_BLOCK_SIZE] for p in span] + [k_new[row]]
        values = [v_cache[table[p // ROW_BLOCK_SIZE], p % ROW_BLOCK_SIZE] for p in span] + [v_new[row]]
        keys = torch.stack(keys).repeat_interleave(per_kv, dim=1)
        values = torch.stack(values).repeat_interleave(per_kv, dim=1)
        out.append(_attend_with_sink(q[row], keys, values, sinks, scale))
    return torch.stack(out)


@pytest.mark.parametrize("spec, lengths", [(FullAttentionSpec(), [1, 7, 30, 300]),
                                           (SlidingWindowSpec(6), [1, 5, 13, 40])])
@pytest.mark.parametrize("path", ["native", "torch", "torch in slices of 2 blocks", "static"])
def test_decode_rows_with_sinks_match_a_dense_reference(spec, lengths, path):
    """300 keys split a row over several threads in the kernel: the sink is folded in once, after
    the splits merge, not once per split."""
    if path == "native":
        require_native_kernels()
    k_cache, v_cache = _pool()
    if max(lengths) > 200:  # a longer pool for the long row
        k_cache = torch.randn(100, ROW_BLOCK_SIZE, ROW_KV_HEADS, ROW_HEAD_DIM)
        v_cache = torch.randn(100, ROW_BLOCK_SIZE, ROW_KV_HEADS, ROW_HEAD_DIM)
        order = torch.randperm(99, generator=torch.Generator().manual_seed(2)).add(1).tolist()
        counts = [-(-n // ROW_BLOCK_SIZE) for n in lengths]
        tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(lengths))]
    else:
        tables = _tables(lengths)
    positions = [n - 1 for n in lengths]
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(len(lengths), ROW_HEADS, ROW_HEAD_DIM, generator=generator)
    k_new = torch.randn(len(lengths), ROW_KV_HEADS, ROW_HEAD_DIM, generator=generator)
    v_new = torch.randn(len(lengths), ROW_KV_HEADS, ROW_HEAD_DIM, generator=generator)
    rows = build_decode_rows(spec, tables, positions, ROW_BLOCK_SIZE, torch.device("cpu"), include_query_key=False)
    sinks = _sinks(ROW_HEADS)
    if path == "native":
        out = attend_decode(q, k_cache, v_cache, rows, 0.3, k_new, v_new, native=True, sinks=sinks)
    elif path == "static":
        out = attend_decode_static(q, k_cache, v_cache, rows, 0.3, k_new, v_new, slice_blocks=2, sinks=sinks)
    else:
        out = attend_decode_torch(q, k_cache, v_cache, rows, 0.3, k_new, v_new,
                                  slice_blocks=2 if "slices" in path else 64, sinks=sinks)
    expected = _dense_rows(q, k_cache, v_cache, tables, positions, spec, 0.3, k_new, v_new, sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    without = attend_decode_torch(q, k_cache, v_cache, rows, 0.3, k_new, v_new)
    assert (without.double() - expected).abs().max() > 1e-2  # the sinks matter for these inputs
