"""Paged attention against a dense reference, and the shape of its SDPA calls.

Every SDPA call must be one that CUDA's flash or memory-efficient kernel can
take: no `enable_gqa` (the memory-efficient kernel has no GQA, and flash takes
no mask), so query heads are folded per KV head. On CPU the tests check the
values and the call shapes; on CUDA they also forbid the math kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.api.sampling import SamplingParams
from pdserve.runner.decode_attention import uses_native_kernel
from pdserve.runner.paged_attention import PagedAttention, fold_query_heads, unfold_query_heads
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from tests.devices import cuda_available

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 2, 16, 4, 40
SPECS = {"full": FullAttentionSpec(), "sliding": SlidingWindowSpec(window_tokens=6)}


def test_folded_masked_call_equals_the_unfolded_gqa_call(device):
    generator = torch.Generator().manual_seed(0)
    num_queries, num_keys = 11, 29
    q = torch.randn(num_queries, NUM_HEADS, HEAD_DIM, generator=generator).to(device)
    keys = torch.randn(1, NUM_KV_HEADS, num_keys, HEAD_DIM, generator=generator).to(device)
    values = torch.randn(1, NUM_KV_HEADS, num_keys, HEAD_DIM, generator=generator).to(device)
    mask = torch.rand(1, num_queries, num_keys, generator=generator) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    mask = mask.to(device)
    unfolded = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                              attn_mask=mask.unsqueeze(1), enable_gqa=True)
    per_kv = NUM_HEADS // NUM_KV_HEADS
    folded = F.scaled_dot_product_attention(fold_query_heads(q, NUM_KV_HEADS), keys, values,
                                            attn_mask=mask.repeat_interleave(per_kv, dim=1).unsqueeze(1))
    expected = unfolded.squeeze(0).transpose(0, 1)
    torch.testing.assert_close(unfold_query_heads(folded, num_queries, NUM_HEADS), expected, rtol=1e-5, atol=1e-5)


# ---- PagedAttention over a real pool ----------------------------------------------------------


class RequestKV:
    """One request's keys and values at every position, and the block table holding them."""

    def __init__(self, name: str, table: list[int], num_positions: int, generator: torch.Generator):
        self.name = name
        self.table = table
        self.k = torch.randn(num_positions, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        self.v = torch.randn(num_positions, NUM_KV_HEADS, HEAD_DIM, generator=generator)


def _caches(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    layout = KVPoolLayout(NUM_BLOCKS, 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    pool = layout.allocate(device)
    # Garbage everywhere (null block included): whatever a mask hides must not matter.
    pool.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(7)) * 100)
    return layout.layer_view(pool, 0)


def _store(k_cache, v_cache, seq: RequestKV, positions: range, device: str) -> None:
    for position in positions:
        block = seq.table[position // BLOCK_SIZE]
        k_cache[block, position % BLOCK_SIZE] = seq.k[position].to(device)
        v_cache[block, position % BLOCK_SIZE] = seq.v[position].to(device)


def _reference(q: torch.Tensor, seq: RequestKV, positions: range, spec, scale: float) -> torch.Tensor:
    """Dense float64 attention of queries at `positions` over the request's own keys."""
    per_kv = NUM_HEADS // NUM_KV_HEADS
    keys = seq.k.double().repeat_interleave(per_kv, dim=1)  # [positions, heads, dim]
    values = seq.v.double().repeat_interleave(per_kv, dim=1)
    out = torch.empty(len(positions), NUM_HEADS, HEAD_DIM, dtype=torch.float64)
    for row, position in enumerate(positions):
        first = spec.needed_from(position)
        scores = torch.einsum("hd,khd->hk", q[row].double(), keys[first : position + 1]) * scale
        out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first : position + 1])
    return out


def _chunk(seq: RequestKV, start: int, end: int) -> ScheduledChunk:
    return ScheduledChunk(seq.name, list(range(start, end)), start, (seq.table,), sample=False,
                          sampling=SamplingParams())


@pytest.mark.parametrize("spec_name", ["full", "sliding"])
def test_paged_chunks_match_dense_attention_over_prefix_continuation_and_fresh_starts(device, spec_name):
    spec = SPECS[spec_name]
    generator = torch.Generator().manual_seed(1)
    k_cache, v_cache = _caches(device)
    # Null entries where a sliding window no longer needs the block, as the manager leaves them.
    continued = RequestKV("continued", [0, 0, 17, 4, 9, 30, 12], 27, generator)
    if spec_name == "full":
        continued.table = [21, 3, 17, 4, 9, 30, 12]
    fresh = RequestKV("fresh", [5, 6, 7, 8], 13, generator)
    decoding = RequestKV("decoding", [11, 2, 25], 10, generator)
    # Already in the pool: 14 prefix tokens (a prefix-cache hit or an earlier chunk), 9 decoded tokens.
    _store(k_cache, v_cache, continued, range(0, 14), device)
    _store(k_cache, v_cache, decoding, range(0, 9), device)
    # Flat-batch order: single-token chunks first.
    work = [(decoding, range(9, 10)), (continued, range(14, 27)), (fresh, range(0, 13))]
    chunks = [_chunk(seq, span.start, span.stop) for seq, span in work]
    plan = plan_groups([spec])
    attention = PagedAttention(plan, [(0, k_cache, v_cache)], chunks, BLOCK_SIZE, torch.device(device))
    queries = [torch.randn(len(span), NUM_HEADS, HEAD_DIM, generator=generator) for _, span in work]
    q = torch.cat(queries).to(device)
    k = torch.cat([seq.k[span.start : span.stop] for seq, span in work]).to(device)
    v = torch.cat([seq.v[span.start : span.stop] for seq, span in work]).to(device)
    scale = HEAD_DIM ** -0.5
    out = attention.attend(0, q, k, v, scale).cpu()
    offset = 0
    for (seq, span), q_rows in zip(work, queries):
        got = out[offset : offset + len(span)]
        torch.testing.assert_close(got.double(), _reference(q_rows, seq, span, spec, scale), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{seq.name}: {m}")
        offset += len(span)


@pytest.mark.parametrize("spec_name", ["full", "sliding"])
def test_no_sdpa_call_needs_gqa(device, spec_name, monkeypatch):
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((query.shape, key.shape, kwargs))
        return real_sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    test_paged_chunks_match_dense_attention_over_prefix_continuation_and_fresh_starts(device, spec_name)
    in_place = uses_native_kernel(torch.device(device), torch.float32)
    assert len(calls) == (2 if in_place else 3)  # two chunks, and the decode batch unless it reads pages in place
    for query_shape, key_shape, kwargs in calls:
        assert not kwargs.get("enable_gqa", False), kwargs
        assert query_shape[1] == key_shape[1], (query_shape, key_shape)  # heads match: no GQA needed
        assert not (kwargs.get("is_causal") and kwargs.get("attn_mask") is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec_name", ["full", "sliding"])
def test_cuda_chunks_run_without_the_math_kernel(spec_name):
    """With the math kernel switched off, a call that needed it would raise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        test_paged_chunks_match_dense_attention_over_prefix_continuation_and_fresh_starts("cuda", spec_name)
