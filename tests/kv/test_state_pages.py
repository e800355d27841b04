"""State groups in the KV manager: live pages, snapshots, prefix hits cut to a snapshot, restore copies.

A small simulation plays the runner: a page's content is the tuple of tokens its state has seen;
the forward pass appends a chunk's tokens to each state group's live page (from () at position 0),
and the copies `take_state_copies` returns are applied in order before it, as the runner must.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pytest

from pdserve.kv.block_pool import NULL_BLOCK_ID, KVInvariantError
from pdserve.kv.events import KVEventKind, KVEventRecorder
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.prefix import PrefixHit
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, plan_groups
from pdserve.kv.state_pages import default_snapshot_interval_blocks

BS = 4
STATE = RecurrentStateSpec("gated_delta_net", conv_channels=4, conv_window=3, recurrent_shape=(2, 4, 4))  # 176 bytes
FULL = 0
STATE_GROUPS = (1, 2)  # 3 state layers, 2 per page


def state_plan(sliding: bool = False):
    specs = [STATE, STATE, STATE, FullAttentionSpec()] + ([SlidingWindowSpec(8)] if sliding else [])
    return plan_groups(specs, attention_layer_bytes=400)


def manager_for(num_blocks: int, interval: Optional[int] = 2, **kwargs) -> KVCacheManager:
    manager = KVCacheManager(state_plan(), num_blocks, BS, snapshot_interval_blocks=interval, **kwargs)
    assert manager.plan.state_group_ids == STATE_GROUPS
    return manager


class Runner:
    """Plays the model runner over page contents: copies in order, then the forward pass."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager
        self.pages: dict[int, tuple] = {}

    def step(self, chunks: Sequence[tuple[str, int, list[int]]]) -> None:
        """`chunks`: (request id, start position, tokens), scheduled with their tables already allocated."""
        for source, destination in self.manager.take_state_copies():
            self.pages[destination] = self.pages.get(source, ())
        for request_id, start, token_ids in chunks:
            tables = self.manager.block_ids(request_id)
            for group_id in self.manager.plan.state_group_ids:
                live = tables[group_id][0]
                self.pages[live] = (() if start == 0 else self.pages.get(live, ("garbage",))) + tuple(token_ids)

    def read(self, request_id: str) -> list[tuple]:
        tables = self.manager.block_ids(request_id)
        return [self.pages.get(tables[g][0]) for g in self.manager.plan.state_group_ids]


def prefill(manager: KVCacheManager, runner: Runner, request_id: str, token_ids: list[int], chunk: int,
            prefix: Optional[PrefixHit] = None, prompt_boundary_at: Optional[int] = None) -> list[bytes]:
    """Schedule, run and commit a prompt chunk by chunk, checking the invariants after every mutation."""
    hashes = hash_full_blocks(token_ids, BS, [])
    computed = prefix.num_tokens if prefix else 0
    first = True
    while computed < len(token_ids):
        num_new = min(chunk, len(token_ids) - computed)
        assert manager.allocate_slots(request_id, computed, num_new, prefix if first else None)
        manager.check_invariants()
        first = False
        runner.step([(request_id, computed, token_ids[computed:computed + num_new])])
        manager.check_invariants()
        computed += num_new
        manager.commit(request_id, hashes, computed, prompt_boundary=computed == prompt_boundary_at)
        manager.check_invariants()
    return hashes


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def snapshot_pages(manager: KVCacheManager, block_hash: bytes) -> list[Optional[int]]:
    return [manager.pool.lookup(block_hash, g) for g in STATE_GROUPS]


def settle(manager: KVCacheManager, runner: Runner) -> None:
    """Two empty steps: every recorded copy runs and every pin is released."""
    runner.step([])
    runner.step([])
    manager.check_invariants()


# ---- live pages -------------------------------------------------------------------------


