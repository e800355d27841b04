"""BlockPool: reference counts, free list, prefix-cache map and LRU eviction."""

from __future__ import annotations

import pytest

from pdserve.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVInvariantError, NoFreeBlocks
from pdserve.kv.hashing import hash_block_tokens


def key(n: int) -> bytes:
    return hash_block_tokens(None, [n])


def snapshot(pool: BlockPool) -> tuple:
    return (
        pool.num_free_blocks, pool.num_in_use, pool.num_cached_free, pool.num_uncached_free, pool.num_cached,
        [pool.ref_count(b) for b in range(1, pool.num_blocks)],
        [pool.owner(b) for b in range(1, pool.num_blocks)],
    )


def test_new_pool_has_every_block_but_the_null_block_free():
    pool = BlockPool(8)
    pool.check_invariants()
    assert pool.num_free_blocks == 7 == pool.num_uncached_free
    assert pool.num_in_use == pool.num_cached_free == 0


def test_pool_rejects_fewer_than_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_null_block_is_never_allocated():
    pool = BlockPool(6)
    block_ids = pool.allocate(5, group_id=0)
    pool.check_invariants()
    assert sorted(block_ids) == [1, 2, 3, 4, 5]
    assert NULL_BLOCK_ID not in block_ids
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1, group_id=0)
    pool.check_invariants()


def test_null_block_cannot_be_freed_touched_or_cached():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free([NULL_BLOCK_ID])
    with pytest.raises(ValueError):
        pool.touch([NULL_BLOCK_ID], 0)
    with pytest.raises(ValueError):
        pool.cache(NULL_BLOCK_ID, key(1), 0)
    pool.check_invariants()
    assert pool.num_free_blocks == 3


def test_allocate_and_free_track_refs_owner_and_counters():
    pool = BlockPool(8)
    a = pool.allocate(3, group_id=1)
    pool.check_invariants()
    assert all(pool.ref_count(b) == 1 and pool.owner(b) == 1 for b in a)
    assert pool.num_in_use == 3 and pool.num_in_use_by_group(1) == 3 and pool.num_free_blocks == 4
    pool.free(a)
    pool.check_invariants()
    assert pool.num_in_use == 0 and pool.num_in_use_by_group(1) == 0 and pool.num_uncached_free == 7
    assert all(pool.owner(b) is None for b in a)


def test_touch_adds_a_reference_that_needs_its_own_free():
    pool = BlockPool(4)
    (block,) = pool.allocate(1, group_id=0)
    pool.touch([block], 0)
    pool.check_invariants()
    assert pool.ref_count(block) == 2
    pool.free([block])
    pool.check_invariants()
    assert pool.ref_count(block) == 1 and pool.num_in_use == 1
    pool.free([block])
    pool.check_invariants()
    assert pool.ref_count(block) == 0 and pool.num_in_use == 0


def test_free_of_unreferenced_block_is_rejected_without_change():
    pool = BlockPool(6)
    a, b = pool.allocate(2, group_id=0)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free([a, b, b])  # b has one ref but is freed twice
    pool.check_invariants()
    assert snapshot(pool) == before


def test_touch_rejects_wrong_group_and_free_uncached_blocks_without_change():
    pool = BlockPool(6)
    a, b = pool.allocate(2, group_id=0)
    pool.free([b])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.touch([a], group_id=1)
    with pytest.raises(ValueError):
        pool.touch([a, b], group_id=0)  # b is free and uncached: its content is gone
    pool.check_invariants()
    assert snapshot(pool) == before


def test_freed_cached_block_stays_findable_until_evicted():
    pool = BlockPool(4)
    (block,) = pool.allocate(1, group_id=0)
    assert pool.cache(block, key(1), 0)
    pool.free([block])
    pool.check_invariants()
    assert pool.lookup(key(1), 0) == block
    assert pool.num_cached_free == 1 and pool.num_free_blocks == 3
    pool.touch([block], 0)  # a prefix hit revives it
    pool.check_invariants()
    assert pool.ref_count(block) == 1 and pool.num_cached_free == 0


def test_allocate_prefers_uncached_free_blocks_over_cached_ones():
    pool = BlockPool(5)
    cached = pool.allocate(2, group_id=0)
    for i, block in enumerate(cached):
        pool.cache(block, key(i), 0)
    pool.free(cached)
    pool.check_invariants()
    fresh = pool.allocate(2, group_id=0)
    pool.check_invariants()
    assert not set(fresh) & set(cached)
    assert pool.lookup(key(0), 0) == cached[0] and pool.lookup(key(1), 0) == cached[1]


