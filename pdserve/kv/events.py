"""KV events: an ordered record of what enters and leaves a worker's prefix cache.

Invariant: sequence numbers are stamped on the engine thread, one per event,
consecutive within an epoch, so a reader that sees a jump knows it lost events
(the buffer is bounded and overwrites its oldest entries rather than block the
engine). Recording is off until someone listens. Torch-free; never blocks.

    engine thread                         async side (pdserve/server/kv_events.py)
    BlockPool.cache / evict / clear ──▶ deque(maxlen) ──drain()──▶ subscribers
                 seq 1, 2, 3, ...                       (a gap in seq: resync)
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Optional

DEFAULT_CAPACITY = 1 << 16  # events buffered between two drains before the oldest are lost


class KVEventKind(str, enum.Enum):
    STORED = "stored"  # a full block became findable under (block_hash, group)
    REMOVED = "removed"  # it no longer is (evicted for reuse, or its key dropped)
    CLEARED = "cleared"  # every key of the device pool was dropped at once (a tier reports its own removals)


@dataclass(slots=True)
class KVEvent:
    """One change of the prefix cache; hashes are the chained block hashes of kv/hashing.py."""

    seq: int
    kind: KVEventKind
    block_hash: Optional[bytes] = None
    parent_hash: Optional[bytes] = None  # None for a prompt's first block (and on REMOVED/CLEARED)
    group_id: int = 0
    medium: Optional[str] = None  # None: the device pool; else the offload tier's: "cpu" (host memory), "disk" (files)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A block findable in the prefix cache, as a snapshot lists it."""

    block_hash: bytes
    parent_hash: Optional[bytes]
    group_id: int
    medium: Optional[str] = None  # as KVEvent.medium


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The whole cache as of event `seq`: every event up to `seq` is reflected, none after."""

    seq: int
    blocks: tuple[CachedBlock, ...]


class KVEventRecorder:
    """Engine-thread producer. `stored`/`removed`/`cleared` are called by the block pool where keys
    enter and leave its cache map; they cost one record and one deque append, and nothing when
    recording is off. `drain` may be called from any thread (deque appends and pops are atomic)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._last_seq = 0
        # Flipped by the async side; read on the engine thread. A stale read only
        # records (or skips) an event that the next snapshot covers anyway.
        self.enabled = False
        self.num_recorded = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event stamped (engine thread)."""
        return self._last_seq

    def stored(self, block_hash: bytes, parent_hash: Optional[bytes], group_id: int,
               medium: Optional[str] = None) -> None:
        if self.enabled:
            self._append(KVEventKind.STORED, block_hash, parent_hash, group_id, medium)

    def removed(self, block_hash: bytes, group_id: int, medium: Optional[str] = None) -> None:
        if self.enabled:
            self._append(KVEventKind.REMOVED, block_hash, None, group_id, medium)

    def cleared(self) -> None:
        if self.enabled:
            self._append(KVEventKind.CLEARED, None, None, 0)

    def _append(self, kind: KVEventKind, block_hash: Optional[bytes], parent_hash: Optional[bytes],
                group_id: int, medium: Optional[str] = None) -> None:
        self._last_seq += 1
        self.num_recorded += 1
        self._events.append(KVEvent(self._last_seq, kind, block_hash, parent_hash, group_id, medium))

    def drain(self, max_events: int = 1 << 20) -> list[KVEvent]:
        """Take up to `max_events` buffered events, oldest first."""
        taken: list[KVEvent] = []
        pop = self._events.popleft
        try:
            while len(taken) < max_events:
                taken.append(pop())
        except IndexError:
            pass
        return taken

    def discard_buffered(self) -> None:
        self._events.clear()