def test_a_request_holds_one_live_page_per_state_group_from_its_first_allocation_to_its_free():
    manager = manager_for(num_blocks=20)
    assert manager.num_blocks_needed("a", 0, 10) == 3 + 2  # 3 attention blocks and 2 live pages
    assert manager.can_allocate_slots("a", 0, 10)
    assert manager.allocate_slots("a", 0, 10)
    manager.check_invariants()
    tables = manager.block_ids("a")
    assert len(tables[FULL]) == 3 and all(len(tables[g]) == 1 for g in STATE_GROUPS)
    live = [tables[g][0] for g in STATE_GROUPS]
    assert manager.num_blocks_needed("a", 10, 6) == 1  # one more attention block, no new state page
    assert manager.allocate_slots("a", 10, 6)
    manager.check_invariants()
    assert [manager.block_ids("a")[g] for g in STATE_GROUPS] == [[page] for page in live]
    assert manager.num_blocks_in_use_by_group() == (4, 1, 1)
    manager.free("a")
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_usable_blocks and manager.num_blocks_in_use_by_group() == (0, 0, 0)


def test_a_new_request_does_not_fit_without_room_for_its_live_pages():
    manager = manager_for(num_blocks=5)  # 4 usable: 2 attention blocks + 2 live pages
    assert not manager.can_allocate_slots("a", 0, 9) and not manager.allocate_slots("a", 0, 9)
    manager.check_invariants()
    assert manager.allocate_slots("a", 0, 8)
    manager.check_invariants()


def test_live_pages_are_never_cached_and_sliding_logic_leaves_state_groups_alone():
    manager = KVCacheManager(state_plan(sliding=True), 30, BS, snapshot_interval_blocks=0)
    runner = Runner(manager)
    state_groups = manager.plan.state_group_ids
    assert state_groups == (2, 3)  # full, sliding, then the state groups
    hashes = prefill(manager, runner, "a", prompt(30), chunk=6)
    tables = manager.block_ids("a")
    assert all(len(tables[g]) == 1 and not manager.pool.is_cached(tables[g][0]) for g in state_groups)
    assert tables[1][:4] == [NULL_BLOCK_ID] * 4  # the sliding group released what left its window at 24
    assert all(manager.pool.lookup(h, g) is None for h in hashes for g in state_groups)  # interval 0: no snapshots
    assert [tables[g] for g in state_groups] == [manager.live_block_ids("a", 30)[g] for g in state_groups]


# ---- snapshots --------------------------------------------------------------------------


def test_snapshots_are_taken_every_interval_blocks_and_copied_from_the_live_pages():
    manager = manager_for(num_blocks=30, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(18), chunk=4)  # boundaries 4, 8, 12, 16 and 18
    assert [all(p is not None for p in snapshot_pages(manager, h)) for h in hashes] == [False, True, False, True]
    settle(manager, runner)
    for index in (1, 3):
        assert [runner.pages[p] for p in snapshot_pages(manager, hashes[index])] == [tuple(range(4 * index + 4))] * 2
    assert runner.read("a") == [tuple(range(18))] * 2


def test_a_snapshot_is_taken_at_the_prompt_boundary_whatever_the_interval():
    manager = manager_for(num_blocks=30, interval=0)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(14), chunk=4, prompt_boundary_at=12)
    assert [all(p is not None for p in snapshot_pages(manager, h)) for h in hashes] == [False, False, True]
    manager.commit("a", hashes, 14, prompt_boundary=True)  # not a block boundary: nothing
    manager.check_invariants()
    settle(manager, runner)
    assert [runner.pages[p] for p in snapshot_pages(manager, hashes[2])] == [tuple(range(12))] * 2


def test_a_snapshot_is_skipped_not_failed_when_the_pool_has_no_free_page():
    manager = manager_for(num_blocks=5, interval=1)  # 2 attention blocks + 2 live pages fill it
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(8), chunk=4)
    assert manager.num_free_blocks == 0
    assert all(page is None for h in hashes for page in snapshot_pages(manager, h))
    assert manager.take_state_copies() == []


def test_the_default_interval_keeps_snapshot_pages_at_most_the_attention_pages_between_them():
    assert default_snapshot_interval_blocks(state_plan()) == 2  # 2 state groups, 1 attention group
    assert default_snapshot_interval_blocks(state_plan(sliding=True)) == 1
    assert manager_for(num_blocks=8, interval=None).state.snapshot_interval_blocks == 2
    with pytest.raises(ValueError):
        manager_for(num_blocks=8, interval=-1)


