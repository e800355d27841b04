"""The worker's KV event hub: snapshot then deltas per subscriber, resync after an overflow,
streams end when the worker stops serving, slow subscribers are cut off. A real manager and
recorder; the "engine thread" runs submitted functions at once on the test's loop."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from pdserve.api.errors import EngineOverloaded
from pdserve.kv.events import KVEventRecorder
from pdserve.kv.events_wire import EVENTS, HEARTBEAT, SNAPSHOT, StreamMessage, decode_line
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.server import kv_events
from pdserve.server.kv_events import KVEventHub, KVEventMetrics, KVEventSource

pytestmark = pytest.mark.anyio
BLOCK = 4


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the hub uses asyncio primitives


class Worker:
    def __init__(self, capacity: int = 1024):
        self.recorder = KVEventRecorder(capacity)
        self.manager = KVCacheManager(plan_groups([FullAttentionSpec()]), 64, BLOCK, events=self.recorder)
        self.serving = True
        self.source = KVEventSource(self.recorder, self.manager, lambda fn: fn(), "epoch-1", BLOCK,
                                    lambda: self.serving)
        self.hub = KVEventHub(self.source, KVEventMetrics(CollectorRegistry()), poll_interval_s=0.005,
                              heartbeat_interval_s=0.05)

    def compute(self, request_id: str, tokens: list[int]) -> list[bytes]:
        hashes = hash_full_blocks(tokens, BLOCK, [])
        assert self.manager.allocate_slots(request_id, 0, len(tokens))
        self.manager.commit(request_id, hashes, len(tokens))
        self.manager.free(request_id)
        return hashes


class Reader:
    """A subscriber that decodes lines as they come."""

    def __init__(self, stream: AsyncIterator[bytes]):
        self.messages: list[StreamMessage] = []
        self.ended = False
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: AsyncIterator[bytes]) -> None:
        async for chunk in stream:
            self.messages += [decode_line(line) for line in chunk.splitlines() if line]
        self.ended = True

    async def wait_for(self, predicate, timeout_s: float = 2.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError([m.type for m in self.messages])
            await asyncio.sleep(0.005)

    def held(self) -> set[bytes]:
        """The blocks this reader believes the worker holds, replaying what it read."""
        held: set[bytes] = set()
        last_seq = None
        for message in self.messages:
            if message.type == SNAPSHOT:
                held = {b.block_hash for b in message.blocks}
                last_seq = message.seq
            elif message.type == EVENTS:
                for event in message.events:
                    assert event.seq == last_seq + 1
                    last_seq = event.seq
                    if event.kind.value == "stored":
                        held.add(event.block_hash)
                    elif event.kind.value == "removed":
                        held.discard(event.block_hash)
                    else:
                        held.clear()
        return held

    def cancel(self) -> None:
        self._task.cancel()


def types(reader: Reader) -> list[str]:
    return [m.type for m in reader.messages if m.type != HEARTBEAT]


def truth(worker: Worker) -> set[bytes]:
    return {b.block_hash for b in worker.manager.snapshot_cache().blocks}


async def test_a_subscriber_gets_a_snapshot_then_every_later_change_in_order():
    worker = Worker()
    first = worker.compute("a", list(range(12)))
    reader = Reader(worker.hub.stream())
    await reader.wait_for(lambda r: types(r) == [SNAPSHOT])
    assert {b.block_hash for b in reader.messages[0].blocks} == set(first)
    worker.compute("b", list(range(100, 108)))
    await reader.wait_for(lambda r: EVENTS in types(r))
    worker.manager.clear_prefix_cache()
    await reader.wait_for(lambda r: r.held() == set())
    await reader.wait_for(lambda r: HEARTBEAT in [m.type for m in r.messages])
    reader.cancel()


async def test_a_late_subscriber_gets_what_is_cached_then_only_newer_events():
    worker = Worker()
    early = Reader(worker.hub.stream())
    await early.wait_for(lambda r: types(r) == [SNAPSHOT])
    worker.compute("a", list(range(8)))
    await early.wait_for(lambda r: r.held() == truth(worker))
    late = Reader(worker.hub.stream())
    await late.wait_for(lambda r: types(r) == [SNAPSHOT])
    assert late.held() == truth(worker)
    worker.compute("b", list(range(50, 62)))
    for reader in (early, late):
        await reader.wait_for(lambda r: r.held() == truth(worker))
    early.cancel()
    late.cancel()


async def test_lost_events_make_everyone_resync_from_a_fresh_snapshot():
    worker = Worker(capacity=2)
    reader = Reader(worker.hub.stream())
    await reader.wait_for(lambda r: types(r) == [SNAPSHOT])
    worker.compute("a", list(range(40)))  # 10 blocks between two drains: the buffer keeps 2
    await reader.wait_for(lambda r: types(r).count(SNAPSHOT) == 2)
    await reader.wait_for(lambda r: r.held() == truth(worker) and len(truth(worker)) == 10)
    reader.cancel()


async def test_streams_end_when_the_worker_stops_serving_and_recording_stops():
    worker = Worker()
    reader = Reader(worker.hub.stream())
    await reader.wait_for(lambda r: types(r) == [SNAPSHOT])
    assert worker.recorder.enabled
    worker.serving = False
    await reader.wait_for(lambda r: r.ended)
    await asyncio.sleep(0.02)
    assert not worker.recorder.enabled and worker.hub.num_subscribers == 0


async def test_a_subscriber_that_does_not_read_is_cut_off(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_PENDING_LINES", 3)
    worker = Worker()
    stream = worker.hub.stream()
    first = await stream.__anext__()  # subscribes; then never reads again while events pile up
    assert decode_line(first.splitlines()[0]).type == SNAPSHOT
    for index in range(6):
        worker.compute(f"r{index}", list(range(index * 10, index * 10 + 4)))
        await asyncio.sleep(0.02)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert worker.hub.num_subscribers == 0


async def test_subscribers_past_the_cap_are_refused_and_a_freed_slot_is_taken_again():
    worker = Worker()
    worker.hub = KVEventHub(worker.source, KVEventMetrics(CollectorRegistry()), poll_interval_s=0.005,
                            heartbeat_interval_s=0.05, max_subscribers=2)
    readers = [Reader(worker.hub.stream()) for _ in range(2)]
    for reader in readers:
        await reader.wait_for(lambda r: types(r) == [SNAPSHOT])
    with pytest.raises(EngineOverloaded):  # what the route answers: 503 before any work
        worker.hub.check_capacity()
    late = Reader(worker.hub.stream())  # begun past the cap anyway (opened together): ends at once, empty
    await late.wait_for(lambda r: r.ended)
    assert late.messages == [] and worker.hub.num_subscribers == 2
    readers[0].cancel()
    await readers[1].wait_for(lambda r: worker.hub.num_subscribers == 1)
    worker.hub.check_capacity()
    again = Reader(worker.hub.stream())
    await again.wait_for(lambda r: types(r) == [SNAPSHOT])
    readers[1].cancel()
    again.cancel()
