"""KVCacheManager: per-group tables, sliding-window release, prefix hits, rollback."""

from __future__ import annotations

import math

import pytest

from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager, StalePrefixHit
from pdserve.kv.prefix import PrefixHit
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups

BS = 4  # small blocks keep the expected tables readable
FULL, SLIDING = 0, 1  # group ids of hybrid_manager's plan


def full_manager(num_blocks: int, **kwargs) -> KVCacheManager:
    return KVCacheManager(plan_groups([FullAttentionSpec()] * 2), num_blocks, BS, **kwargs)


def hybrid_manager(num_blocks: int, window_tokens: int = 8) -> KVCacheManager:
    manager = KVCacheManager(plan_groups([SlidingWindowSpec(window_tokens), FullAttentionSpec()]), num_blocks, BS)
    assert isinstance(manager.plan.groups[FULL].spec, FullAttentionSpec)
    assert isinstance(manager.plan.groups[SLIDING].spec, SlidingWindowSpec)
    return manager


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run(manager: KVCacheManager, request_id: str, token_ids: list[int], chunk: int | None = None,
        prefix: PrefixHit | None = None) -> list[bytes]:
    """Compute a prompt chunk by chunk (allocate, then commit), checking invariants after each step."""
    hashes = hash_full_blocks(token_ids, BS, [])
    computed = prefix.num_tokens if prefix else 0
    while computed < len(token_ids):
        num_new = min(chunk or len(token_ids), len(token_ids) - computed)
        assert manager.allocate_slots(request_id, computed, num_new, prefix if computed == prefix_tokens(prefix) else None)
        manager.check_invariants()
        computed += num_new
        manager.commit(request_id, hashes, computed)
        manager.check_invariants()
    return hashes


def prefix_tokens(prefix: PrefixHit | None) -> int:
    return prefix.num_tokens if prefix else 0


def evict(manager: KVCacheManager, tables: tuple[list[int], ...], victims: set[int]) -> None:
    """Evict exactly `victims` among the cached free blocks of `tables`: pin the
    others (a pin is a touch), drain the pool, then let everything go."""
    pool = manager.pool
    pinned = [(b, g) for g, ids in enumerate(tables) for b in ids
              if b != NULL_BLOCK_ID and b not in victims and pool.ref_count(b) == 0 and pool.is_cached(b)]
    for block_id, group_id in pinned:
        pool.touch([block_id], group_id)
    drained = pool.allocate(pool.num_free_blocks, group_id=0)
    pool.free(drained)
    pool.free([block_id for block_id, _ in pinned])
    manager.check_invariants()
    assert not any(pool.is_cached(b) for b in victims)


# ---- allocation -------------------------------------------------------------------------


def test_allocate_grows_each_table_to_cover_the_token_slots():
    manager = hybrid_manager(num_blocks=20, window_tokens=64)
    assert manager.num_blocks_needed("a", 0, 10) == 6
    assert manager.allocate_slots("a", 0, 10)
    manager.check_invariants()
    assert [len(t) for t in manager.block_ids("a")] == [3, 3]
    assert manager.num_blocks_needed("a", 10, 2) == 0
    assert manager.allocate_slots("a", 10, 2)  # 12 slots still fit 3 blocks
    manager.check_invariants()
    assert manager.allocate_slots("a", 12, 1)
    manager.check_invariants()
    assert manager.num_blocks_held("a", FULL) == manager.num_blocks_held("a", SLIDING) == 4
    assert manager.pool.num_in_use == 8 and manager.num_free_blocks == 11


def test_free_releases_every_block_and_unknown_ids_are_ignored():
    manager = hybrid_manager(num_blocks=20)
    run(manager, "a", tokens(10))
    manager.free("a")
    manager.check_invariants()
    manager.free("a")
    manager.free("never-seen")
    manager.check_invariants()
    assert manager.pool.num_in_use == 0 and manager.num_free_blocks == 19
    assert manager.block_ids("a") == ([], []) and not manager.has_request("a")


def test_usage_by_group_is_the_fraction_of_usable_blocks_held():
    manager = hybrid_manager(num_blocks=11, window_tokens=64)
    assert manager.allocate_slots("a", 0, 8)
    assert manager.allocate_slots("b", 0, 4)
    manager.check_invariants()
    assert manager.usage_by_group() == pytest.approx([0.3, 0.3])