def test_pages_of_a_pending_copy_stay_in_use_until_the_copies_after_them_are_taken():
    manager = manager_for(num_blocks=30, interval=2)
    runner = Runner(manager)
    hashes = hash_full_blocks(prompt(8), BS, [])
    assert manager.allocate_slots("a", 0, 8)
    runner.step([("a", 0, prompt(8))])
    live = [manager.block_ids("a")[g][0] for g in STATE_GROUPS]
    manager.commit("a", hashes, 8)  # snapshot recorded: live -> fresh page
    manager.free("a")  # the request ends in the same update
    manager.check_invariants()
    snapshots = snapshot_pages(manager, hashes[1])
    for page in live + snapshots:
        assert manager.pool.ref_count(page) == 1  # not free: a later allocation cannot take them
    copies = manager.take_state_copies()  # end of the next schedule(); the runner runs them next
    assert copies == list(zip(live, snapshots))
    assert all(manager.pool.ref_count(page) == 1 for page in live + snapshots)
    manager.check_invariants()
    assert manager.take_state_copies() == []  # the step after: they ran, the pages go
    assert all(manager.pool.ref_count(page) == 0 for page in live + snapshots)
    assert snapshot_pages(manager, hashes[1]) == snapshots  # still cached, now evictable
    manager.check_invariants()


def test_a_writer_that_fills_pages_as_soon_as_they_are_allocated_cannot_spoil_a_pending_snapshot():
    """A tier read or a pull writes its pages before the runner's next copies: the pages those copies
    read must not be among them."""
    manager = manager_for(num_blocks=12, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(8), chunk=8)  # the snapshot copy is pending
    manager.free("a")  # finished in the same update
    grabbed = manager.pool.allocate(manager.pool.num_uncached_free, FULL)  # the next schedule's loads...
    for block_id in grabbed:
        runner.pages[block_id] = ("pulled",)  # ...land at once
    runner.step([])  # the runner: copies, then the forward pass
    manager.pool.free(grabbed)
    settle(manager, runner)
    hit = manager.find_prefix(hash_full_blocks(prompt(9), BS, []), 9)
    assert hit.num_tokens == 8
    assert [runner.pages[hit.block_ids[g][1]] for g in STATE_GROUPS] == [tuple(range(8))] * 2


# ---- prefix hits ------------------------------------------------------------------------


def test_a_prefix_hit_is_cut_to_the_latest_snapshot_and_admission_records_the_restore():
    manager = manager_for(num_blocks=40, interval=2)
    runner = Runner(manager)
    prefill(manager, runner, "a", prompt(16), chunk=4)  # snapshots at 8 and 16
    manager.free("a")
    settle(manager, runner)
    shared = prompt(14) + [900, 901, 902, 903, 904]  # the attention groups alone would hit 12 tokens
    hashes = hash_full_blocks(shared, BS, [])
    hit = manager.find_prefix(hashes, len(shared))
    assert hit.num_tokens == 8
    assert [hit.block_ids[g] for g in STATE_GROUPS] == [(NULL_BLOCK_ID, p) for p in snapshot_pages(manager, hashes[1])]
    assert manager.num_blocks_needed("b", 8, 11, hit) == 3 + 2
    prefill(manager, runner, "b", shared, chunk=6, prefix=hit)
    assert runner.read("b") == [tuple(shared)] * 2  # the restored state, then the new tokens


@pytest.mark.parametrize("num_usable, fits", [(7, True), (6, False)])
def test_a_hits_own_snapshot_pages_are_never_evicted_to_feed_its_live_pages(num_usable: int, fits: bool):
    manager = manager_for(num_blocks=num_usable + 1, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(8), chunk=4)  # 2 blocks, 2 live pages, 2 snapshot pages
    manager.free("a")
    settle(manager, runner)
    hit = manager.find_prefix(hash_full_blocks(prompt(9), BS, []), 9)
    assert hit.num_tokens == 8  # its 2 blocks and 2 snapshots are all free and cached
    assert manager.can_allocate_slots("b", 8, 1, hit) is fits
    assert manager.allocate_slots("b", 8, 1, hit) is fits
    manager.check_invariants()
    if fits:
        runner.step([("b", 8, [8])])
        assert runner.read("b") == [tuple(range(9))] * 2
        assert snapshot_pages(manager, hashes[1]) == [hit.block_ids[g][1] for g in STATE_GROUPS]


