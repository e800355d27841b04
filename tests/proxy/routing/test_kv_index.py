"""The proxy's KV index: snapshots and events per worker, gaps detected, and predictions equal to what the
worker's own prefix cache finds (full attention and a Gemma-like hybrid of sliding and full groups), each
worker matched over its own block size; with an offload tier, which part of the hit the worker loads from it."""

from __future__ import annotations

import random

import pytest

from pdserve.kv.events import CachedBlock, KVEventRecorder
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from proxy.routing.kv_index import CachedPrefix, KVIndex, Residence, SequenceGap
from proxy.routing.kv_prompt import PromptBlocks
from tests.kv.test_offload import FakePages

BLOCK = 4
URL = "http://w0"


class RecordingWorker:
    """A worker's KV manager whose events feed an index, as the event stream would."""

    def __init__(self, layer_specs, num_blocks: int = 48, block_size: int = BLOCK, url: str = URL,
                 index: KVIndex | None = None, offload_slots: int = 0):
        self.recorder = KVEventRecorder()
        self.recorder.enabled = True
        self.block_size = block_size
        self.url = url
        plan = plan_groups(layer_specs)
        tier = None
        if offload_slots:  # a host-memory-like tier (its events carry medium "cpu") of pure-Python pages
            full_group_ids = [g.group_id for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
            tier = OffloadTier(FakePages(num_blocks, offload_slots), full_group_ids, self.recorder)
        self.manager = KVCacheManager(plan, num_blocks, block_size, events=self.recorder, offload=tier)
        self.index = KVIndex() if index is None else index
        self.num_removed = 0
        snapshot = self.manager.snapshot_cache()
        self.index.apply_snapshot(url, "prefill", "e1", snapshot.seq, block_size, snapshot.blocks)

    def compute(self, request_id: str, tokens: list[int]) -> None:
        """Admit with the cache's hit, compute the rest, commit, free (LRU eviction as the pool goes)."""
        hashes = hash_full_blocks(tokens, self.block_size, [])
        hit = self.manager.find_prefix(hashes, len(tokens))
        if not self.manager.allocate_slots(request_id, hit.num_tokens, len(tokens) - hit.num_tokens, hit):
            return
        if self.manager.start_tier_read(request_id):
            assert self.manager.poll_offload().landed == [request_id]
        self.manager.commit(request_id, hashes, len(tokens))
        self.manager.free(request_id)
        self.manager.check_invariants()
        events = self.recorder.drain()
        self.num_removed += sum(event.kind.value == "removed" for event in events)
        self.index.apply_events(self.url, "e1", events)

    def predicted_and_actual(self, prompt: PromptBlocks) -> tuple[int, int]:
        """The index's prediction from the prompt as the proxy holds it, and the worker's own hit."""
        predicted, actual = self.predicted_and_actual_prefixes(prompt)
        return predicted.num_tokens, actual.num_tokens

    def predicted_and_actual_prefixes(self, prompt: PromptBlocks) -> tuple[CachedPrefix, CachedPrefix]:
        """The same, with the tokens each says come from the offload tier."""
        predicted = self.index.cached_prefix(self.url, prompt, self.manager.plan)
        hashes = hash_full_blocks(prompt.token_ids, self.block_size, [])
        hit = self.manager.find_prefix(hashes, prompt.num_tokens)
        return predicted, CachedPrefix(hit.num_tokens, hit.num_tokens - hit.num_device_tokens(self.block_size))

    def resync(self, index: KVIndex) -> None:
        """What a reconnecting proxy does: the worker's snapshot, in place of its history."""
        snapshot = self.manager.snapshot_cache()
        index.apply_snapshot(self.url, "prefill", "e1", snapshot.seq, self.block_size, snapshot.blocks)


def held_prefix(tokens: list[int], num_computed: int, block_size: int) -> list[CachedBlock]:
    """The blocks a worker with `block_size`-token blocks holds after computing the first tokens."""
    hashes = hash_full_blocks(tokens[:num_computed], block_size, [])
    return [CachedBlock(h, hashes[i - 1] if i else None, 0) for i, h in enumerate(hashes)]


def blocks(*names: bytes):
    return [CachedBlock(name, None, 0) for name in names]


def test_a_snapshot_replaces_everything_known_of_a_worker():
    index = KVIndex()
    index.apply_snapshot(URL, "decode", "e1", 5, BLOCK, blocks(b"a", b"b"))
    index.apply_snapshot("http://w1", "decode", "x", 1, BLOCK, blocks(b"a"))
    assert index.holders(b"a") == {URL, "http://w1"}
    index.apply_snapshot(URL, "decode", "e2", 0, BLOCK, blocks(b"c"))
    assert index.holders(b"a") == {"http://w1"} and index.holders(b"b") == frozenset()
    assert index.holders(b"c") == {URL} and index.worker(URL).epoch == "e2"
    assert index.num_keys == 2 and index.num_blocks_by_role() == {"decode": 2}


def recorder_and_empty_index() -> tuple[KVEventRecorder, KVIndex]:
    """A recording event source and an index that holds its worker's (empty) snapshot."""
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex()
    index.apply_snapshot(URL, "prefill", "e1", 0, BLOCK, [])
    return recorder, index


def test_events_must_continue_the_worker_history_or_raise_a_gap():
    recorder, index = recorder_and_empty_index()
    recorder.stored(b"a", None, 0)
    index.apply_events(URL, "e1", recorder.drain())
    recorder.stored(b"b", b"a", 0)
    recorder.stored(b"c", b"b", 0)
    with pytest.raises(SequenceGap):
        index.apply_events(URL, "e1", recorder.drain()[1:])  # event 2 went missing
    with pytest.raises(SequenceGap):
        index.apply_events(URL, "other-epoch", [])
    with pytest.raises(SequenceGap):
        index.check_heartbeat(URL, "e1", 3)
    index.check_heartbeat(URL, "e1", 1)


def test_removed_and_cleared_events_drop_blocks_and_a_dropped_worker_holds_nothing():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex()
    index.apply_snapshot(URL, "prefill", "e1", 0, BLOCK, blocks(b"x"))
    recorder.stored(b"a", None, 0)
    recorder.stored(b"b", b"a", 0)
    recorder.removed(b"a", 0)
    index.apply_events(URL, "e1", recorder.drain())
    assert index.holders(b"a") == frozenset() and index.holders(b"b") == {URL}
    recorder.cleared()
    index.apply_events(URL, "e1", recorder.drain())
    assert index.num_keys == 0
    index.drop_worker(URL)
    assert index.worker(URL) is None
    assert index.cached_tokens(URL, PromptBlocks(tuple(range(8))), plan_groups([FullAttentionSpec()])) == 0


def test_a_worker_cannot_grow_the_index_past_its_bound_and_removals_still_apply():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex(max_keys_per_worker=3)
    index.apply_snapshot(URL, "prefill", "e1", 0, BLOCK, blocks(b"a", b"b", b"c", b"d"))  # one past the bound
    index.apply_snapshot("http://w1", "prefill", "e1", 0, BLOCK, blocks(b"a"))  # others keep their own room
    assert len(index.worker(URL).keys) == 3 and index.num_keys_not_indexed == 1
    for name in (b"e", b"f"):
        recorder.stored(name, None, 0)
    recorder.removed(b"a", 0)
    recorder.stored(b"g", None, 0)
    index.apply_events(URL, "e1", recorder.drain())
    held = {key for key, _ in index.worker(URL).keys}
    assert held == {b"b", b"c", b"g"} and index.num_keys_not_indexed == 3  # d, e, f never indexed
    assert index.holders(b"a") == {"http://w1"}


@pytest.mark.parametrize("layer_specs", [
    [FullAttentionSpec()] * 2,
    [SlidingWindowSpec(6), SlidingWindowSpec(6), FullAttentionSpec(), SlidingWindowSpec(6)],
], ids=["full", "sliding+full"])
def test_predictions_equal_the_workers_own_prefix_hits_through_eviction_churn(layer_specs):
    worker = RecordingWorker(layer_specs)
    rng = random.Random(0)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 30))] for _ in range(6)]
    num_checked_hits = 0
    for step in range(80):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(50, 99) for _ in range(rng.randrange(0, 9))]
        predicted, actual = worker.predicted_and_actual(PromptBlocks(tuple(tokens)))
        assert predicted == actual, (step, tokens)
        num_checked_hits += actual > 0
        worker.compute(f"r{step}", tokens)
    assert num_checked_hits > 20  # the churn exercised real hits, not only misses
    assert worker.num_removed > 20  # and evictions