def test_num_computed_tokens_cannot_go_back():
    manager = full_manager(num_blocks=10)
    assert manager.allocate_slots("a", 0, 8)
    assert manager.allocate_slots("a", 8, 1)
    with pytest.raises(ValueError):
        manager.allocate_slots("a", 4, 1)
    with pytest.raises(ValueError):
        manager.allocate_slots("a", 9, -1)
    manager.check_invariants()


def test_allocation_failure_changes_nothing():
    manager = full_manager(num_blocks=6)
    run(manager, "a", tokens(12))
    before = (manager.block_ids("a"), manager.num_free_blocks, manager.pool.num_cached)
    assert not manager.can_allocate_slots("b", 0, 12)
    assert not manager.allocate_slots("b", 0, 12)  # needs 3 blocks, 2 free
    manager.check_invariants()
    assert not manager.has_request("b") and manager.block_ids("b") == ([],)
    assert not manager.allocate_slots("a", 12, 12)  # growth of a running request
    manager.check_invariants()
    assert (manager.block_ids("a"), manager.num_free_blocks, manager.pool.num_cached) == before
    assert manager.allocate_slots("a", 12, 8)  # what does fit still works
    manager.check_invariants()


def test_failed_allocation_still_releases_blocks_that_left_the_window():
    manager = hybrid_manager(num_blocks=11, window_tokens=8)
    run(manager, "a", tokens(16))  # one chunk: nothing released yet, 8 blocks held
    assert manager.num_blocks_held("a", SLIDING) == 4
    full_before = manager.block_ids("a")[FULL]
    assert not manager.can_allocate_slots("a", 16, 16)
    assert not manager.allocate_slots("a", 16, 16)
    manager.check_invariants()
    full_after, sliding_after = manager.block_ids("a")
    assert full_after == full_before
    assert sliding_after[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]  # the token at 16 reads keys 9..16
    assert manager.num_free_blocks == 4


# ---- sliding window ----------------------------------------------------------------------


def test_sliding_group_releases_blocks_outside_window_as_decoding_advances():
    window = 8
    manager = hybrid_manager(num_blocks=40, window_tokens=window)
    seq = tokens(8)
    hashes = run(manager, "a", seq)
    for step in range(40):
        computed = len(seq)
        seq.append(1000 + step)
        assert manager.allocate_slots("a", computed, 1)
        manager.check_invariants()
        hashes = hash_full_blocks(seq, BS, hashes)
        manager.commit("a", hashes, computed + 1)
        manager.check_invariants()
        full, sliding = manager.block_ids("a")
        first_live = max(0, computed - window + 1) // BS
        assert all(b == NULL_BLOCK_ID for b in sliding[:first_live])
        assert all(b != NULL_BLOCK_ID for b in sliding[first_live:])
        assert manager.num_blocks_held("a", SLIDING) <= math.ceil(window / BS) + 1
        assert manager.num_blocks_held("a", FULL) == len(full) == math.ceil((computed + 1) / BS)
    # Released blocks were committed first: they wait in the LRU for a future hit.
    num_released = manager.num_blocks_held("a", FULL) - manager.num_blocks_held("a", SLIDING)
    assert manager.pool.num_cached_free == num_released