def test_a_second_request_over_the_same_tokens_reuses_the_snapshot_instead_of_copying_again():
    manager = manager_for(num_blocks=40, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(8), chunk=8)
    pages = snapshot_pages(manager, hashes[1])
    prefill(manager, runner, "b", prompt(8), chunk=8)  # computed alongside, no hit asked for
    assert snapshot_pages(manager, hashes[1]) == pages
    assert manager.take_state_copies() == []  # b's commit copied nothing (a's copies were taken by b's step)
    manager.free("a")
    manager.free("b")
    settle(manager, runner)
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_without_a_snapshot_a_state_model_gets_no_hit():
    manager = manager_for(num_blocks=30, interval=0)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(12), chunk=12)
    manager.free("a")
    settle(manager, runner)
    assert manager.pool.lookup(hashes[1], FULL) is not None  # the attention blocks are cached
    assert manager.find_prefix(hashes, 13).num_tokens == 0


def test_evicting_a_snapshot_shrinks_later_hits_to_the_one_before():
    manager = manager_for(num_blocks=40, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(17), chunk=4)
    manager.free("a")
    settle(manager, runner)
    assert manager.find_prefix(hashes, 17).num_tokens == 16
    victim = snapshot_pages(manager, hashes[3])[1]
    pool = manager.pool
    keep = [b for b in range(1, pool.num_blocks) if b != victim and pool.is_cached(b) and pool.ref_count(b) == 0]
    for block_id in keep:
        pool.touch([block_id], pool.owner(block_id))
    pool.free(pool.allocate(pool.num_free_blocks, group_id=FULL))  # evicts the victim only
    pool.free(keep)
    manager.check_invariants()
    assert manager.find_prefix(hashes, 17).num_tokens == 8


def test_a_running_prefix_hit_keeps_the_attention_and_state_of_each_request_apart():
    manager = manager_for(num_blocks=60, interval=2)
    runner = Runner(manager)
    prefill(manager, runner, "a", prompt(16), chunk=8)
    hit = manager.find_prefix(hash_full_blocks(prompt(20), BS, []), 20)  # "a" still runs
    assert hit.num_tokens == 16
    prefill(manager, runner, "b", prompt(20), chunk=4, prefix=hit)
    assert runner.read("a") == [tuple(range(16))] * 2 and runner.read("b") == [tuple(range(20))] * 2
    assert set(runner.read("a")) != set(runner.read("b"))


def test_a_caller_that_fills_the_state_itself_gets_no_restore_copy():
    manager = manager_for(num_blocks=40, interval=2)
    runner = Runner(manager)
    prefill(manager, runner, "a", prompt(16), chunk=4)
    manager.free("a")
    settle(manager, runner)
    hashes = hash_full_blocks(prompt(20), BS, [])
    hit = manager.find_prefix(hashes, 20)
    assert manager.allocate_slots("b", 19, 1, hit)  # a pull fills [16, 19) and the state
    manager.check_invariants()
    assert manager.take_state_copies() == []


def test_freeing_a_request_refreshes_its_snapshots_beside_its_blocks_tail_first():
    manager = manager_for(num_blocks=40, interval=2)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(16), chunk=4)
    settle(manager, runner)  # the snapshots are evictable now, older than a's blocks
    manager.free("a")
    manager.check_invariants()
    order = list(manager.pool._evictable)  # least recently freed (evicted first) first
    position = {block_id: order.index(block_id) for block_id in order}
    table = manager.block_ids("a")  # gone: read the keys instead
    assert table == ([], [], [])
    full = [manager.pool.lookup(h, FULL) for h in hashes]
    late, early = snapshot_pages(manager, hashes[3]), snapshot_pages(manager, hashes[1])
    assert max(position[p] for p in late) < position[full[2]]  # block 3's snapshot goes with block 3
    assert position[full[2]] < min(position[p] for p in early) < position[full[0]]


def test_snapshots_enter_and_leave_the_event_stream_like_blocks_under_their_state_group():
    recorder = KVEventRecorder()
    recorder.enabled = True
    manager = manager_for(num_blocks=40, interval=2, events=recorder)
    runner = Runner(manager)
    hashes = prefill(manager, runner, "a", prompt(8), chunk=8)
    manager.free("a")
    settle(manager, runner)
    stored = [(e.block_hash, e.parent_hash, e.group_id) for e in recorder.drain() if e.kind is KVEventKind.STORED]
    assert [(hashes[1], hashes[0], g) for g in STATE_GROUPS] == [s for s in stored if s[2] in STATE_GROUPS]
    pool = manager.pool
    pool.free(pool.allocate(pool.num_free_blocks, FULL))  # evicts everything cached
    removed = {(e.block_hash, e.group_id) for e in recorder.drain() if e.kind is KVEventKind.REMOVED}
    assert {(hashes[1], g) for g in STATE_GROUPS} <= removed
    assert manager.find_prefix(hashes, 9).num_tokens == 0