def test_each_worker_is_matched_over_its_own_block_size():
    """Prefill blocks of 16 tokens, decode blocks of 32: one prompt, one index, each hit by the worker's own chain."""
    plan = plan_groups([FullAttentionSpec()])
    tokens = [random.Random(1).randrange(1, 1000) for _ in range(70)]
    index = KVIndex()
    for num_computed, expected in [(64, {16: 64, 32: 64}), (48, {16: 48, 32: 32}), (70, {16: 64, 32: 64})]:
        for block_size in (16, 32):
            index.apply_snapshot(f"http://w{block_size}", "prefill", "e1", 0, block_size,
                                 held_prefix(tokens, num_computed, block_size))
        prompt = PromptBlocks(tuple(tokens))
        predicted = {size: index.cached_tokens(f"http://w{size}", prompt, plan) for size in (16, 32)}
        assert predicted == expected, num_computed
    assert (index.worker("http://w16").block_size, index.worker("http://w32").block_size) == (16, 32)


def test_a_prompt_shorter_than_a_workers_block_has_no_hit_there():
    plan = plan_groups([FullAttentionSpec()])
    tokens = list(range(1, 25))
    index = KVIndex()
    index.apply_snapshot("http://w16", "decode", "e1", 0, 16, held_prefix(tokens, 24, 16))
    index.apply_snapshot("http://w32", "decode", "e1", 0, 32, held_prefix(tokens, 24, 32))
    prompt = PromptBlocks(tuple(tokens))
    assert index.cached_tokens("http://w16", prompt, plan) == 16
    assert index.cached_tokens("http://w32", prompt, plan) == 0


