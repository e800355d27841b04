"""KVPoolLayout: page geometry, per-layer views and the canonical byte view."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout, num_blocks_for_budget, page_bytes_for


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
