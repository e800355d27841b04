"""The offload tier: write-back on eviction, its own LRU, the sliding rule, matching across tiers, loads."""

from __future__ import annotations

import json
from typing import Sequence

import pytest

from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.events import KVEvent, KVEventKind, KVEventRecorder
from pdserve.kv.events_wire import decode_line, encode_events
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadIOError, OffloadTier
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups

BS = 4
PAGE = 8


class FakePages:
    """A pool of byte pages and a tier's slots, torch-free; `fail_reads` makes every read fail."""

    medium = "cpu"
    page_bytes = PAGE

    def __init__(self, num_blocks: int, num_slots: int):
        self.pool = [b"\0" * PAGE for _ in range(num_blocks)]
        self.slots = [b"" for _ in range(num_slots)]
        self.num_slots = num_slots
        self.fail_reads = False
        self.num_reads = 0

    def write(self, slot: int, block_id: int) -> None:
        self.slots[slot] = self.pool[block_id]

    def close(self) -> None:
        pass

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if self.fail_reads:
            raise OffloadIOError("injected")
        for slot, block_id in zip(slots, block_ids):
            self.pool[block_id] = self.slots[slot]
            self.num_reads += 1


def content(block_hash: bytes, group_id: int) -> bytes:
    return (block_hash[:PAGE - 1] + bytes([group_id]))


def tiered(specs, num_blocks: int, num_slots: int, events=None) -> tuple[KVCacheManager, FakePages, OffloadTier]:
    plan = plan_groups(specs)
    pages = FakePages(num_blocks, num_slots)
    full = [g.group_id for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
    tier = OffloadTier(pages, full, events)
    return KVCacheManager(plan, num_blocks, BS, events=events, offload=tier), pages, tier


def compute(manager: KVCacheManager, pages: FakePages, request_id: str, token_ids: list[int]) -> list[bytes]:
    """Prefill a prompt from scratch, writing each block's expected page, then finish it."""
    hashes = hash_full_blocks(token_ids, BS, [])
    assert manager.allocate(request_id, 0, len(token_ids))
    for group_id, table in enumerate(manager.block_ids(request_id)):
        for index, block_id in enumerate(table[:len(hashes)]):
            if block_id != NULL_BLOCK_ID:
                pages.pool[block_id] = content(hashes[index], group_id)
    manager.commit(request_id, hashes, len(token_ids))
    manager.free(request_id)
    manager.check_invariants()
    return hashes


def prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_evicted_prefix_blocks_are_stored_and_a_later_hit_loads_them_back():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16)
    first = compute(manager, pages, "a", prompt(17, 0))  # 4 full blocks + 1 partial
    compute(manager, pages, "b", prompt(32, 1000))  # needs all 8 blocks: evicts every page of "a"
    assert manager.pool.lookup(first[0], 0) is None
    assert tier.num_pages >= 4 and tier.stats.num_store_bytes == tier.stats.num_stores * PAGE

    hit = manager.find_prefix(first, 17)
    assert hit.num_tokens == 16 and hit.offloaded == ((0, 1, 2, 3),) and hit.num_device_tokens(BS) == 0
    assert manager.prefix_stats.num_offload_hit_tokens == 16
    assert manager.allocate("c", 16, 1, hit)
    assert manager.start_offload_load("c")
    manager.check_invariants()
    assert manager.poll_offload().landed == ["c"]
    table = manager.block_ids("c")[0]
    assert [pages.pool[b] for b in table[:4]] == [content(h, 0) for h in first[:4]]
    assert [manager.pool.lookup(h, 0) for h in first[:4]] == table[:4]  # cached on the device again
    manager.free("c")
    manager.check_invariants()
    tier.check_invariants()


def test_the_tier_is_bounded_and_drops_its_least_recently_used_pages():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=5, num_slots=3)
    old = compute(manager, pages, "a", prompt(16, 0))
    compute(manager, pages, "b", prompt(16, 100))
    compute(manager, pages, "c", prompt(16, 200))
    assert tier.num_pages == 3 and tier.usage_ratio == 1.0
    assert tier.lookup(old[0], 0) is None  # the oldest went first
    tier.check_invariants()


def test_no_tier_means_no_offloaded_hits_and_nothing_stored():
    manager = KVCacheManager(plan_groups([FullAttentionSpec()]), 9, BS)
    pages = FakePages(9, 1)
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    assert hit.num_tokens == 0 and not manager.start_offload_load("x")