def test_lru_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3, group_id=0)
    for i, block in enumerate((a, b, c)):
        pool.cache(block, key(i), 0)
    pool.free([c, a])
    pool.free([b])
    pool.check_invariants()
    assert pool.allocate(1, group_id=0) == [c]
    pool.check_invariants()
    assert pool.lookup(key(2), 0) is None and pool.is_cached(c) is False
    assert pool.allocate(1, group_id=1) == [a]
    pool.check_invariants()
    assert pool.lookup(key(0), 0) is None and pool.owner(a) == 1
    assert pool.lookup(key(1), 0) == b


def test_touching_a_cached_free_block_removes_it_from_the_lru():
    pool = BlockPool(3)
    a, b = pool.allocate(2, group_id=0)
    pool.cache(a, key(0), 0)
    pool.cache(b, key(1), 0)
    pool.free([a, b])
    pool.touch([a], 0)
    pool.check_invariants()
    assert pool.allocate(1, group_id=0) == [b]
    pool.check_invariants()
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1, group_id=0)
    assert pool.lookup(key(0), 0) == a


def test_no_free_blocks_leaves_state_intact():
    pool = BlockPool(6)
    a = pool.allocate(2, group_id=0)
    pool.cache(a[0], key(0), 0)
    pool.free(a)
    pool.allocate(1, group_id=1)
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5, group_id=2)
    pool.check_invariants()
    assert snapshot(pool) == before
    assert pool.lookup(key(0), 0) == a[0]


def test_duplicate_cache_key_leaves_the_second_block_uncached():
    pool = BlockPool(4)
    first, second = pool.allocate(2, group_id=0)
    assert pool.cache(first, key(7), 0) is True
    assert pool.cache(second, key(7), 0) is False
    pool.check_invariants()
    assert pool.lookup(key(7), 0) == first and not pool.is_cached(second)
    pool.free([second])
    pool.check_invariants()
    assert pool.num_uncached_free == 2 and pool.num_cached_free == 0


def test_cache_key_includes_the_group():
    pool = BlockPool(4)
    a = pool.allocate(1, group_id=0)[0]
    b = pool.allocate(1, group_id=1)[0]
    assert pool.cache(a, key(3), 0) and pool.cache(b, key(3), 1)
    pool.check_invariants()
    assert pool.lookup(key(3), 0) == a and pool.lookup(key(3), 1) == b
    with pytest.raises(ValueError):
        pool.cache(a, key(4), 1)  # a belongs to group 0
    with pytest.raises(ValueError):
        pool.cache(a, key(4), 0)  # a already holds another hash


def test_cache_rejects_a_free_block():
    pool = BlockPool(3)
    (block,) = pool.allocate(1, group_id=0)
    pool.free([block])
    with pytest.raises(ValueError):
        pool.cache(block, key(0), 0)
    pool.check_invariants()


def test_evicted_block_changes_owner_when_reallocated_to_another_group():
    pool = BlockPool(2)
    (block,) = pool.allocate(1, group_id=0)
    pool.cache(block, key(0), 0)
    pool.free([block])
    assert pool.owner(block) == 0
    assert pool.allocate(1, group_id=3) == [block]
    pool.check_invariants()
    assert pool.owner(block) == 3 and pool.num_in_use_by_group(0) == 0 and pool.num_in_use_by_group(3) == 1


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda pool, b: pool._ref_counts.__setitem__(b, -1), id="negative-ref"),
        pytest.param(lambda pool, b: pool._free_ids.append(b), id="free-and-in-use"),
        pytest.param(lambda pool, b: pool._cached_ids.__setitem__((key(9), 0), b), id="hash-map-inconsistent"),
        pytest.param(lambda pool, b: pool._owners.__setitem__(b, 5), id="owned-by-two-groups"),
        pytest.param(lambda pool, b: pool._free_ids.append(NULL_BLOCK_ID), id="null-block-freed"),
    ],
)
def test_check_invariants_detects_corruption(corrupt):
    pool = BlockPool(4)
    (block,) = pool.allocate(1, group_id=0)
    pool.cache(block, key(0), 0)
    pool.check_invariants()
    corrupt(pool, block)
    with pytest.raises(KVInvariantError):
        pool.check_invariants()