def test_gemma3_like_long_request_holds_few_blocks_in_each_sliding_group():
    window, block_size = 512, 16
    specs = [FullAttentionSpec() if (i + 1) % 6 == 0 else SlidingWindowSpec(window) for i in range(26)]
    plan = plan_groups(specs)
    full_ids = [g.group_id for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
    sliding_ids = [g.group_id for g in plan.groups if isinstance(g.spec, SlidingWindowSpec)]
    assert (plan.group_size, len(full_ids), len(sliding_ids)) == (4, 1, 6)
    manager = KVCacheManager(plan, num_blocks=800, block_size=block_size)
    seq = [(7 * i) % 5000 for i in range(4096)]
    hashes: list[bytes] = []
    chunk = 512
    for computed in range(0, 4096, chunk):
        assert manager.allocate_slots("long", computed, chunk)
        manager.check_invariants()
        hashes = hash_full_blocks(seq[: computed + chunk], block_size, hashes)
        manager.commit("long", hashes, computed + chunk)
        for g in sliding_ids:  # a chunk needs its own keys plus one window before it
            assert manager.num_blocks_held("long", g) <= math.ceil((window - 1 + chunk) / block_size) + 1
    for step in range(32):
        computed = len(seq)
        seq.append(step)
        assert manager.allocate_slots("long", computed, 1)
        manager.check_invariants()
        full_held = manager.num_blocks_held("long", full_ids[0])
        assert full_held == math.ceil((computed + 1) / block_size)
        for g in sliding_ids:
            assert 32 <= manager.num_blocks_held("long", g) <= math.ceil(window / block_size) + 1
    usage = manager.usage_by_group()
    assert all(usage[g] * 7 < usage[full_ids[0]] for g in sliding_ids)


def test_live_block_ids_clip_sliding_groups_to_the_window_of_a_position():
    manager = hybrid_manager(num_blocks=20, window_tokens=8)
    run(manager, "a", tokens(20))  # one chunk: every block still held
    full, sliding = manager.block_ids("a")
    live_full, live_sliding = manager.live_block_ids("a", 19)  # the token at 19 reads keys 12..19
    assert live_full == full
    assert live_sliding == [0, 0, 0] + sliding[3:]
    assert manager.block_ids("a") == (full, sliding)  # a view, not a release


# ---- prefix cache --------------------------------------------------------------------------


def test_full_attention_prefix_hit_reuses_committed_blocks():
    manager = full_manager(num_blocks=20)
    prompt = tokens(17)
    hashes = run(manager, "a", prompt)
    a_blocks = manager.block_ids("a")[0]
    manager.free("a")
    manager.check_invariants()
    hit = manager.find_prefix(hashes, len(prompt))
    assert hit.num_tokens == 16 and hit.block_ids == (tuple(a_blocks[:4]),)
    assert manager.allocate_slots("b", 16, 1, hit)
    manager.check_invariants()
    assert manager.block_ids("b")[0][:4] == a_blocks[:4]
    assert manager.num_blocks_held("b", 0) == 5
    stats = manager.prefix_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (1, 17, 16)


def test_prefix_hit_never_covers_the_whole_prompt():
    manager = full_manager(num_blocks=20)
    prompt = tokens(16)
    hashes = run(manager, "a", prompt)
    manager.free("a")
    assert manager.find_prefix(hashes, 16).num_tokens == 12  # the last token needs its logits
    assert manager.find_prefix(hashes, 1).num_tokens == 0
    assert manager.find_prefix(hashes[:2], 16).num_tokens == 8  # no more than the hashes given
    manager.check_invariants()


def test_prefix_hit_stops_at_the_first_divergent_block():
    manager = full_manager(num_blocks=20)
    run(manager, "a", tokens(16))
    other = tokens(8) + [99] + tokens(11, start=9)
    hit = manager.find_prefix(hash_full_blocks(other, BS, []), len(other))
    assert hit.num_tokens == 8
    assert hit.block_ids == (tuple(manager.block_ids("a")[0][:2]),)


def test_shared_prefix_blocks_are_ref_counted_across_requests():
    manager = full_manager(num_blocks=20)
    hashes = run(manager, "a", tokens(12))
    shared = manager.block_ids("a")[0]
    hit = manager.find_prefix(hash_full_blocks(tokens(16), BS, []), 16)
    assert hit.num_tokens == 12
    assert manager.allocate_slots("b", 12, 4, hit)
    manager.check_invariants()
    assert [manager.pool.ref_count(b) for b in shared] == [2, 2, 2]
    manager.free("a")
    manager.check_invariants()
    assert [manager.pool.ref_count(b) for b in shared] == [1, 1, 1] and manager.pool.num_cached_free == 0
    manager.free("b")
    manager.check_invariants()
    assert manager.pool.num_in_use == 0 and manager.pool.num_cached_free == 3
    assert manager.find_prefix(hashes, 13).num_tokens == 12


def test_commit_registers_only_full_computed_blocks_once():
    manager = full_manager(num_blocks=20)
    seq = tokens(10)
    hashes = hash_full_blocks(seq, BS, [])
    assert manager.allocate_slots("a", 0, 10)
    manager.commit("a", hashes, 6)  # block 1 is not yet computed
    manager.check_invariants()
    assert manager.pool.num_cached == 1
    manager.commit("a", hashes, 10)
    manager.commit("a", hashes, 10)
    manager.commit("unknown", hashes, 10)
    manager.check_invariants()
    assert manager.pool.num_cached == 2  # block 2 is partial, never hashed


def test_duplicate_content_from_a_concurrent_request_stays_uncached():
    manager = full_manager(num_blocks=20)
    run(manager, "a", tokens(8))
    run(manager, "b", tokens(8))  # computed the same blocks without a hit
    assert manager.pool.num_cached == 2
    manager.free("b")
    manager.check_invariants()
    assert manager.pool.num_uncached_free == 19 - 2 and manager.pool.num_cached_free == 0


def test_sliding_group_missing_old_blocks_still_hits():
    manager = hybrid_manager(num_blocks=40, window_tokens=8)
    run(manager, "a", tokens(24))  # one chunk: no window release, tables complete
    tables = manager.block_ids("a")
    manager.free("a")
    evict(manager, tables, victims=set(tables[SLIDING][:4]))
    prompt = tokens(28)
    hit = manager.find_prefix(hash_full_blocks(prompt, BS, []), len(prompt))
    assert hit.num_tokens == 24  # the token at 24 only reads keys 17..24: blocks 4 and 5
    assert hit.block_ids[FULL] == tuple(tables[FULL])
    assert hit.block_ids[SLIDING] == (0, 0, 0, 0) + tuple(tables[SLIDING][4:])
    assert manager.allocate_slots("b", 24, 4, hit)
    manager.check_invariants()
    assert manager.num_blocks_held("b", SLIDING) == 3 and manager.num_blocks_held("b", FULL) == 7


def test_sliding_group_missing_a_block_inside_the_window_limits_the_hit():
    manager = hybrid_manager(num_blocks=40, window_tokens=8)
    run(manager, "a", tokens(24))  # one chunk: no window release, tables complete
    tables = manager.block_ids("a")
    manager.free("a")
    evict(manager, tables, victims={tables[SLIDING][5]})
    prompt = tokens(28)
    hit = manager.find_prefix(hash_full_blocks(prompt, BS, []), len(prompt))
    # 24 would need sliding blocks 4 and 5; 20 needs blocks 3 and 4 (keys 13..20).
    assert hit.num_tokens == 20
    assert hit.block_ids[FULL] == tuple(tables[FULL][:5])
    assert hit.block_ids[SLIDING] == (0, 0, 0) + tuple(tables[SLIDING][3:5])


def test_full_group_missing_a_block_limits_the_hit_of_every_group():
    manager = hybrid_manager(num_blocks=40, window_tokens=8)
    run(manager, "a", tokens(24))  # one chunk: no window release, tables complete
    tables = manager.block_ids("a")
    manager.free("a")
    evict(manager, tables, victims={tables[FULL][2]})
    prompt = tokens(28)
    hit = manager.find_prefix(hash_full_blocks(prompt, BS, []), len(prompt))
    assert hit.num_tokens == 8
    assert hit.block_ids == (tuple(tables[FULL][:2]), tuple(tables[SLIDING][:2]))


def test_prefix_blocks_in_the_lru_are_not_evicted_to_feed_their_own_request():
    manager = full_manager(num_blocks=5)
    run(manager, "a", tokens(12))
    manager.free("a")
    prompt = tokens(20)
    hit = manager.find_prefix(hash_full_blocks(prompt, BS, []), len(prompt))
    assert hit.num_tokens == 12 and manager.num_free_blocks == 4
    assert not manager.can_allocate_slots("b", 12, 8, hit)  # 3 of the 4 free blocks are the prefix
    assert not manager.allocate_slots("b", 12, 8, hit)
    manager.check_invariants()
    assert manager.pool.num_cached_free == 3 and not manager.has_request("b")
    assert manager.can_allocate_slots("b", 12, 4, hit)
    assert manager.allocate_slots("b", 12, 4, hit)
    manager.check_invariants()
    assert manager.block_ids("b")[0][:3] == list(hit.block_ids[0]) and manager.num_free_blocks == 0


def test_stale_prefix_hit_is_rejected_without_change():
    manager = full_manager(num_blocks=4)
    run(manager, "a", tokens(12))
    manager.free("a")
    hit = manager.find_prefix(hash_full_blocks(tokens(16), BS, []), 16)
    assert hit.num_tokens == 12
    assert manager.allocate_slots("c", 0, 1)  # evicts a's last block
    manager.check_invariants()
    before = (manager.num_free_blocks, manager.pool.num_cached)
    with pytest.raises(StalePrefixHit):
        manager.allocate_slots("b", 12, 4, hit)
    with pytest.raises(StalePrefixHit):  # a hit without hashes is checked by ownership
        manager.allocate_slots("b", 12, 4, PrefixHit(12, hit.block_ids))
    manager.check_invariants()
    assert (manager.num_free_blocks, manager.pool.num_cached) == before and not manager.has_request("b")


def test_prefix_may_not_exceed_computed_tokens_and_only_applies_on_admission():
    manager = full_manager(num_blocks=20)
    run(manager, "a", tokens(12))
    hit = manager.find_prefix(hash_full_blocks(tokens(16), BS, []), 16)
    with pytest.raises(ValueError):
        manager.allocate_slots("b", 8, 8, hit)
    with pytest.raises(ValueError):
        manager.allocate_slots("b", 12, 4, PrefixHit(12, hit.block_ids, hit.block_hashes[:1]))
    assert manager.allocate_slots("b", 12, 1, hit)
    with pytest.raises(ValueError):
        manager.allocate_slots("b", 13, 1, hit)
    manager.check_invariants()


def test_admission_past_the_prefix_gives_sliding_groups_only_the_live_window():
    # A decode worker with a local hit of 24 tokens pulls tokens 24..38 from a
    # prefill worker and computes token 39 itself.
    manager = hybrid_manager(num_blocks=40, window_tokens=8)
    run(manager, "a", tokens(24))
    a_full, a_sliding = manager.block_ids("a")
    manager.free("a")
    prompt = tokens(40)
    hashes = hash_full_blocks(prompt, BS, [])
    hit = manager.find_prefix(hashes, len(prompt))
    assert hit.num_tokens == 24
    assert manager.num_blocks_needed("b", 39, 1, hit) == 4 + 2
    assert manager.allocate_slots("b", 39, 1, hit)
    manager.check_invariants()
    full, sliding = manager.block_ids("b")
    assert full[:6] == a_full and len(full) == 10
    assert sliding[:8] == [NULL_BLOCK_ID] * 8 and NULL_BLOCK_ID not in sliding[8:] and len(sliding) == 10
    assert all(manager.pool.ref_count(b) == 0 for b in a_sliding)  # out of the window: never referenced
    manager.commit("b", hashes, 39)
    manager.check_invariants()
    assert manager.pool.lookup(hashes[8], SLIDING) == sliding[8]
    assert manager.pool.lookup(hashes[8], FULL) == full[8]


def test_prefix_caching_disabled_finds_nothing_and_caches_nothing():
    manager = full_manager(num_blocks=20, enable_prefix_caching=False)
    hashes = run(manager, "a", tokens(16))
    manager.free("a")
    manager.check_invariants()
    hit = manager.find_prefix(hashes, 16)
    assert hit.num_tokens == 0 and hit.block_ids == ((),)
    assert manager.pool.num_cached == 0 and manager.prefix_stats.num_queries == 0


def test_free_evicts_a_requests_last_blocks_first():
    manager = hybrid_manager(num_blocks=9, window_tokens=64)
    hashes = run(manager, "a", tokens(16))
    full, sliding = manager.block_ids("a")
    manager.free("a")
    manager.check_invariants()
    assert manager.pool.num_uncached_free == 0
    assert manager.allocate_slots("c", 0, 4)  # one block per group: evicts both groups' last block
    manager.check_invariants()
    lookup = manager.pool.lookup
    assert lookup(hashes[3], FULL) is None and lookup(hashes[3], SLIDING) is None
    assert [lookup(h, FULL) for h in hashes[:3]] == full[:3]
    assert [lookup(h, SLIDING) for h in hashes[:3]] == sliding[:3]
    assert manager.find_prefix(hashes, 17).num_tokens == 12