def test_a_read_that_raises_fails_the_load_and_drops_the_keys():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16)
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    pages.fail_reads = True
    assert manager.allocate("c", 16, 1, hit) and manager.start_offload_load("c")
    results = manager.poll_offload()
    assert results.failed == ["c"] and results.landed == []
    assert tier.stats.num_failed_loads == 1 and tier.lookup(first[0], 0) is None
    manager.free("c")
    manager.check_invariants()
    tier.check_invariants()
    assert manager.find_prefix(first, 17).num_tokens == 0  # next time it recomputes


def test_pages_a_hit_will_load_are_pinned_against_the_tiers_own_eviction():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=6, num_slots=4)
    first = compute(manager, pages, "a", prompt(17, 0))  # 5 blocks: 4 cached
    compute(manager, pages, "b", prompt(20, 100))  # evicts a's 4 pages into the 4 slots
    assert all(tier.lookup(h, 0) is not None for h in first[:4])
    hit = manager.find_prefix(first, 17)
    # The allocation evicts b's cached pages, whose stores would push a's out of a full tier.
    assert manager.allocate("c", 16, 1, hit)
    assert manager.start_offload_load("c") and manager.poll_offload().landed == ["c"]
    assert [pages.pool[b] for b in manager.block_ids("c")[0][:4]] == [content(h, 0) for h in first[:4]]
    tier.check_invariants()


def test_matching_prefers_the_device_and_takes_the_rest_from_the_tier():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16)
    first = compute(manager, pages, "a", prompt(17, 0))
    # "b" shares a's first two blocks (device hits it holds) and evicts a's other two.
    shared = prompt(8, 0) + prompt(24, 500)
    hashes = hash_full_blocks(shared, BS, [])
    b_hit = manager.find_prefix(hashes, len(shared))
    assert b_hit.num_tokens == 8 and manager.allocate("b", 8, 24, b_hit)
    assert manager.pool.lookup(first[2], 0) is None and tier.lookup(first[2], 0) is not None
    hit = manager.find_prefix(first, 17)
    assert hit.num_tokens == 16 and hit.offloaded == ((2, 3),) and hit.num_device_tokens(BS) == 8
    assert hit.block_ids[0][:2] == tuple(manager.block_ids("b")[0][:2])
    manager.free("b")
    manager.check_invariants()


def sliding_specs(window: int):
    return [SlidingWindowSpec(window), FullAttentionSpec()]


def test_a_sliding_window_hit_loads_only_the_blocks_in_the_window():
    window = 8  # two blocks
    manager, pages, tier = tiered(sliding_specs(window), num_blocks=40, num_slots=64)
    full = next(g.group_id for g in manager.plan.groups if isinstance(g.spec, FullAttentionSpec))
    sliding = 1 - full
    first = compute(manager, pages, "a", prompt(33, 0))  # 8 full blocks
    compute(manager, pages, "b", prompt(19 * BS, 1000))  # 38 of the 39 blocks: evicts "a"
    hit = manager.find_prefix(first, 33)
    assert hit.num_tokens == 32
    assert manager.allocate("c", 32, 1, hit) and manager.start_offload_load("c")
    assert manager.poll_offload().landed == ["c"]
    tables = manager.block_ids("c")
    loaded_full = [i for i in hit.offloaded[full]]
    loaded_sliding = [i for i in hit.offloaded[sliding]]
    # The token at 32 reads keys 25..32: blocks 6 and 7 of the sliding group; the full group needs all 8.
    assert sorted(loaded_full) == list(range(8))
    assert all(i >= 6 for i in loaded_sliding)
    assert tables[sliding][:6] == [NULL_BLOCK_ID] * 6
    assert pages.num_reads == len(loaded_full) + len(loaded_sliding)
    manager.check_invariants()


def test_a_sliding_block_is_stored_only_while_its_full_attention_block_is_cached_somewhere():
    manager, pages, tier = tiered(sliding_specs(8), num_blocks=40, num_slots=64)
    full = next(g.group_id for g in manager.plan.groups if isinstance(g.spec, FullAttentionSpec))
    sliding = 1 - full
    hashes = hash_full_blocks(prompt(8, 0), BS, [])
    assert manager.allocate("a", 0, 8)
    manager.commit("a", hashes, 8)
    manager.free("a")
    tables_key = (hashes[0], sliding)
    block_id = manager.pool.lookup(*tables_key)
    # The full block of the same hash is cached on the device: worth storing.
    tier.offer(block_id, tables_key, None)
    assert tier.lookup(*tables_key) is not None
    # A sliding block whose full-attention block is nowhere: never stored.
    orphan = (b"x" * 16, sliding)
    tier.offer(block_id, orphan, None)
    assert tier.lookup(*orphan) is None
    # Dropping a full entry drops the sliding entries of its hash.
    tier.offer(manager.pool.lookup(hashes[0], full), (hashes[0], full), None)
    assert tier.num_pages == 2
    tier._drop((hashes[0], full))
    assert tier.num_pages == 0
    tier.check_invariants()


