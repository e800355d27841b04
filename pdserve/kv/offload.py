"""The offload tier: whole pages behind the device pool, keyed like the prefix cache.

Invariant: a key (block hash, group) names at most one slot, and a slot holds
(or, its write queued, will hold before any read of it runs) the bytes of the
page last stored under the key it is recorded with; a slot pinned by a load is
never reused until the load ends. Torch-free: the bytes move through a
`PageStore` (pdserve/kv/offload_host.py, offload_file.py).

    device pool (one page per block)             tier (one slot per page, own LRU)
    cached free LRU: [b7 b3 b9 ...] --evict b7--> store b7 in slot 4   (hash, group) -> 4
                       host memory: write(4, b7), one memcpy, on the engine thread
                       file: stage(b7), one copy, then write_staged on the I/O thread
    prefix hit on (hash, group) in the tier  <--- read([4], [b12])    b12 newly allocated
                       host memory: inside start_load; file: on the I/O thread, after queued writes

Write-back, not write-through: a page is copied when the pool is about to
evict it (`offer`, the pool's eviction hook), while its content is still
intact (the step that overwrites the block runs after the allocation that
evicted it). Only pages that actually leave the pool pay a copy, once; a
write-through tier would copy every committed page after every prefill,
though a working set that fits in the pool never needs one, and would still
need a fence before a block is reused. For host memory the copy is one page
memcpy on the engine thread between steps. For a file the engine thread only
copies the page into a staging row (pdserve/kv/offload_writes.py); the pwrite
and its checksum run on the tier's one I/O thread, and a store that finds every
staging row busy is skipped (counted), never waited for. The key is findable
at once: a load of it is queued on the same thread after the write.

Sliding-window rule: a block of a sliding-window group is stored only while
the full-attention block at the same position (same chained hash) is cached
on the device or in the tier. A hit can reach past position i only through
the full-attention chain, so without that block no hit can ever have this
block in its window; and when the tier drops a full-attention entry it drops
the sliding entries of the same hash with it. Loads follow the prefix rule
(pdserve/kv/prefix.py): a sliding group loads only the blocks in its window
at the hit point.

Loads are asynchronous in form: `start_load` then `poll`, like a remote pull,
so the scheduler keeps the request in its loading state meanwhile. The host
store copies inside `start_load` (a memcpy of a few pages); the file store
reads on the I/O thread and `poll` reports it the same way. A load that fails
(or whose slot no longer holds its key) discards its keys and is reported
failed: the request recomputes. A store whose write failed discards its key
when the engine thread learns of it (`offer`, `lookup`, `poll`).

Tensor parallelism: a `TierMirror` repeats every copy this tier starts on the
other ranks' slices (pdserve/runner/offload_ranks.py); with an I/O thread a
load lands only once every rank's read ended, and fails if any rank's did.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from pdserve.kv.events import CachedBlock, KVEventRecorder
from pdserve.kv.offload_writes import StagingPageStore, WriteQueue, require_serial

logger = logging.getLogger(__name__)

CacheKey = tuple[bytes, int]  # (chained block hash, group id), as in the block pool


class OffloadIOError(RuntimeError):
    """A page could not be written to or read from the tier's medium."""


def store_geometry(pool_shape: Sequence[int], pool_is_int8: bool, capacity_bytes: int) -> tuple[int, int]:
    """(page_bytes, slots) of a page store over the pool's canonical int8 view [num_blocks, page_bytes];
    ValueError when it is not that view or the capacity holds no page."""
    if len(pool_shape) != 2 or not pool_is_int8:
        raise ValueError("the page store copies rows of the pool's canonical int8 view")
    page_bytes = int(pool_shape[1])
    num_slots = capacity_bytes // page_bytes
    if num_slots < 1:
        raise ValueError(f"--kv-offload-bytes {capacity_bytes} holds no page of {page_bytes} bytes")
    return page_bytes, num_slots


