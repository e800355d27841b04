"""Which worker holds which prompt blocks, built from the workers' KV event streams.

Invariant: a worker's entries come from exactly one (epoch, sequence) history:
a snapshot replaces all of them, each event must carry the next sequence
number of the same epoch (else `SequenceGap`, and the caller resyncs), and a
worker whose stream broke or who left the pool holds nothing. Matching a
prompt against a worker uses the workers' own prefix rule (`pdserve.kv.prefix`),
so a prediction is the hit the worker will find if nothing changes meanwhile.
Each worker's entries are keyed by its own block size (the one its snapshot
names): its hashes chain blocks of that many tokens, so a prompt is matched
against it with the prompt's chain for that size, and prefill and decode
workers may use different sizes.
Bounded: a worker's entries stop growing at `max_keys_per_worker` (blocks it
stores past that are not indexed and counted): a worker cannot grow the
proxy's memory without limit, and an index that misses blocks only predicts
fewer hits than there are.
Tiers: each key records where the worker holds it, on the device, in its
offload tier, or both (a page loaded back from the tier stays there too).
Events without a medium move the device mark, events with one ("cpu",
"disk") the tier mark, each independently, as the worker publishes them: an
evicted page is a device `removed` and a tier `stored`; `cleared` empties the
device pool (the tier reports its own removals); a key marked nowhere is
dropped. A key counts once toward the bound whatever holds it.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

from pdserve.kv.events import CachedBlock, KVEvent, KVEventKind
from pdserve.kv.prefix import match_prefix, max_hit_blocks
from pdserve.kv.specs import KVGroupPlan

BlockKey = tuple[bytes, int]  # (chained block hash, KV group)
# A million keys is ~200 MB of index and more blocks than a 140 GB pool of the embedded model holds.
MAX_KEYS_PER_WORKER = 1 << 20


class Residence(enum.IntFlag):
    """Where a worker holds a block: a key may be in both at once. The index stores the plain
    int of these bits (an IntFlag operation costs ten times an int's on the matching path)."""

    DEVICE = 1  # the device pool (events and snapshot entries without a medium)
    OFFLOAD = 2  # the offload tier (with a medium: "cpu" host memory, "disk" files)


_DEVICE, _OFFLOAD = int(Residence.DEVICE), int(Residence.OFFLOAD)


def residence_bits(medium: Optional[str]) -> int:
    return _DEVICE if medium is None else _OFFLOAD


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A worker's predicted prefix hit: `num_tokens` it will report cached, of which
    `num_offload_tokens` (from the first block it loads from its tier on, as the worker's
    own offload hit count) it must load from its offload tier first."""

    num_tokens: int = 0
    num_offload_tokens: int = 0

    @property
    def num_device_tokens(self) -> int:
        return self.num_tokens - self.num_offload_tokens


class SequenceGap(Exception):
    """Events that do not continue the worker's history: resync from a snapshot."""


class HashedPrompt(Protocol):
    """A prompt as the index matches it (`proxy.routing.kv_prompt.PromptBlocks`)."""

    @property
    def num_tokens(self) -> int: ...

    def block_hashes(self, block_size: int) -> Sequence[bytes]:
        """The prompt's chained hashes of its full blocks of `block_size` tokens."""
        ...


@dataclass(slots=True)
class WorkerBlocks:
    """What the index knows of one worker. `keys` are hashes of blocks of `block_size` tokens (>= 1),
    each with the `Residence` bits of where the worker holds it (never 0: a key held nowhere is dropped)."""

    url: str
    role: str
    epoch: str
    last_seq: int
    block_size: int
    keys: dict[BlockKey, int] = field(default_factory=dict)
    num_offload_keys: int = 0  # keys with the OFFLOAD bit: 0 skips the tier lookups when matching


class _HeldIn:
    """One worker's keys held in `residence`, shaped like the block pool `match_prefix` reads."""

    __slots__ = ("keys", "bits")

    def __init__(self, keys: dict[BlockKey, int], residence: Residence):
        self.keys = keys
        self.bits = int(residence)

    def lookup(self, block_hash: bytes, group_id: int) -> Optional[int]:
        held = self.keys.get((block_hash, group_id))
        return 1 if held is not None and held & self.bits else None


class KVIndex:
    def __init__(self, max_keys_per_worker: int = MAX_KEYS_PER_WORKER) -> None:
        self._holders: dict[BlockKey, set[str]] = {}
        self._workers: dict[str, WorkerBlocks] = {}
        self._max_keys_per_worker = max_keys_per_worker
        self.num_keys_not_indexed = 0  # stored blocks past a worker's bound, since start

    # ---- updates ---------------------------------------------------------------------

    def apply_snapshot(self, url: str, role: str, epoch: str, seq: int, block_size: int,
                       blocks: Iterable[CachedBlock]) -> None:
        """Replace everything known of the worker, whose blocks hold `block_size` tokens each."""
        if block_size < 1:
            raise ValueError(f"{url}: a snapshot of blocks of {block_size} tokens")
        self.drop_worker(url)
        worker = self._workers[url] = WorkerBlocks(url, role, epoch, seq, block_size)
        for block in blocks:
            self._add(worker, (block.block_hash, block.group_id), residence_bits(block.medium))

    def apply_events(self, url: str, epoch: str, events: Sequence[KVEvent]) -> None:
        worker = self._workers.get(url)
        if worker is None or worker.epoch != epoch:
            raise SequenceGap(f"events of epoch {epoch} for {url} without its snapshot")
        for event in events:
            if event.seq != worker.last_seq + 1:
                raise SequenceGap(f"{url}: event {event.seq} after {worker.last_seq}")
            worker.last_seq = event.seq
            if event.kind is KVEventKind.STORED and event.block_hash is not None:
                self._add(worker, (event.block_hash, event.group_id), residence_bits(event.medium))
            elif event.kind is KVEventKind.REMOVED and event.block_hash is not None:
                self._remove(worker, (event.block_hash, event.group_id), residence_bits(event.medium))
            elif event.kind is KVEventKind.CLEARED:
                for key in list(worker.keys):
                    self._remove(worker, key, _DEVICE)

    def check_heartbeat(self, url: str, epoch: str, seq: int) -> None:
        """A heartbeat names the last event sent: a higher one means some never arrived."""
        worker = self._workers.get(url)
        if worker is None or worker.epoch != epoch or seq != worker.last_seq:
            raise SequenceGap(f"{url}: heartbeat at {seq} does not match the index")

    def drop_worker(self, url: str) -> None:
        worker = self._workers.pop(url, None)
        if worker is None:
            return
        for key in worker.keys:
            urls = self._holders.get(key)
            if urls is not None:
                urls.discard(url)
                if not urls:
                    del self._holders[key]

    def _add(self, worker: WorkerBlocks, key: BlockKey, bits: int) -> None:
        held = worker.keys.get(key)
        if held is None:
            if len(worker.keys) >= self._max_keys_per_worker:
                self.num_keys_not_indexed += 1
                return
            self._holders.setdefault(key, set()).add(worker.url)
            held = 0
        worker.keys[key] = held | bits
        worker.num_offload_keys += bool(bits & _OFFLOAD and not held & _OFFLOAD)

    def _remove(self, worker: WorkerBlocks, key: BlockKey, bits: int) -> None:
        held = worker.keys.get(key)
        if held is None:
            return
        worker.num_offload_keys -= bool(bits & _OFFLOAD and held & _OFFLOAD)
        if held & ~bits:
            worker.keys[key] = held & ~bits
            return
        del worker.keys[key]
        urls = self._holders.get(key)
        if urls is not None:
            urls.discard(worker.url)
            if not urls:
                del self._holders[key]

    # ---- queries ---------------------------------------------------------------------

    def cached_prefix(self, url: str, prompt: HashedPrompt, plan: KVGroupPlan) -> CachedPrefix:
        """The prefix the worker's cache would serve, device first then its tier, by the worker's
        own matching rule over its own block size (nothing for a worker the index does not follow)."""
        worker = self._workers.get(url)
        if worker is None:
            return CachedPrefix()
        block_size = worker.block_size
        block_hashes = prompt.block_hashes(block_size)
        if not block_hashes:
            return CachedPrefix()
        max_blocks = max_hit_blocks(prompt.num_tokens, block_size)
        tier = _HeldIn(worker.keys, Residence.OFFLOAD) if worker.num_offload_keys else None
        hit = match_prefix(_HeldIn(worker.keys, Residence.DEVICE), plan, block_hashes, max_blocks, block_size, tier)
        return CachedPrefix(hit.num_tokens, hit.num_tokens - hit.num_device_tokens(block_size))

    def cached_tokens(self, url: str, prompt: HashedPrompt, plan: KVGroupPlan) -> int:
        """Prompt tokens the worker will report cached (device and tier alike)."""
        return self.cached_prefix(url, prompt, plan).num_tokens

    def worker(self, url: str) -> Optional[WorkerBlocks]:
        return self._workers.get(url)

    def holders(self, block_hash: bytes, group_id: int = 0) -> frozenset[str]:
        """Workers holding the key anywhere (device or tier)."""
        return frozenset(self._holders.get((block_hash, group_id), ()))

    def residence(self, url: str, block_hash: bytes, group_id: int = 0) -> Optional[Residence]:
        """Where the worker holds the key (None: nowhere the index knows of)."""
        worker = self._workers.get(url)
        held = None if worker is None else worker.keys.get((block_hash, group_id))
        return None if held is None else Residence(held)

    @property
    def num_keys(self) -> int:
        """Distinct (block hash, group) keys held anywhere."""
        return len(self._holders)

    def num_blocks_by_role(self) -> Counter[str]:
        """Blocks held per role, counting a block once per worker holding it."""
        counts: Counter[str] = Counter()
        for worker in self._workers.values():
            counts[worker.role] += len(worker.keys)
        return counts