def test_tier_events_carry_their_medium():
    events = KVEventRecorder()
    events.enabled = True
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16, events=events)
    compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    drained = events.drain()
    tier_stored = [e for e in drained if e.kind is KVEventKind.STORED and e.medium == "cpu"]
    assert len(tier_stored) == tier.num_pages
    assert all(e.medium is None for e in drained if e not in tier_stored and e.kind is KVEventKind.STORED)


def test_a_snapshot_lists_the_tiers_pages_with_their_medium_and_a_reset_removes_them_one_by_one():
    events = KVEventRecorder()
    events.enabled = True
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16, events=events)
    first = compute(manager, pages, "a", prompt(17, 0))
    second = compute(manager, pages, "b", prompt(32, 1000))  # evicts every page of "a" into the tier
    snapshot = manager.snapshot_cache()
    device = {(b.block_hash, b.medium) for b in snapshot.blocks if b.medium is None}
    offloaded = [b for b in snapshot.blocks if b.medium is not None]
    assert device == {(h, None) for h in second}
    assert {(b.block_hash, b.parent_hash, b.medium) for b in offloaded} == {
        (h, first[i - 1] if i else None, "cpu") for i, h in enumerate(first)}
    assert snapshot.seq == events.last_seq
    events.drain()
    manager.clear_prefix_cache()
    drained = events.drain()
    assert [(e.kind, e.medium) for e in drained] == [(KVEventKind.REMOVED, "cpu")] * 4 + [(KVEventKind.CLEARED, None)]
    assert manager.snapshot_cache().blocks == ()


@pytest.mark.parametrize("num_slots", [1, 2, 5])
def test_invariants_hold_under_many_prompts(num_slots):
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=7, num_slots=num_slots)
    for round_ in range(2):
        for index in range(6):
            token_ids = prompt(13, index * 100)
            hashes = hash_full_blocks(token_ids, BS, [])
            hit = manager.find_prefix(hashes, 13)
            request_id = f"r{round_}-{index}"
            assert manager.allocate(request_id, hit.num_tokens, 13 - hit.num_tokens, hit)
            if manager.start_offload_load(request_id):
                assert manager.poll_offload().landed == [request_id]
            table = manager.block_ids(request_id)[0]
            for i in range(3):
                if i * BS >= hit.num_tokens:
                    pages.pool[table[i]] = content(hashes[i], 0)
                assert pages.pool[table[i]] == content(hashes[i], 0)
            manager.commit(request_id, hashes, 13)
            manager.free(request_id)
            manager.check_invariants()
            tier.check_invariants()


def test_the_medium_survives_the_wire_and_device_rows_keep_their_old_shape():
    events = [KVEvent(1, KVEventKind.STORED, b"\x01" * 16, None, 0),
              KVEvent(2, KVEventKind.STORED, b"\x02" * 16, b"\x01" * 16, 0, "cpu")]
    line = encode_events("e", events, BS)
    rows = json.loads(line)["events"]
    assert len(rows[0]) == 6 and rows[1][6] == "cpu"
    assert [event.medium for event in decode_line(line).events] == [None, "cpu"]


def test_a_load_copied_on_the_calling_thread_wakes_its_waiter_at_once_landed_or_failed():
    manager, pages, tier = tiered([FullAttentionSpec()], num_blocks=9, num_slots=16)
    wakes = []
    tier.wake_on_results(lambda: wakes.append(True))
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    assert manager.allocate("c", 16, 1, hit) and manager.start_offload_load("c")
    assert wakes == [True] and manager.poll_offload().landed == ["c"]
    manager.free("c")
    compute(manager, pages, "d", prompt(32, 2000))  # pushes "a" out of the pool again
    pages.fail_reads = True
    hit = manager.find_prefix(first, 17)
    assert manager.allocate("e", 16, 1, hit) and manager.start_offload_load("e")
    assert wakes == [True, True] and manager.poll_offload().failed == ["e"]
    manager.free("e")
    manager.check_invariants()
