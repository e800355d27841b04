"""The proxy's KV index: snapshots and events per worker, gaps detected, and predictions equal to what the
worker's own prefix cache finds (full attention and a Gemma-like hybrid of sliding and full groups)."""

from __future__ import annotations

import random

import pytest

from pdserve.kv.events import KVEventRecorder
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from proxy.routing.kv_index import KVIndex, SequenceGap

BLOCK = 4
URL = "http://w0"


class RecordingWorker:
    """A worker's KV manager whose events feed an index, as the event stream would."""

    def __init__(self, layer_specs, num_blocks: int = 48):
        self.recorder = KVEventRecorder()
        self.recorder.enabled = True
        self.manager = KVCacheManager(plan_groups(layer_specs), num_blocks, BLOCK, events=self.recorder)
        self.index = KVIndex()
        self.num_removed = 0
        snapshot = self.manager.snapshot_cache()
        self.index.apply_snapshot(URL, "prefill", "e1", snapshot.seq, snapshot.blocks)

    def compute(self, request_id: str, tokens: list[int]) -> None:
        """Admit with the cache's hit, compute the rest, commit, free (LRU eviction as the pool goes)."""
        hashes = hash_full_blocks(tokens, BLOCK, [])
        hit = self.manager.find_prefix(hashes, len(tokens))
        if not self.manager.allocate(request_id, hit.num_tokens, len(tokens) - hit.num_tokens, hit):
            return
        self.manager.commit(request_id, hashes, len(tokens))
        self.manager.free(request_id)
        self.manager.check_invariants()
        events = self.recorder.drain()
        self.num_removed += sum(event.kind.value == "removed" for event in events)
        self.index.apply_events(URL, "e1", events)

    def predicted_and_actual(self, tokens: list[int]) -> tuple[int, int]:
        hashes = hash_full_blocks(tokens, BLOCK, [])
        predicted = self.index.cached_tokens(URL, hashes, len(tokens), self.manager.plan, BLOCK)
        return predicted, self.manager.find_prefix(hashes, len(tokens)).num_tokens


def blocks(*names: bytes):
    from pdserve.kv.events import CachedBlock

    return [CachedBlock(name, None, 0) for name in names]


def test_a_snapshot_replaces_everything_known_of_a_worker():
    index = KVIndex()
    index.apply_snapshot(URL, "decode", "e1", 5, blocks(b"a", b"b"))
    index.apply_snapshot("http://w1", "decode", "x", 1, blocks(b"a"))
    assert index.holders(b"a") == {URL, "http://w1"}
    index.apply_snapshot(URL, "decode", "e2", 0, blocks(b"c"))
    assert index.holders(b"a") == {"http://w1"} and index.holders(b"b") == frozenset()
    assert index.holders(b"c") == {URL} and index.worker(URL).epoch == "e2"
    assert index.num_keys == 2 and index.num_blocks_by_role() == {"decode": 2}


def test_events_must_continue_the_worker_history_or_raise_a_gap():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex()
    index.apply_snapshot(URL, "prefill", "e1", 0, [])
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
    index.apply_snapshot(URL, "prefill", "e1", 0, blocks(b"x"))
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
    assert index.cached_tokens(URL, [b"b"], 8, plan_groups([FullAttentionSpec()]), BLOCK) == 0


def test_a_worker_cannot_grow_the_index_past_its_bound_and_removals_still_apply():
    recorder = KVEventRecorder()
    recorder.enabled = True
    index = KVIndex(max_keys_per_worker=3)
    index.apply_snapshot(URL, "prefill", "e1", 0, blocks(b"a", b"b", b"c", b"d"))  # one past the bound
    index.apply_snapshot("http://w1", "prefill", "e1", 0, blocks(b"a"))  # others keep their own room
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
        predicted, actual = worker.predicted_and_actual(tokens)
        assert predicted == actual, (step, tokens)
        num_checked_hits += actual > 0
        worker.compute(f"r{step}", tokens)
    assert num_checked_hits > 20  # the churn exercised real hits, not only misses
    assert worker.num_removed > 20  # and evictions