class PageStore(Protocol):
    """Where a tier keeps its pages: `num_slots` slots of one pool page each."""

    medium: str  # reported in KV events: "cpu", "disk"
    num_slots: int
    page_bytes: int

    def write(self, slot: int, block_id: int) -> None:
        """Copy pool page `block_id` into `slot` on the calling thread; raise OffloadIOError when it cannot."""

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy each slot into its pool page; raise OffloadIOError when it cannot."""

    def close(self) -> None:
        """Release the medium (a file store's descriptor and directory lock); memory needs nothing."""


class TierMirror(Protocol):
    """The other ranks of a tensor-parallel worker, repeating this tier's copies on their own slices
    (pdserve/runner/offload_ranks.py). Called on the engine thread, in the order the copies were made."""

    def stored(self, slot: int, block_id: int) -> None:
        """A page went into `slot` (written, or staged for the I/O thread): the others copy theirs
        before anything reuses the block."""

    def loading(self, load_id: str, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """A load started: the others read the same slots into the same blocks."""

    def others_read(self, load_id: str) -> Optional["OthersRead"]:
        """None while another rank still reads this load (asked only once this rank's read ended),
        then, once, how the other ranks' reads ended."""


@dataclass(frozen=True, slots=True)
class OthersRead:
    """How the other ranks' reads of one load ended: `error` is why one failed, None if none did."""

    error: Optional[str] = None


@dataclass(slots=True)
class PageLoad:
    """One page to bring back: tier key -> a freshly allocated pool block."""

    block_id: int
    block_hash: bytes
    group_id: int
    parent_hash: Optional[bytes]


@dataclass(slots=True)
class OffloadStats:
    """Monotonic counters (the engine's stats turn deltas into metrics)."""

    num_store_bytes: int = 0
    num_load_bytes: int = 0
    num_stores: int = 0
    num_loads: int = 0  # load batches that landed
    num_failed_loads: int = 0
    num_failed_stores: int = 0  # the medium refused the write
    num_skipped_stores: int = 0  # no room right now: every staging row or every slot busy
    store_seconds: list[float] = field(default_factory=list)  # drained by the stats
    load_seconds: list[float] = field(default_factory=list)


@dataclass(slots=True)
class LoadResults:
    landed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class OffloadTier:
    """Index, LRU and sliding rule of one worker's tier (engine thread only, never blocks)."""

    def __init__(self, store: PageStore, full_group_ids: Sequence[int],
                 events: Optional[KVEventRecorder] = None, clock: Callable[[], float] = time.perf_counter,
                 executor: Optional[Executor] = None, mirror: Optional[TierMirror] = None,
                 wake: Optional[Callable[[], None]] = None):
        """`executor`: the tier's one I/O thread, where reads run, and writes too for a store that
        stages them (the file store); None copies inside `offer` and `start_load`. `mirror`: the
        other ranks of a tensor-parallel worker (with an executor, a load lands once they read too).
        `wake`: called (from any thread; it must not block) whenever a load has a result for `poll`,
        so the engine loop polls at once instead of waiting out its poll interval; None: nobody waits."""
        if store.num_slots < 1:
            raise ValueError("an offload tier needs room for at least one page")
        if executor is not None:
            require_serial(executor)
        self.store = store
        self.full_group_ids = tuple(full_group_ids)
        self._device_lookup: Callable[[bytes, int], Optional[int]] = lambda block_hash, group_id: None
        self._events = events
        self._clock = clock
        self._slots: OrderedDict[CacheKey, int] = OrderedDict()  # least recently used first
        self._slot_keys: list[Optional[CacheKey]] = [None] * store.num_slots
        self._parents: dict[CacheKey, Optional[bytes]] = {}
        self._groups_of: dict[bytes, set[int]] = {}  # hash -> groups stored under it (the sliding cascade)
        self._free_slots = list(range(store.num_slots - 1, -1, -1))
        self._pins: Counter[CacheKey] = Counter()
        self._results = LoadResults()
        self._executor = executor
        self._mirror = mirror
        # Writes go to the I/O thread when the store can stage them; the host store's stay a memcpy.
        self._writes = (WriteQueue(store, executor, clock)
                        if executor is not None and isinstance(store, StagingPageStore) else None)
        # load id -> (its read, its keys, pages, start time): reads in flight on the executor
        self._in_flight: dict[str, tuple[Future, list[CacheKey], int, float]] = {}
        self._wake: Callable[[], None] = wake or (lambda: None)
        self.stats = OffloadStats()

    def wake_on_results(self, wake: Callable[[], None]) -> None:
        """Replace the constructor's `wake` (bench/_offload_wake.py compares wake-ups on one live tier)."""
        self._wake = wake

    def attach(self, device_lookup: Callable[[bytes, int], Optional[int]]) -> None:
        """Bind the pool this tier stands behind (its KV manager does, once, at construction)."""
        self._device_lookup = device_lookup

    # ---- queries ---------------------------------------------------------------------

    def lookup(self, block_hash: bytes, group_id: int) -> Optional[int]:
        """The slot holding (block_hash, group_id), or None (a `BlockLookup`). Learns of finished
        writes first, so a page whose write failed is a miss rather than a failed load."""
        self._apply_finished_writes()
        return self._slots.get((block_hash, group_id))

    @property
    def num_pages(self) -> int:
        return len(self._slots)

    def cached_blocks(self) -> list[CachedBlock]:
        """Every page the tier holds, least recently used first, marked with its medium
        (for snapshots of the event stream: the tier's stored events carry the same)."""
        parents = self._parents
        return [CachedBlock(block_hash, parents.get((block_hash, group_id)), group_id, self.store.medium)
                for block_hash, group_id in self._slots]

    @property
    def usage_ratio(self) -> float:
        return len(self._slots) / self.store.num_slots

    # ---- stores (write-back) -------------------------------------------------------

    def offer(self, block_id: int, key: CacheKey, parent_hash: Optional[bytes]) -> None:
        """The pool is about to evict `block_id`, cached under `key`: keep its page if it may
        serve a later hit. Never raises (it runs inside the pool's allocation), never waits for I/O."""
        self._apply_finished_writes()
        if key in self._slots:
            self._slots.move_to_end(key)  # loaded back earlier: the bytes are already here
            return
        if not self._worth_storing(key):
            return
        if self._writes is not None and not self._writes.has_room():
            self.stats.num_skipped_stores += 1  # the disk lags the evictions: drop this page, never wait
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.num_skipped_stores += 1  # every slot is pinned by a load in flight
            return
        try:
            self._store_page(slot, block_id)
        except Exception:  # noqa: BLE001 - a medium fault is a miss, never an allocation failure
            logger.exception("offload store of block %d failed", block_id)
            self._free_slots.append(slot)
            self.stats.num_failed_stores += 1
            return
        if self._mirror is not None:
            self._mirror.stored(slot, block_id)
        self._slots[key] = slot
        self._slot_keys[slot] = key
        self._parents[key] = parent_hash
        self._groups_of.setdefault(key[0], set()).add(key[1])
        if self._events is not None:
            self._events.stored(key[0], parent_hash, key[1], self.store.medium)

    def _store_page(self, slot: int, block_id: int) -> None:
        """Copy the page into the slot now (host memory), or stage it for the I/O thread (file)."""
        if self._writes is not None:
            self._writes.submit(slot, block_id)  # counted once the I/O thread reports it
            return
        started = self._clock()
        self.store.write(slot, block_id)
        self._count_store(self._clock() - started)

    def _count_store(self, duration_s: float) -> None:
        self.stats.num_stores += 1
        self.stats.num_store_bytes += self.store.page_bytes
        self.stats.store_seconds.append(duration_s)

    def _apply_finished_writes(self) -> None:
        """Count the writes the I/O thread finished; a failed one was a store that did not happen:
        its key goes, unless a load pinned it (that load's read then fails the checksum and
        drops it) or the slot was reused since (a later write owns it)."""
        if self._writes is None:
            return
        for write in self._writes.finished():
            if write.error is None:
                self._count_store(write.duration_s)
                continue
            logger.warning("offload store into slot %d failed: %s", write.slot, write.error)
            self.stats.num_failed_stores += 1
            key = self._slot_keys[write.slot]
            if write.is_latest and key is not None and not self._pins[key]:
                self._drop(key)

    def _worth_storing(self, key: CacheKey) -> bool:
        block_hash, group_id = key
        if not self.full_group_ids or group_id in self.full_group_ids:
            return True
        full = (block_hash, self.full_group_ids[0])
        return full in self._slots or self._device_lookup(*full) is not None

    def _take_slot(self) -> Optional[int]:
        if self._free_slots:
            return self._free_slots.pop()
        for key in self._slots:  # least recently used first
            if not self._pins[key]:
                slot = self._slots[key]
                self._drop(key)
                self._free_slots.remove(slot)
                return slot
        return None

    def _drop(self, key: CacheKey) -> None:
        """Forget `key` (and, for a full-attention key, the sliding entries of its hash)."""
        slot = self._slots.pop(key)
        self._slot_keys[slot] = None
        self._parents.pop(key, None)
        self._free_slots.append(slot)
        groups = self._groups_of[key[0]]
        groups.discard(key[1])
        if self._events is not None:
            self._events.removed(key[0], key[1], self.store.medium)
        if self.full_group_ids and key[1] == self.full_group_ids[0]:
            for group_id in [g for g in groups if g not in self.full_group_ids]:
                if not self._pins[(key[0], group_id)]:
                    self._drop((key[0], group_id))
        if not groups:
            self._groups_of.pop(key[0], None)

    # ---- loads -----------------------------------------------------------------------

    def pin(self, keys: Sequence[CacheKey]) -> None:
        """Keep these keys' slots until `unpin` (a hit about to be loaded)."""
        for key in keys:
            self._pins[key] += 1

    def unpin(self, keys: Sequence[CacheKey]) -> None:
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    def start_load(self, load_id: str, loads: Sequence[PageLoad]) -> None:
        """Copy each load's page into its block; the outcome comes from a later `poll` (the
        blocks must stay allocated until then). The caller pinned the keys; the load unpins them."""
        keys = [(load.block_hash, load.group_id) for load in loads]
        self._apply_finished_writes()
        started = self._clock()
        try:
            slots = [self._slot_of(key) for key in keys]
            block_ids = [load.block_id for load in loads]
            if self._executor is not None:
                read = self._executor.submit(self._timed_read, slots, block_ids)
                self._in_flight[load_id] = (read, keys, len(loads), started)
                read.add_done_callback(lambda _read: self._wake())  # on the I/O thread, as the read ends
            else:
                self.store.read(slots, block_ids)
        except Exception as error:  # noqa: BLE001 - a failed load recomputes, never fails the request
            self._end_load(load_id, keys, len(loads), started, error)
            self._wake()
            return
        if self._mirror is not None:  # only a read that started here is repeated by the others
            self._mirror.loading(load_id, slots, block_ids)
        if self._executor is None:
            self._end_load(load_id, keys, len(loads), started, None)
            self._wake()

    def _timed_read(self, slots: list[int], block_ids: list[int]) -> float:
        """On the I/O thread: the read and its own duration (what the load histogram reports,
        not the wait for the engine's next poll)."""
        started = self._clock()
        self.store.read(slots, block_ids)
        return self._clock() - started

    def is_loading(self, load_id: str) -> bool:
        """Whether a read of this load still runs (its blocks must not be reused yet)."""
        return load_id in self._in_flight

    def _end_load(self, load_id: str, keys: list[CacheKey], num_pages: int, started: float,
                  error: Optional[BaseException], duration_s: Optional[float] = None) -> None:
        self.unpin(keys)
        if error is not None:
            logger.warning("load %s: offload load of %d pages failed (%s); it recomputes", load_id, num_pages, error)
            for key in keys:  # possibly torn or corrupt: never offered again
                if key in self._slots and not self._pins[key]:
                    self._drop(key)
            self.stats.num_failed_loads += 1
            self._results.failed.append(load_id)
            return
        for key in keys:
            if key in self._slots:
                self._slots.move_to_end(key)
        self.stats.num_loads += 1
        self.stats.num_load_bytes += num_pages * self.store.page_bytes
        self.stats.load_seconds.append(duration_s if duration_s is not None else self._clock() - started)
        self._results.landed.append(load_id)

    def _slot_of(self, key: CacheKey) -> int:
        slot = self._slots.get(key)
        if slot is None or self._slot_keys[slot] != key:
            raise OffloadIOError(f"tier slot for group {key[1]} block {key[0].hex()[:8]} no longer holds it")
        return slot

    def poll(self) -> LoadResults:
        """Loads that landed or failed since the last poll (never waits for a read in flight)."""
        self._apply_finished_writes()
        for load_id, (read, keys, num_pages, started) in list(self._in_flight.items()):
            if not read.done():
                continue
            error = read.exception()
            if self._mirror is not None:  # the other ranks read into the same blocks: wait for them too
                others = self._mirror.others_read(load_id)
                if others is None:
                    continue
                if others.error is not None and error is None:
                    error = OffloadIOError(others.error)
            del self._in_flight[load_id]
            self._end_load(load_id, keys, num_pages, started, error, None if error else read.result())
        results, self._results = self._results, LoadResults()
        return results

    def clear(self) -> int:
        """Forget every page (the prefix cache was reset); returns how many. Pinned ones stay."""
        keys = [key for key in self._slots if not self._pins[key]]
        for key in keys:
            if key in self._slots:
                self._drop(key)
        return len(keys)

    def close(self) -> None:
        """After the engine thread stopped: let the I/O thread finish what it was given, then release
        the medium (a file store's descriptor and its directory lock, so a new tier can take it)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.store.close()

    def check_invariants(self) -> None:
        used = set(self._slots.values())
        if len(used) != len(self._slots) or used & set(self._free_slots):
            raise RuntimeError("an offload slot is in two places")
        if len(used) + len(self._free_slots) != self.store.num_slots:
            raise RuntimeError("offload slots were lost")
        for key, slot in self._slots.items():
            if self._slot_keys[slot] != key:
                raise RuntimeError(f"slot {slot} records another key")
        by_hash: dict[bytes, set[int]] = {}
        for block_hash, group_id in self._slots:
            by_hash.setdefault(block_hash, set()).add(group_id)
        if by_hash != self._groups_of:
            raise RuntimeError("the per-hash group index disagrees with the slots")