def test_withheld_state_is_never_snapshotted():
    manager = manager_for(num_blocks=30, interval=1)
    runner = Runner(manager)
    hashes = hash_full_blocks(prompt(8), BS, [])
    assert manager.allocate_slots("a", 0, 8)
    manager.withhold_from_cache("a", (0, 1, 1))
    runner.step([("a", 0, prompt(8))])
    manager.commit("a", hashes, 8)
    manager.check_invariants()
    assert snapshot_pages(manager, hashes[1]) == [None, None]


def test_invariants_catch_a_cached_live_page():
    manager = manager_for(num_blocks=30)
    assert manager.allocate_slots("a", 0, 4)
    live = manager.block_ids("a")[STATE_GROUPS[0]][0]
    manager.pool.cache(live, b"h" * 32, STATE_GROUPS[0])
    with pytest.raises(KVInvariantError):
        manager.check_invariants()


# ---- the offload tier -------------------------------------------------------------------


class TierPages:
    """A tier's slots over the runner's page contents (torch-free)."""

    medium = "cpu"
    page_bytes = 1

    def __init__(self, runner: Runner, num_slots: int):
        self.runner, self.num_slots = runner, num_slots
        self.slots: list = [None] * num_slots

    def write(self, slot: int, block_id: int) -> None:
        self.slots[slot] = self.runner.pages.get(block_id)

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        for slot, block_id in zip(slots, block_ids):
            self.runner.pages[block_id] = self.slots[slot]

    def close(self) -> None:
        pass


def test_a_snapshot_evicted_to_the_tier_loads_into_a_fresh_page_then_restores_into_the_live_page():
    plan = state_plan()
    runner = Runner(None)  # type: ignore[arg-type]
    store = TierPages(runner, num_slots=64)
    tier = OffloadTier(store, [FULL])
    manager = KVCacheManager(plan, 16, BS, offload=tier, snapshot_interval_blocks=2)
    runner.manager = manager
    hashes = prefill(manager, runner, "a", prompt(16), chunk=4)
    manager.free("a")
    settle(manager, runner)
    prefill(manager, runner, "b", prompt(32, 500), chunk=8)  # evicts every page of "a" into the tier
    manager.free("b")
    settle(manager, runner)
    assert snapshot_pages(manager, hashes[3]) == [None, None]
    hit = manager.find_prefix(hashes, 17)
    assert hit.num_tokens == 16 and [hit.offloaded[g] for g in STATE_GROUPS] == [(3,), (3,)]
    assert manager.allocate_slots("c", 16, 1, hit) and manager.start_tier_read("c")
    manager.check_invariants()
    assert manager.take_state_copies() == []  # nothing to restore before the load lands
    assert manager.poll_offload().landed == ["c"]
    manager.check_invariants()
    runner.step([("c", 16, [16])])
    assert runner.read("c") == [tuple(range(17))] * 2
    manager.free("c")
    settle(manager, runner)
    tier.check_invariants()


def test_next_snapshot_tokens_names_where_a_chunk_should_end_for_the_next_snapshot():
    manager = manager_for(num_blocks=8, interval=2)  # every 8 tokens
    assert manager.prompt_boundary_tokens(19) == 16 and manager.prompt_boundary_tokens(17) == 16
    assert manager.prompt_boundary_tokens(16) == 12  # a repeat hits at most 15 tokens: 3 blocks
    assert manager.next_snapshot_tokens(0, 19) == 8
    assert manager.next_snapshot_tokens(8, 14) == 12  # the prompt boundary comes first
    assert manager.next_snapshot_tokens(12, 14) == 16
    assert manager_for(num_blocks=8, interval=0).next_snapshot_tokens(12, 14) is None
    assert KVCacheManager(plan_groups([FullAttentionSpec()]), 8, BS).next_snapshot_tokens(0, 30) is None
    assert manager_for(num_blocks=8, enable_prefix_caching=False).next_snapshot_tokens(0, 30) is None