def test_a_snapshot_without_a_usable_block_size_is_refused_and_changes_nothing():
    index = KVIndex()
    index.apply_snapshot(URL, "decode", "e1", 0, BLOCK, blocks(b"a"))
    with pytest.raises(ValueError):
        index.apply_snapshot(URL, "decode", "e2", 0, 0, blocks(b"b"))
    assert index.worker(URL).epoch == "e1" and index.holders(b"a") == {URL}


@pytest.mark.parametrize("layer_specs", [
    [FullAttentionSpec()] * 2,
    [SlidingWindowSpec(10), FullAttentionSpec(), SlidingWindowSpec(10)],
], ids=["full", "sliding+full"])
def test_predictions_equal_each_workers_own_hits_when_block_sizes_differ(layer_specs):
    """Two workers of one model, blocks of 4 and of 8 tokens, behind one index and one prompt object each."""
    index = KVIndex()
    workers = [RecordingWorker(layer_specs, block_size=size, url=f"http://w{size}", index=index) for size in (4, 8)]
    rng = random.Random(2)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(12, 40))] for _ in range(6)]
    hits = {worker.url: 0 for worker in workers}
    num_unequal_hits = 0
    for step in range(80):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(50, 99) for _ in range(rng.randrange(0, 9))]
        prompt = PromptBlocks(tuple(tokens))  # shared by both predictions, as one request's is
        actuals = []
        for worker in workers:
            predicted, actual = worker.predicted_and_actual(prompt)
            assert predicted == actual, (step, worker.url, tokens)
            hits[worker.url] += actual > 0
            actuals.append(actual)
            worker.compute(f"r{step}", tokens)
        num_unequal_hits += actuals[0] != actuals[1]
    assert min(hits.values()) > 20 and all(worker.num_removed > 10 for worker in workers)
    assert num_unequal_hits > 20  # the block sizes mattered: one size served more of the prompt than the other


def tier_blocks(*names: bytes, medium: str = "cpu"):
    return [CachedBlock(name, None, 0, medium) for name in names]


def check_offload_count(index: KVIndex, url: str = URL) -> None:
    """The worker's count of tier keys (which lets matching skip the tier) is its keys' OFFLOAD bits."""
    worker = index.worker(url)
    assert worker.num_offload_keys == sum(1 for bits in worker.keys.values() if bits & Residence.OFFLOAD)


def test_events_with_a_medium_move_a_block_between_the_device_and_the_tier():
    recorder, index = recorder_and_empty_index()
    recorder.stored(b"a", None, 0)
    index.apply_events(URL, "e1", recorder.drain())
    check_offload_count(index)
    assert index.residence(URL, b"a") == Residence.DEVICE
    recorder.stored(b"a", None, 0, "cpu")  # the pool evicts it: the tier takes the page first
    recorder.removed(b"a", 0)
    index.apply_events(URL, "e1", recorder.drain())
    check_offload_count(index)
    assert index.residence(URL, b"a") == Residence.OFFLOAD and index.holders(b"a") == {URL}
    recorder.stored(b"a", None, 0)  # a hit loaded it back: the tier keeps its copy
    index.apply_events(URL, "e1", recorder.drain())
    check_offload_count(index)
    assert index.residence(URL, b"a") == Residence.DEVICE | Residence.OFFLOAD
    recorder.removed(b"a", 0, "cpu")  # the tier's own LRU dropped it
    index.apply_events(URL, "e1", recorder.drain())
    check_offload_count(index)
    assert index.residence(URL, b"a") == Residence.DEVICE
    recorder.removed(b"a", 0)
    index.apply_events(URL, "e1", recorder.drain())
    check_offload_count(index)
    assert index.residence(URL, b"a") is None and index.holders(b"a") == frozenset() and index.num_keys == 0


