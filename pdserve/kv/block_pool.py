"""The shared pool of KV block ids: reference counts, free list, prefix cache, LRU.

Invariant: every block but the null block 0 is in exactly one state: in use
(ref > 0, owned by one group), free and cached (ref 0, in the LRU, still
findable by its (hash, group) key) or free and uncached (ref 0, no owner).
A cached block about to be evicted is first shown to the optional `on_evict`
hook (an offload tier's write-back), while its page still holds the content.
Every key that enters or leaves the cache map is reported to the optional
`KVEventRecorder`, in order. Torch-free: this module only hands out integers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Callable, Iterable, Optional, Sequence

from pdserve.kv.events import CachedBlock, KVEventRecorder

NULL_BLOCK_ID = 0
_NO_OWNER = -1

CacheKey = tuple[bytes, int]  # (chained block hash, group id)
# (block id, its key, its parent hash): called before the key is dropped; must not change the pool.
EvictHook = Callable[[int, CacheKey, Optional[bytes]], None]


class NoFreeBlocks(Exception):
    """The pool cannot supply the requested number of blocks; nothing changed."""


class KVInvariantError(RuntimeError):
    """The allocator's bookkeeping is inconsistent: a bug, never bad input."""


class BlockPool:
    """Block ids 1..num_blocks-1 shared by all KV groups; block 0 is the permanent
    null placeholder (never allocated, freed, cached or counted)."""

    def __init__(self, num_blocks: int, events: Optional[KVEventRecorder] = None,
                 on_evict: Optional[EvictHook] = None):
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block plus at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._owners = [_NO_OWNER] * num_blocks
        self._keys: list[Optional[CacheKey]] = [None] * num_blocks
        self._parents: list[Optional[bytes]] = [None] * num_blocks  # parent hash of a cached block
        self._events = events
        self._on_evict = on_evict
        self._free_ids: deque[int] = deque(range(1, num_blocks))
        # Free blocks that still hold a cached prefix, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached_ids: dict[CacheKey, int] = {}
        self._num_in_use = 0
        self._num_in_use_by_group: Counter[int] = Counter()

    # ---- counters -------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: uncached free plus evictable cached ones."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    @property
    def num_uncached_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache, in use or not."""
        return len(self._cached_ids)

    def num_in_use_by_group(self, group_id: int) -> int:
        return self._num_in_use_by_group[group_id]

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is findable in the prefix cache (in use or not)."""
        self._check_id(block_id)
        return self._keys[block_id] is not None

    def owner(self, block_id: int) -> Optional[int]:
        """Group that owns an in-use or cached block; None for a free uncached one."""
        self._check_id(block_id)
        owner = self._owners[block_id]
        return None if owner == _NO_OWNER else owner

    # ---- mutations --------------------------------------------------------------

    def allocate(self, num_blocks: int, group_id: int) -> list[int]:
        """Take `num_blocks` blocks for `group_id`, each with one reference.

        Uncached free blocks go first; then the least recently freed cached
        blocks are evicted (their prefix-cache entry is dropped).
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                key = self._keys[block_id]
                if self._on_evict is not None and key is not None:
                    self._on_evict(block_id, key, self._parents[block_id])
                self._drop_key(block_id)
            self._ref_counts[block_id] = 1
            self._owners[block_id] = group_id
            block_ids.append(block_id)
        self._num_in_use += num_blocks
        self._num_in_use_by_group[group_id] += num_blocks
        return block_ids

    def touch(self, block_ids: Iterable[int], group_id: int) -> None:
        """Take one more reference on each block (a prefix-cache hit, or a pin on
        behalf of a remote reader). A free block must be cached under `group_id`;
        it leaves the LRU. Validates everything before changing anything."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._owners[block_id] != group_id:
                raise ValueError(f"block {block_id} is not held or cached by group {group_id}")
            if self._ref_counts[block_id] == 0 and block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free and uncached: its content is gone")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
                self._num_in_use += 1
                self._num_in_use_by_group[group_id] += 1
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per occurrence. A block reaching 0 goes to the LRU
        tail if cached (so pass blocks in the order they should be evicted) or to
        the free list if not. Validates everything before changing anything."""
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref_counts[block_id] < count:
                raise ValueError(f"block {block_id} freed {count} times with {self._ref_counts[block_id]} refs")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            self._num_in_use -= 1
            self._num_in_use_by_group[self._owners[block_id]] -= 1
            if self._keys[block_id] is not None:
                self._evictable[block_id] = None
            else:
                self._owners[block_id] = _NO_OWNER
                self._free_ids.append(block_id)

    def cache(self, block_id: int, block_hash: bytes, group_id: int, parent_hash: Optional[bytes] = None) -> bool:
        """Register a full in-use block under (block_hash, group_id); `parent_hash` is the hash
        of the block before it in its sequence (None for the first), reported with the event.

        Returns False, leaving the block uncached, when another block already
        holds that key (two requests computed the same content at once).
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0 or self._owners[block_id] != group_id:
            raise ValueError(f"block {block_id} is not in use by group {group_id}")
        key = (block_hash, group_id)
        current = self._keys[block_id]
        if current is not None:
            if current != key:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if key in self._cached_ids:
            return False
        self._cached_ids[key] = block_id
        self._keys[block_id] = key
        self._parents[block_id] = parent_hash
        if self._events is not None:
            self._events.stored(block_hash, parent_hash, group_id)
        return True

    def lookup(self, block_hash: bytes, group_id: int) -> Optional[int]:
        return self._cached_ids.get((block_hash, group_id))

    def clear_cache(self) -> int:
        """Drop every prefix-cache key; returns how many. Free cached blocks become free
        uncached, blocks in use stay with their holders (and go to the free list when freed)."""
        num_keys = len(self._cached_ids)
        for block_id in self._cached_ids.values():
            self._keys[block_id] = None
            self._parents[block_id] = None
        self._cached_ids.clear()
        for block_id in self._evictable:
            self._owners[block_id] = _NO_OWNER
            self._free_ids.append(block_id)
        self._evictable.clear()
        if self._events is not None:
            self._events.cleared()
        return num_keys

    def cached_blocks(self) -> list[CachedBlock]:
        """Every key of the cache map, oldest first; O(cached blocks), for snapshots of the event stream."""
        parents = self._parents
        return [CachedBlock(block_hash, parents[block_id], group_id)
                for (block_hash, group_id), block_id in self._cached_ids.items()]

    # ---- internals ------------------------------------------------------------------

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is the null block or outside 1..{self.num_blocks - 1}")

    def _drop_key(self, block_id: int) -> None:
        key = self._keys[block_id]
        if key is not None:
            del self._cached_ids[key]
            self._keys[block_id] = None
            self._parents[block_id] = None
            if self._events is not None:
                self._events.removed(key[0], key[1])

    def check_invariants(self) -> None:
        """Raise KVInvariantError if the bookkeeping is inconsistent (O(num_blocks))."""
        free_ids = set(self._free_ids)
        cached_free_ids = set(self._evictable)
        in_use_ids = {b for b in range(1, self.num_blocks) if self._ref_counts[b] > 0}
        problems: list[str] = []
        if len(free_ids) != len(self._free_ids):
            problems.append("a block appears twice in the free list")
        if len(free_ids) + len(cached_free_ids) + len(in_use_ids) != self.num_usable_blocks:
            problems.append(
                f"free {len(free_ids)} + cached free {len(cached_free_ids)} + in use {len(in_use_ids)}"
                f" != {self.num_usable_blocks} usable blocks"
            )
        if (free_ids & cached_free_ids) or ((free_ids | cached_free_ids) & in_use_ids):
            problems.append("a block is in two states at once")
        if len(in_use_ids) != self._num_in_use:
            problems.append(f"num_in_use {self._num_in_use} != {len(in_use_ids)} blocks with refs")
        problems += self._null_block_problems()
        problems += self._ownership_problems(free_ids, cached_free_ids, in_use_ids)
        problems += self._cache_map_problems()
        if problems:
            raise KVInvariantError("; ".join(problems))

    def _null_block_problems(self) -> list[str]:
        null = NULL_BLOCK_ID
        touched = (
            self._ref_counts[null] != 0
            or self._owners[null] != _NO_OWNER
            or self._keys[null] is not None
            or null in self._evictable
            or null in self._free_ids
        )
        return ["the null block was allocated, freed or cached"] if touched else []

    def _ownership_problems(self, free_ids: set[int], cached_free_ids: set[int], in_use_ids: set[int]) -> list[str]:
        problems = [f"block {b} has negative refs" for b in range(self.num_blocks) if self._ref_counts[b] < 0]
        problems += [f"free uncached block {b} has an owner or a key" for b in free_ids
                     if self._owners[b] != _NO_OWNER or self._keys[b] is not None]
        problems += [f"in-use block {b} has no owner" for b in in_use_ids if self._owners[b] == _NO_OWNER]
        problems += [f"cached free block {b} has no key" for b in cached_free_ids if self._keys[b] is None]
        by_group = Counter(self._owners[b] for b in in_use_ids)
        counters = {g: n for g, n in self._num_in_use_by_group.items() if n != 0}
        if dict(by_group) != counters:
            problems.append(f"in-use blocks per group {dict(by_group)} != counters {dict(self._num_in_use_by_group)}")
        return problems

    def _cache_map_problems(self) -> list[str]:
        problems = [f"cache entry {key[1]}/{key[0].hex()[:8]} -> {b} disagrees with the block"
                    for key, b in self._cached_ids.items() if self._keys[b] != key]
        for b, key in enumerate(self._keys):
            if key is None:
                if self._parents[b] is not None:
                    problems.append(f"uncached block {b} still records a parent hash")
                continue
            if self._cached_ids.get(key) != b:
                problems.append(f"block {b} has a key missing from the cache map")
            if self._owners[b] != key[1]:
                # One owner slot per block, and the key's group must be it: a block
                # can never be held by one group while cached for another.
                problems.append(f"block {b} is owned by group {self._owners[b]} but cached for group {key[1]}")
        return problems
