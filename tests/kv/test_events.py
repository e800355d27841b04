"""KV events at the source: the recorder, the block pool's hooks, the manager's snapshot, the wire format."""

from __future__ import annotations

import pytest

from pdserve.kv.block_pool import BlockPool
from pdserve.kv.events import CachedBlock, KVEventKind, KVEventRecorder, KVSnapshot
from pdserve.kv.events_wire import (
    EVENTS, HEARTBEAT, SNAPSHOT, KVWireError, decode_line, encode_events, encode_heartbeat, encode_snapshot,
)
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, plan_groups

BLOCK = 4


def recording() -> KVEventRecorder:
    recorder = KVEventRecorder()
    recorder.enabled = True
    return recorder


def test_recorder_records_nothing_until_enabled():
    recorder = KVEventRecorder()
    recorder.stored(b"h", None, 0)
    recorder.removed(b"h", 0)
    recorder.cleared()
    assert recorder.drain() == [] and recorder.last_seq == 0


def test_recorder_stamps_consecutive_sequence_numbers_and_drains_in_order():
    recorder = recording()
    recorder.stored(b"a", None, 0)
    recorder.stored(b"b", b"a", 1)
    recorder.removed(b"a", 0)
    recorder.cleared()
    events = recorder.drain()
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [e.kind for e in events] == [KVEventKind.STORED, KVEventKind.STORED, KVEventKind.REMOVED,
                                        KVEventKind.CLEARED]
    assert (events[1].block_hash, events[1].parent_hash, events[1].group_id) == (b"b", b"a", 1)
    assert recorder.drain() == []


def test_a_full_recorder_drops_its_oldest_events_and_the_gap_shows_in_the_sequence():
    recorder = KVEventRecorder(capacity=3)
    recorder.enabled = True
    for name in (b"a", b"b", b"c", b"d", b"e"):
        recorder.stored(name, None, 0)
    assert [e.seq for e in recorder.drain()] == [3, 4, 5]
    assert recorder.drain(max_events=0) == []


def test_pool_reports_a_key_when_cached_and_when_evicted():
    recorder = recording()
    pool = BlockPool(3, recorder)
    first, second = pool.allocate(2, group_id=0)
    assert pool.cache(first, b"h1", 0, None) and pool.cache(second, b"h2", 0, b"h1")
    pool.free([second, first])
    pool.check_invariants()
    pool.allocate(1, group_id=0)  # evicts the least recently freed cached block
    pool.check_invariants()
    events = recorder.drain()
    assert [(e.kind, e.block_hash, e.parent_hash) for e in events] == [
        (KVEventKind.STORED, b"h1", None), (KVEventKind.STORED, b"h2", b"h1"), (KVEventKind.REMOVED, b"h2", None)]


def test_pool_reports_nothing_for_a_key_another_block_already_holds():
    recorder = recording()
    pool = BlockPool(4, recorder)
    first, second = pool.allocate(2, group_id=0)
    assert pool.cache(first, b"same", 0)
    assert not pool.cache(second, b"same", 0)
    assert [e.block_hash for e in recorder.drain()] == [b"same"]


def test_clear_cache_drops_every_key_keeps_blocks_in_use_and_reports_one_event():
    recorder = recording()
    pool = BlockPool(5, recorder)
    held, freed = pool.allocate(2, group_id=0)
    pool.cache(held, b"held", 0)
    pool.cache(freed, b"freed", 0)
    pool.free([freed])
    recorder.drain()
    assert pool.clear_cache() == 2
    pool.check_invariants()
    assert pool.num_cached == 0 and pool.num_cached_free == 0 and pool.num_in_use == 1
    assert pool.lookup(b"held", 0) is None and pool.ref_count(held) == 1
    pool.free([held])
    pool.check_invariants()
    assert pool.num_uncached_free == 4
    assert [e.kind for e in recorder.drain()] == [KVEventKind.CLEARED]


def test_manager_commits_blocks_with_their_parent_hashes_and_snapshots_them_with_the_last_seq():
    recorder = recording()
    plan = plan_groups([FullAttentionSpec()] * 2)
    manager = KVCacheManager(plan, num_blocks=16, block_size=BLOCK, events=recorder)
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, BLOCK, [])
    assert manager.allocate_slots("r", 0, len(tokens))
    manager.commit("r", hashes, len(tokens))
    manager.check_invariants()
    events = recorder.drain()
    assert [(e.block_hash, e.parent_hash) for e in events] == [(hashes[0], None), (hashes[1], hashes[0])]
    snapshot = manager.snapshot_cache()
    assert snapshot == KVSnapshot(2, (CachedBlock(hashes[0], None, 0), CachedBlock(hashes[1], hashes[0], 0)))
    assert manager.clear_prefix_cache() == 2
    assert manager.snapshot_cache() == KVSnapshot(3, ())


def test_wire_format_round_trips_each_kind_of_line():
    recorder = recording()
    recorder.stored(b"\x01" * 32, None, 0)
    recorder.stored(b"\x02" * 32, b"\x01" * 32, 1)
    recorder.removed(b"\x01" * 32, 0)
    recorder.cleared()
    events = recorder.drain()
    decoded = decode_line(encode_events("ep", events, block_size=16))
    assert (decoded.type, decoded.epoch, decoded.seq, decoded.events) == (EVENTS, "ep", 4, events)
    snapshot = KVSnapshot(7, (CachedBlock(b"\x01" * 32, None, 0), CachedBlock(b"\x02" * 32, b"\x01" * 32, 2)))
    decoded = decode_line(encode_snapshot("ep", snapshot, block_size=16))
    assert (decoded.type, decoded.seq, decoded.block_size, tuple(decoded.blocks)) == (SNAPSHOT, 7, 16, snapshot.blocks)
    decoded = decode_line(encode_heartbeat("ep", 9))
    assert (decoded.type, decoded.epoch, decoded.seq) == (HEARTBEAT, "ep", 9)


@pytest.mark.parametrize("line", [b"not json", b"[]", b'{"type": "nope", "epoch": "e"}', b'{"type": "events"}',
                                  b'{"type": "events", "epoch": "e", "events": []}',
                                  b'{"type": "events", "epoch": "e", "events": [[1, "bogus", null, null, 0, 0]]}',
                                  b'{"type": "snapshot", "epoch": "e", "seq": 1, "block_size": 4, "blocks": [["zz", null, 0]]}'])
def test_malformed_lines_raise_a_wire_error(line):
    with pytest.raises(KVWireError):
        decode_line(line)