def test_cleared_empties_the_device_pool_and_leaves_the_tier_to_its_own_removals():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex()
    index.apply_snapshot(URL, "prefill", "e1", 0, BLOCK, [*blocks(b"a", b"b"), *tier_blocks(b"b", b"c")])
    recorder.removed(b"c", 0, "cpu")  # a reset drops the tier's unpinned pages one by one, then the pool at once
    recorder.cleared()
    index.apply_events(URL, "e1", recorder.drain())
    assert index.residence(URL, b"a") is None and index.residence(URL, b"c") is None
    assert index.residence(URL, b"b") == Residence.OFFLOAD  # pinned by a load in flight: still in the tier
    assert index.num_keys == 1
    check_offload_count(index)


def test_snapshot_entries_with_a_medium_are_tier_blocks_and_a_block_in_both_is_one_key():
    index = KVIndex()
    index.apply_snapshot(URL, "decode", "e1", 3, BLOCK, [*blocks(b"a", b"b"), *tier_blocks(b"b", b"c", medium="disk")])
    assert [index.residence(URL, name) for name in (b"a", b"b", b"c")] == [
        Residence.DEVICE, Residence.DEVICE | Residence.OFFLOAD, Residence.OFFLOAD]
    assert index.num_keys == 3 and index.num_blocks_by_role() == {"decode": 3}
    check_offload_count(index)


def test_the_key_bound_counts_a_key_once_wherever_the_worker_holds_it():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex(max_keys_per_worker=2)
    index.apply_snapshot(URL, "prefill", "e1", 0, BLOCK, [*blocks(b"a", b"b"), *tier_blocks(b"a")])
    assert index.num_keys_not_indexed == 0 and index.residence(URL, b"a") == Residence.DEVICE | Residence.OFFLOAD
    recorder.stored(b"b", None, 0, "cpu")  # a second medium for a key already held: no new key
    recorder.stored(b"c", None, 0, "cpu")  # a new key past the bound: not indexed
    recorder.removed(b"b", 0)
    index.apply_events(URL, "e1", recorder.drain())
    assert index.residence(URL, b"b") == Residence.OFFLOAD and index.residence(URL, b"c") is None
    assert len(index.worker(URL).keys) == 2 and index.num_keys_not_indexed == 1
    check_offload_count(index)


def test_the_prediction_splits_a_hit_into_device_tokens_and_the_tier_tokens_after_them():
    plan = plan_groups([FullAttentionSpec()])
    tokens = list(range(1, 18))  # 4 full blocks of 4, and the last token always computed
    hashes = hash_full_blocks(tokens, BLOCK, [])
    device = [CachedBlock(h, None, 0) for h in hashes[:2]]
    offloaded = [CachedBlock(h, None, 0, "cpu") for h in hashes[1:]]
    index = KVIndex()
    prompt = PromptBlocks(tuple(tokens))
    for url, held in [("http://device", device), ("http://both", device + offloaded),
                      ("http://tier", offloaded + [CachedBlock(hashes[0], None, 0, "disk")]), ("http://none", [])]:
        index.apply_snapshot(url, "prefill", "e1", 0, BLOCK, held)
    assert index.cached_prefix("http://device", prompt, plan) == CachedPrefix(8, 0)
    assert index.cached_prefix("http://both", prompt, plan) == CachedPrefix(16, 8)  # blocks 0-1 device, 2-3 tier
    assert index.cached_prefix("http://tier", prompt, plan) == CachedPrefix(16, 16)
    assert index.cached_prefix("http://none", prompt, plan) == CachedPrefix(0, 0)
    assert index.cached_tokens("http://both", prompt, plan) == 16


@pytest.mark.parametrize("layer_specs", [
    [FullAttentionSpec()] * 2,
    [SlidingWindowSpec(6), SlidingWindowSpec(6), FullAttentionSpec(), SlidingWindowSpec(6)],
], ids=["full", "sliding+full"])
def test_predictions_with_an_offload_tier_equal_the_workers_own_hits_and_their_tier_share(layer_specs):
    """A pool of 24 blocks behind a tier of 40 pages, fed more prompts than the pool holds: every prediction
    equals the worker's own hit and the tokens it loads from the tier, from the event history and from a fresh
    snapshot alike."""
    worker = RecordingWorker(layer_specs, num_blocks=24, offload_slots=40)
    rng = random.Random(3)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 30))] for _ in range(10)]
    num_tier_hits = 0
    for step in range(120):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(50, 99) for _ in range(rng.randrange(0, 9))]
        prompt = PromptBlocks(tuple(tokens))
        predicted, actual = worker.predicted_and_actual_prefixes(prompt)
        assert predicted == actual, (step, tokens)
        resynced = KVIndex()
        worker.resync(resynced)
        assert resynced.cached_prefix(worker.url, prompt, worker.manager.plan) == actual, (step, tokens)
        num_tier_hits += actual.num_offload_tokens > 0
        worker.compute(f"r{step}", tokens)
        check_offload_count(worker.index)
    assert num_tier_hits > 15  # the tier served real hits
    assert worker.manager.offload.stats.num_loads > 15 and worker.num_removed > 20
