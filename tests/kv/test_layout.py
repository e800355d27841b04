"""KVPoolLayout: page geometry, per-layer views and the canonical byte view."""

from __future__ import annotations

import struct

import pytest
import torch

from pdserve.kv.layout import (KVPoolLayout, attention_layer_bytes, num_blocks_for_budget, page_bytes_for,
                               plan_page_bytes)
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, plan_groups


def small_layout(dtype: torch.dtype = torch.float16) -> KVPoolLayout:
    return KVPoolLayout(num_blocks=5, group_size=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)


def test_page_bytes_is_group_times_kv_times_tokens_times_heads_times_dim_times_element():
    layout = small_layout(torch.bfloat16)
    assert layout.page_bytes == 3 * 2 * 4 * 2 * 8 * 2 == 768
    assert layout.page_bytes == page_bytes_for(3, 4, 2, 8, torch.bfloat16)
    assert layout.shape == (5, 2, 3, 2, 4, 8)  # blocks, heads, slots, K/V, tokens, dim
    assert layout.pool_bytes == 5 * 768
    assert small_layout(torch.float32).page_bytes == 2 * layout.page_bytes


def test_allocated_pool_has_the_layout_shape_and_starts_zeroed():
    layout = small_layout()
    pool = layout.allocate("cpu")
    assert tuple(pool.shape) == layout.shape and pool.dtype == torch.float16 and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0


def test_canonical_view_shares_storage_without_copying():
    layout = small_layout()
    pool = layout.allocate("cpu")
    view = layout.canonical_view(pool)
    assert view.dtype == torch.int8 and tuple(view.shape) == (5, layout.page_bytes)
    assert view.data_ptr() == pool.data_ptr()
    assert view.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    view[2].fill_(1)  # writing a page through the byte view changes exactly that block
    assert torch.count_nonzero(pool[2]) == pool[2].numel()
    assert torch.count_nonzero(pool[1]) == 0 and torch.count_nonzero(pool[3]) == 0


def test_copying_one_canonical_row_moves_a_whole_block_between_pools():
    layout = small_layout()
    src, dst = layout.allocate("cpu"), layout.allocate("cpu")
    src.copy_(torch.randn(layout.shape, dtype=torch.float16))
    layout.canonical_view(dst)[4].copy_(layout.canonical_view(src)[1])  # one "descriptor"
    assert torch.equal(dst[4], src[1])


def test_byte_offsets_follow_block_head_slot_kv_token_order():
    layout = small_layout(torch.float32)
    pool = layout.allocate("cpu")
    k_cache, v_cache = layout.layer_view(pool, slot=2)
    v_cache[3, 1, 1].fill_(7.0)  # block 3, token 1, head 1 of slot 2's V
    offset = layout.byte_offset(block_id=3, slot=2, kv=1, token=1, head=1)
    raw = layout.canonical_view(pool).flatten()[offset : offset + 4 * layout.head_dim]
    assert torch.equal(raw.view(torch.float32), torch.full((layout.head_dim,), 7.0))
    assert layout.byte_offset(1, 0, 0, 0) == layout.page_bytes
    assert layout.byte_offset(0, 0, 0, 0, head=1) == layout.slab_bytes == layout.page_bytes // 2


def test_a_range_of_heads_is_one_contiguous_range_of_every_page_across_all_layers():
    layout = KVPoolLayout(num_blocks=3, group_size=3, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float32)
    pool = layout.allocate("cpu")
    for slot in range(layout.group_size):  # heads 1 and 2 of block 2, every layer, K and V
        k_cache, v_cache = layout.layer_view(pool, slot)
        k_cache[2, :, 1:3].fill_(1.0)
        v_cache[2, :, 1:3].fill_(1.0)
    offset, length = layout.head_range_bytes(1, 2)
    page = layout.canonical_view(pool)[2].view(torch.float32)
    start, stop = offset // 4, (offset + length) // 4
    assert torch.all(page[start:stop] == 1.0) and torch.count_nonzero(page) == stop - start
    with pytest.raises(ValueError):
        layout.head_range_bytes(3, 2)


def test_layer_views_alias_their_slot_of_every_block():
    layout = small_layout()
    pool = layout.allocate("cpu")
    k_cache, v_cache = layout.layer_view(pool, slot=1)
    assert tuple(k_cache.shape) == tuple(v_cache.shape) == (5, 4, 2, 8)
    k_cache[2, 3].fill_(1.0)
    v_cache[2, 3].fill_(2.0)
    assert torch.all(pool[2, :, 1, 0, 3] == 1.0) and torch.all(pool[2, :, 1, 1, 3] == 2.0)
    assert torch.count_nonzero(pool[:, :, 0]) == 0 and torch.count_nonzero(pool[:, :, 2]) == 0
    with pytest.raises(ValueError):
        layout.layer_view(pool, slot=3)


