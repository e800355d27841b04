"""The async side of a worker's KV events: drains the engine's recorder and fans lines out to subscribers.

Invariant: every subscriber first gets a snapshot taken on the engine thread,
then exactly the events stamped after it, in order; when the recorder lost
events (its buffer overflowed) everyone gets a fresh snapshot, and a
subscriber too slow to take its lines is cut off (it reconnects and gets a
snapshot). The engine thread only appends records and, rarely, lists its
cache for a snapshot; it never waits on a subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.api.errors import EngineOverloaded
from pdserve.kv.events import KVEvent, KVEventRecorder, KVSnapshot
from pdserve.kv.events_wire import encode_events, encode_heartbeat, encode_snapshot
from pdserve.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)

T = TypeVar("T")

POLL_INTERVAL_S = 0.02
HEARTBEAT_INTERVAL_S = 1.0
SNAPSHOT_TIMEOUT_S = 10.0  # the engine thread answers between two steps
MAX_PENDING_LINES = 4096  # a subscriber this far behind is cut off
# Each subscriber costs a snapshot of the prefix cache taken on the engine thread; routers need one
# stream per proxy replica, so this leaves room for many proxies and none for a flood.
MAX_SUBSCRIBERS = 32


@dataclass(frozen=True)
class KVEventSource:
    """What the hub needs of a loaded engine. `run_on_engine` is `EngineLoop.call_soon`."""

    recorder: KVEventRecorder
    kv_manager: KVCacheManager
    run_on_engine: Callable[[Callable[[], None]], None]
    epoch: str
    block_size: int
    is_serving: Callable[[], bool] = lambda: True  # False once draining or dead: streams end


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.events = Counter("pdserve_kv_events_total", "Prefix-cache events published, by kind.",
                              ["kind"], registry=registry)
        self.snapshots = Counter("pdserve_kv_events_snapshots_total",
                                 "Snapshots sent to KV event subscribers, by reason (subscribe, overflow).",
                                 ["reason"], registry=registry)
        self.cut_off = Counter("pdserve_kv_events_subscribers_cut_total",
                               "KV event subscribers disconnected for falling behind.", registry=registry)
        self.refused = Counter("pdserve_kv_events_subscribers_refused_total",
                               "KV event subscriptions refused because the worker had as many as it takes.",
                               registry=registry)
        self.subscribers = Gauge("pdserve_kv_events_subscribers", "Connected KV event subscribers.",
                                 registry=registry)


@dataclass(eq=False)
class _Subscriber:
    lines: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    after_seq: Optional[int] = None  # None until its snapshot is sent
    cut: bool = False

    def send(self, line: bytes) -> None:
        if self.cut:
            return
        if len(self.lines) >= MAX_PENDING_LINES:
            self.cut = True
            self.lines.clear()
        else:
            self.lines.append(line)
        self.wake.set()


class KVEventHub:
    """One per worker process; created on the server's event loop."""

    def __init__(self, source: KVEventSource, metrics: KVEventMetrics,
                 poll_interval_s: float = POLL_INTERVAL_S, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 max_subscribers: int = MAX_SUBSCRIBERS):
        self._source = source
        self._max_subscribers = max_subscribers
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._subscribers: set[_Subscriber] = set()
        self._pump: Optional[asyncio.Task] = None
        self._next_seq = 0  # the seq the next drained event must carry

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def check_capacity(self) -> None:
        """`EngineOverloaded` (503) when no more subscribers are taken; `stream` enforces it too."""
        if self._refuse_one():
            raise EngineOverloaded(f"this worker already streams KV events to {self._max_subscribers} subscribers")

    def _refuse_one(self) -> bool:
        """True (and counted) when the hub is full."""
        full = len(self._subscribers) >= self._max_subscribers
        if full:
            self._metrics.refused.inc()
        return full

    async def stream(self) -> AsyncIterator[bytes]:
        """The NDJSON lines of one subscription: a snapshot, then events and heartbeats. A stream begun past
        the subscriber cap (several opened at once after `check_capacity`) ends at once, empty."""
        if self._refuse_one():
            return
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        self._metrics.subscribers.set(len(self._subscribers))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run_pump(), name="kv-events-pump")
        try:
            while True:
                await subscriber.wake.wait()
                subscriber.wake.clear()
                if subscriber.cut:
                    self._metrics.cut_off.inc()
                    logger.warning("a KV event subscriber fell %d lines behind; disconnecting it", MAX_PENDING_LINES)
                    return
                lines = b"".join(subscriber.lines)
                subscriber.lines.clear()
                yield lines
        finally:
            self._subscribers.discard(subscriber)
            self._metrics.subscribers.set(len(self._subscribers))

    async def _run_pump(self) -> None:
        recorder = self._source.recorder
        recorder.enabled = True
        self._next_seq = 0
        last_heartbeat_s = time.monotonic()
        try:
            while self._subscribers:
                if not self._source.is_serving():
                    # A draining worker must be able to exit: end every stream (they would
                    # otherwise hold the server open), the proxies reconnect elsewhere.
                    self._cut_all()
                    break
                await self._tick()
                if time.monotonic() - last_heartbeat_s >= self._heartbeat_interval_s:
                    last_heartbeat_s = time.monotonic()
                    self._send_heartbeats()
                await asyncio.sleep(self._poll_interval_s)
        except Exception:  # noqa: BLE001 - a broken pump must not leave subscribers hanging
            logger.exception("the KV event pump failed; disconnecting its subscribers")
            self._cut_all()
        finally:
            recorder.enabled = False
            recorder.discard_buffered()

    def _cut_all(self) -> None:
        for subscriber in self._subscribers:
            subscriber.cut = True
            subscriber.wake.set()

    async def _tick(self) -> None:
        # Events at or before the last snapshot's seq are already in it.
        events = [e for e in self._source.recorder.drain() if e.seq >= self._next_seq]
        if self._next_seq and events and not _consecutive(events, self._next_seq):
            # The recorder overflowed: resync everyone. The snapshot is taken after this
            # drain, so it covers every event drained here.
            for subscriber in self._subscribers:
                subscriber.after_seq = None
            await self._send_snapshots("overflow")
            return
        if any(subscriber.after_seq is None for subscriber in self._subscribers):
            await self._send_snapshots("subscribe")
            events = [e for e in events if e.seq >= self._next_seq]
        if events:
            self._next_seq = events[-1].seq + 1
            for event in events:
                self._metrics.events.labels(event.kind.value).inc()
            self._deliver(events)

    async def _send_snapshots(self, reason: str) -> None:
        """One snapshot for every subscriber that needs one. Subscribers already streaming keep
        their place; when none is (the first, or after an overflow) draining restarts after it."""
        streaming = any(subscriber.after_seq is not None for subscriber in self._subscribers)
        snapshot = await self._take_snapshot()
        line = encode_snapshot(self._source.epoch, snapshot, self._source.block_size)
        for subscriber in self._subscribers:
            if subscriber.after_seq is None:
                subscriber.after_seq = snapshot.seq
                subscriber.send(line)
                self._metrics.snapshots.labels(reason).inc()
        if not streaming:
            self._next_seq = snapshot.seq + 1

    async def _take_snapshot(self) -> KVSnapshot:
        return await run_on_engine_thread(self._source.run_on_engine, self._source.kv_manager.snapshot_cache)

    def _deliver(self, events: list[KVEvent]) -> None:
        epoch, block_size = self._source.epoch, self._source.block_size
        shared: Optional[bytes] = None
        for subscriber in self._subscribers:
            if subscriber.after_seq is None:
                continue
            if subscriber.after_seq < events[0].seq:
                shared = shared or encode_events(epoch, events, block_size)
                subscriber.send(shared)
            else:  # its snapshot already covers some of these
                newer = [e for e in events if e.seq > subscriber.after_seq]
                if newer:
                    subscriber.send(encode_events(epoch, newer, block_size))
            subscriber.after_seq = max(subscriber.after_seq, events[-1].seq)

    def _send_heartbeats(self) -> None:
        for subscriber in self._subscribers:
            if subscriber.after_seq is not None:
                subscriber.send(encode_heartbeat(self._source.epoch, subscriber.after_seq))


def _consecutive(events: list[KVEvent], first_seq: int) -> bool:
    return events[0].seq == first_seq and events[-1].seq - first_seq + 1 == len(events)


async def run_on_engine_thread(run_on_engine: Callable[[Callable[[], None]], None], function: Callable[[], T],
                                timeout_s: float = SNAPSHOT_TIMEOUT_S) -> T:
    """Run a short, non-blocking `function` on the engine thread and await its result here."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def on_engine_thread() -> None:
        try:
            result = function()
        except Exception as exc:  # noqa: BLE001 - reported to the awaiting side
            loop.call_soon_threadsafe(_settle, answer, None, exc)
            return
        loop.call_soon_threadsafe(_settle, answer, result, None)

    run_on_engine(on_engine_thread)
    return await asyncio.wait_for(answer, timeout_s)


def _settle(future: asyncio.Future, result: object, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