def test_views_reject_a_pool_of_another_geometry():
    layout = small_layout()
    with pytest.raises(ValueError):
        layout.canonical_view(torch.zeros((5, 3, 2, 4, 2, 4), dtype=torch.float16))
    with pytest.raises(ValueError):
        layout.canonical_view(layout.allocate("cpu").to(torch.float32))
    with pytest.raises(ValueError):
        layout.canonical_view(layout.allocate("cpu").transpose(3, 4).contiguous().transpose(3, 4))


def test_num_blocks_for_budget_counts_whole_pages():
    page_bytes = page_bytes_for(2, 16, 4, 64, torch.bfloat16)
    assert page_bytes == 2 * 2 * 16 * 4 * 64 * 2
    assert num_blocks_for_budget(10 * page_bytes + page_bytes - 1, page_bytes) == 10
    with pytest.raises(ValueError):
        num_blocks_for_budget(page_bytes, page_bytes)  # the null block alone is useless


def test_layout_rejects_impossible_geometry():
    with pytest.raises(ValueError):
        KVPoolLayout(num_blocks=1, group_size=1, block_size=16, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError):
        KVPoolLayout(num_blocks=4, group_size=0, block_size=16, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError):
        KVPoolLayout(num_blocks=4, group_size=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32")


# ---- state pages and padded pages ----------------------------------------------------------

STATE = RecurrentStateSpec("gated_delta_net", conv_channels=3, conv_window=2, recurrent_shape=(2, 3, 4))  # 120 bytes


def state_plan(attention_layer_bytes: int):
    """2 full-attention layers and 3 state layers (float32 state of 120 bytes)."""
    return plan_groups([STATE, FullAttentionSpec(), STATE, STATE, FullAttentionSpec()], attention_layer_bytes)


def padded_layout(plan) -> KVPoolLayout:
    return KVPoolLayout(num_blocks=4, group_size=plan.group_size, block_size=2, num_kv_heads=2, head_dim=2,
                        dtype=torch.bfloat16, padded_page_bytes=plan.padded_page_bytes)


def test_without_padding_the_pool_is_the_attention_tensor_and_state_slots_are_views_over_it():
    attention_layer_bytes = 2 * 2 * 2 * 2 * 2  # K and V, 2 tokens, 2 heads, 2 dims, bf16 = 32 bytes
    plan = state_plan(attention_layer_bytes * 8)  # pretend larger layers: attention page 512 bytes holds 3 states
    layout = KVPoolLayout(num_blocks=4, group_size=2, block_size=16, num_kv_heads=2, head_dim=2, dtype=torch.bfloat16)
    assert layout.page_bytes == plan.geometry.page_bytes == 512 and not layout.is_padded
    pool = layout.allocate("cpu")
    assert tuple(pool.shape) == (4, 2, 2, 2, 16, 2) and pool.dtype == torch.bfloat16
    group = plan.groups[plan.state_group_ids[0]]
    assert len(group.layer_ids) == 3
    covered = covered_bytes(layout, pool, [t for slot in range(3) for t in layout.state_views(pool, group, slot)])
    assert torch.all(covered[:, :360]) and not torch.any(covered[:, 360:])
    for slot in range(3):
        conv, recurrent = layout.state_views(pool, group, slot)
        conv[2].fill_(slot + 1.0)
        recurrent[2].fill_(slot + 10.0)
    page = layout.canonical_view(pool)[2].view(torch.float32)
    expected = torch.cat([torch.cat([torch.full((6,), s + 1.0), torch.full((24,), s + 10.0)]) for s in range(3)])
    assert torch.equal(page[:90], expected) and torch.count_nonzero(page[90:]) == 0
    assert torch.count_nonzero(layout.canonical_view(pool)[[0, 1, 3]]) == 0


def test_a_padded_pool_is_bytes_and_attention_views_address_the_first_kv_page_bytes_of_each_page():
    plan = state_plan(32)  # attention page 64 bytes < 120: pages grow to 256
    layout = padded_layout(plan)
    assert layout.page_bytes == 256 and layout.is_padded and layout.kv_page_bytes == 64
    pool = layout.allocate("cpu")
    assert tuple(pool.shape) == (4, 256) and pool.dtype == torch.int8
    k_cache, v_cache = layout.layer_view(pool, slot=1)
    assert tuple(k_cache.shape) == (4, 2, 2, 2) and k_cache.dtype == torch.bfloat16
    v_cache[3, 1, 1].fill_(7.0)  # block 3, token 1, head 1 of slot 1's V
    offset = layout.byte_offset(block_id=3, slot=1, kv=1, token=1, head=1)
    flat = layout.canonical_view(pool).flatten()
    assert torch.equal(flat[offset:offset + 4].view(torch.bfloat16), torch.full((2,), 7.0, dtype=torch.bfloat16))
    assert torch.count_nonzero(flat) == 4 and 3 * 256 <= offset < 3 * 256 + 64


# Values none of whose bytes is zero, so a write shows in every byte it touches.
ALL_BYTES_SET = {torch.bfloat16: 1.0078125, torch.float32: struct.unpack("<f", bytes([1, 1, 0x81, 0x3F]))[0]}


def covered_bytes(layout: KVPoolLayout, pool: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
    """Which bytes of each page the views address, checking no two of them share a byte."""
    bytes_view = layout.canonical_view(pool)
    covered = torch.zeros_like(bytes_view, dtype=torch.bool)
    for number, view in enumerate(views):
        view.fill_(ALL_BYTES_SET[view.dtype])
        touched = bytes_view != 0
        assert not torch.any(covered & touched), f"view {number} overlaps another"
        covered |= touched
        bytes_view.zero_()
    return covered


def test_the_views_of_one_group_address_disjoint_ranges_of_every_page_within_its_data():
    plan = state_plan(32)
    layout = padded_layout(plan)
    pool = layout.allocate("cpu")
    attention = [t for slot in range(layout.group_size) for t in layout.layer_view(pool, slot)]
    covered = covered_bytes(layout, pool, attention)
    assert torch.all(covered[:, :layout.kv_page_bytes]) and not torch.any(covered[:, layout.kv_page_bytes:])
    for group_id in plan.state_group_ids:  # a page belongs to one group at a time: groups alias the same bytes
        group = plan.groups[group_id]
        views = [t for slot in range(len(group.layer_ids)) for t in layout.state_views(pool, group, slot)]
        covered = covered_bytes(layout, pool, views)
        data_bytes = len(group.layer_ids) * STATE.state_bytes
        assert torch.all(covered[:, :data_bytes]) and not torch.any(covered[:, data_bytes:])


def test_state_views_follow_the_page_diagram_conv_window_then_recurrent_state():
    plan = state_plan(32)
    layout = padded_layout(plan)
    pool = layout.allocate("cpu")
    group = plan.groups[plan.state_group_ids[1]]
    conv, recurrent = layout.state_views(pool, group, 0)
    assert tuple(conv.shape) == (4, 3, 2) and tuple(recurrent.shape) == (4, 2, 3, 4)
    assert conv.dtype == recurrent.dtype == torch.float32
    conv[1] = torch.arange(6, dtype=torch.float32).view(3, 2)
    recurrent[1] = torch.arange(24, dtype=torch.float32).view(2, 3, 4) + 100
    page = layout.canonical_view(pool)[1].view(torch.float32)
    assert torch.equal(page[:30], torch.cat([torch.arange(6.0), torch.arange(24.0) + 100]))
    assert torch.count_nonzero(layout.canonical_view(pool)[[0, 2, 3]]) == 0
    with pytest.raises(ValueError):
        layout.state_views(pool, group, 1)  # one layer per state group here
    with pytest.raises(ValueError):
        layout.state_views(pool, plan.groups[0], 0)  # not a state group


def test_a_padded_layout_rejects_a_page_smaller_than_the_attention_page():
    with pytest.raises(ValueError):
        KVPoolLayout(num_blocks=4, group_size=2, block_size=2, num_kv_heads=2, head_dim=2, dtype=torch.bfloat16,
                     padded_page_bytes=32)


def test_the_plan_helpers_give_the_padded_page_to_sizing_and_to_the_layout():
    layer_bytes = attention_layer_bytes(block_size=2, num_kv_heads=2, head_dim=2, dtype=torch.bfloat16)
    assert layer_bytes == 32
    plan = state_plan(layer_bytes)
    assert plan_page_bytes(plan, 2, 2, 2, torch.bfloat16) == 256
    layout = KVPoolLayout.for_plan(plan, 10, 2, 2, 2, torch.bfloat16)
    assert layout.page_bytes == 256 and layout.kv_page_bytes == 64
    assert num_blocks_for_budget(10 * 256, plan_page_bytes(plan, 2, 2, 2, torch.bfloat16)) == 10
    unpadded = plan_groups([FullAttentionSpec()] * 2)
    assert plan_page_bytes(unpadded, 2, 2, 2, torch.bfloat16) == page_bytes_for(2, 2, 2, 2, torch.bfloat16)
    assert KVPoolLayout.for_plan(unpadded, 10, 2, 2, 2, torch.bfloat16) == KVPoolLayout(10, 2, 2, 2, 2, torch.bfloat16)
