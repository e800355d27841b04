"""Per-request block tables over the shared pool: the only KV API the scheduler uses.

Invariant: every non-null table entry is a block in use by that table's group,
a sliding-window table holds null (0) for every block wholly outside the
window of the request's next token, and a state group's table is the request's
one live state page (kv/state_pages.py: its snapshots, page copies and the
handoff pages a prefill-role request keeps for a decode worker).
Torch-free. With an offload tier, prefix blocks found only in the tier get
fresh pool blocks at admission and are cached again once their load lands
(`poll_offload`).

One request of 70 tokens, block_size 16, window 32, after computing 64 tokens
(the token at 64 reads keys 33..64, so blocks 0 and 1 are released):

    block index      0    1    2    3    4
    full group    [  7 ,  3 ,  9 , 12 , 15 ]   every block, from 0
    sliding group [  0 ,  0 ,  4 , 11 , 20 ]   null before the window
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from pdserve.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVInvariantError
from pdserve.kv.events import KVEventRecorder, KVSnapshot
from pdserve.kv.offload import LoadResults, OffloadTier, PageLoad
from pdserve.kv.prefix import PrefixCacheStats, PrefixHit, first_live_block, match_prefix, max_hit_blocks
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan
from pdserve.kv.state_pages import RequestSnapshots, StatePages

logger = logging.getLogger(__name__)


class StalePrefixHit(ValueError):
    """A PrefixHit's blocks were evicted or re-keyed since find_prefix: use a hit
    in the same scheduling step that found it, before other allocations."""


@dataclass(slots=True)
class _RequestBlocks:
    tables: list[list[int]]  # one per group; index = block index in the sequence
    num_committed: list[int]  # per group: blocks already offered to the prefix cache
    num_released: list[int]  # per group: blocks before this index are null
    num_computed_tokens: int
    snapshots: RequestSnapshots = field(default_factory=RequestSnapshots)  # state groups' snapshots


class KVCacheManager:
    """Hybrid group allocator: one block table per (request, group), one pool."""

    def __init__(self, plan: KVGroupPlan, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: Optional[KVEventRecorder] = None, offload: Optional[OffloadTier] = None,
                 snapshot_interval_blocks: Optional[int] = None):
        """`snapshot_interval_blocks`: state snapshots every that many blocks besides prompt boundaries
        (0: prompt boundaries only; None: kv/state_pages.default_snapshot_interval_blocks)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if [g.group_id for g in plan.groups] != list(range(len(plan.groups))):
            raise ValueError("group ids of the plan must be 0..num_groups-1 in order")
        self.plan = plan
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.offload = offload if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, events, self.offload.offer if self.offload is not None else None)
        if self.offload is not None:
            self.offload.attach(self.pool.lookup)
        self.state = StatePages(plan, self.pool, block_size, snapshot_interval_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self._loads: dict[str, list[PageLoad]] = {}  # admitted, pages still to load from the tier
        self._loading: dict[str, tuple[str, list[PageLoad]]] = {}  # load id -> (request id, pages), not yet polled
        self._load_ids: dict[str, str] = {}  # request id -> its load id in flight
        self._parked: dict[str, _RequestBlocks] = {}  # load id -> blocks of a request freed while it loaded
        self._num_loads_started = 0
        self._stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.plan.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """A snapshot of the monotonic prefix-cache counters."""
        return replace(self._stats)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- prefix cache --------------------------------------------------------------

    def find_prefix(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> PrefixHit:
        """Longest cached prefix every group can serve, from the pool or the offload tier;
        takes no references.

        Never the whole prompt: the last prompt token is always computed, for its logits.
        """
        if not self.enable_prefix_caching:
            return PrefixHit.empty(self.num_groups)
        hit = match_prefix(self.pool, self.plan, block_hashes, max_hit_blocks(num_prompt_tokens, self.block_size),
                           self.block_size, self.offload)
        self._stats.num_queries += 1
        self._stats.num_query_tokens += max(0, num_prompt_tokens)
        self._stats.num_hit_tokens += hit.num_tokens
        self._stats.num_offload_hit_tokens += hit.num_tokens - hit.num_device_tokens(self.block_size)
        return hit

    def commit(self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int, *,
               prompt_boundary: bool = False) -> None:
        """Offer every newly full, computed block to the prefix cache (attention groups, null
        entries skipped); with state groups, snapshot the state when `num_computed_tokens` is a
        block boundary due by the interval, or the prompt's last full block (`prompt_boundary`),
        skipped when the pool has no free page. Unknown request ids are ignored."""
        state = self._requests.get(request_id)
        if state is None or not self.enable_prefix_caching:
            return
        if self.state.group_ids:
            self.state.snapshot(state.tables, state.snapshots, block_hashes, num_computed_tokens, prompt_boundary)
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes))
        for group_id, table in enumerate(state.tables):
            if self.plan.is_state_group(group_id):
                continue  # a live page is never cached: its snapshots are
            end = min(num_full, len(table))
            for index in range(state.num_committed[group_id], end):
                if table[index] != NULL_BLOCK_ID:
                    parent = block_hashes[index - 1] if index > 0 else None
                    self.pool.cache(table[index], block_hashes[index], group_id, parent)
            state.num_committed[group_id] = max(state.num_committed[group_id], end)

    def withhold_from_cache(self, request_id: str, num_blocks: Sequence[int]) -> None:
        """Never offer table entries [0, num_blocks[g]) of group g to the prefix cache: their pages
        hold tokens nothing computed or pulled (unknown request ids are ignored)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for group_id, count in enumerate(num_blocks):
            state.num_committed[group_id] = max(state.num_committed[group_id], count)
            if count and self.plan.is_state_group(group_id):
                state.snapshots.enabled = False  # its live state is not this prompt's: never cache it

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay with their requests), in the tier too;
        returns the keys dropped from the pool."""
        if self.offload is not None:
            self.offload.clear()
        return self.pool.clear_cache()

    def snapshot_cache(self) -> KVSnapshot:
        """Every cached block as of the last recorded event (engine thread: both read the same state):
        the pool's, then the tier's with their medium (a block in both is listed once for each)."""
        last_seq = self.events.last_seq if self.events is not None else 0
        tier_blocks = self.offload.cached_blocks() if self.offload is not None else []
        return KVSnapshot(last_seq, tuple(self.pool.cached_blocks()) + tuple(tier_blocks))

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                 prefix: Optional[PrefixHit] = None) -> bool:
        """Make the tables cover `num_computed_tokens + num_new_tokens` slots.

        Sliding groups first release blocks that left the window (always valid,
        kept even on failure). A prefix is applied on a request's first call;
        normally `num_computed_tokens == prefix.num_tokens`, but a caller that
        fills slots [prefix.num_tokens, num_computed_tokens) itself (KV pulled
        from a remote worker) may pass more, and sliding groups then get blocks
        for the window of that position only. Returns False, changing nothing
        else, when the pool cannot supply every new block of every group.

        A new request gets one live page per state group; with a prefix hit and
        `num_computed_tokens == prefix.num_tokens` the hit's snapshots are copied into
        them (`take_state_copies`); a caller passing more fills the state itself.
        """
        self._check_token_counts(num_computed_tokens, num_new_tokens)
        if prefix is not None and prefix.num_tokens == 0:
            prefix = None
        state = self._requests.get(request_id)
        restore = prefix is not None and num_computed_tokens == prefix.num_tokens
        if state is not None:
            self._advance(request_id, state, num_computed_tokens, prefix)
            tables, num_reserved = state.tables, 0
        else:
            if prefix is not None:
                self._check_prefix(prefix, num_computed_tokens)
            tables = self._initial_tables(prefix, num_computed_tokens)
            num_reserved = self._num_evictable(tables) + (self.state.num_reserved(prefix) if restore else 0)
        growth = self._growth(tables, num_computed_tokens, num_new_tokens)
        offloaded = self._offloaded(prefix, num_computed_tokens) if state is None else []
        num_live = len(self.state.group_ids) if state is None else 0
        num_needed = sum(num_new for _, num_new in growth) + len(offloaded) + num_live
        if num_needed > self.pool.num_free_blocks - num_reserved:
            logger.debug("request %s: needs %d blocks, %d free", request_id, num_needed,
                         self.pool.num_free_blocks - num_reserved)
            return False
        if state is None:
            state = self._admit(request_id, tables)
            if num_live:
                self.state.admit(state.tables, state.snapshots, prefix, restore)
            if offloaded:
                self._allocate_offloaded(request_id, state, offloaded, prefix)
        for group_id, (num_null, num_new) in enumerate(growth):
            state.tables[group_id].extend([NULL_BLOCK_ID] * num_null)
            state.tables[group_id].extend(self.pool.allocate(num_new, group_id))
        state.num_computed_tokens = num_computed_tokens
        return True

    def num_blocks_needed(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                          prefix: Optional[PrefixHit] = None) -> int:
        """New pool blocks `allocate_slots` would take for this call (all groups, tier loads included)."""
        self._check_token_counts(num_computed_tokens, num_new_tokens)
        state = self._requests.get(request_id)
        tables = state.tables if state is not None else self._initial_tables(prefix, num_computed_tokens)
        num_loaded = len(self._offloaded(prefix, num_computed_tokens)) if state is None else 0
        num_live = len(self.state.group_ids) if state is None else 0
        return (sum(num_new for _, num_new in self._growth(tables, num_computed_tokens, num_new_tokens)) + num_loaded
                + num_live)

    def can_allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                     prefix: Optional[PrefixHit] = None) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now."""
        num_needed = self.num_blocks_needed(request_id, num_computed_tokens, num_new_tokens, prefix)
        state = self._requests.get(request_id)
        if state is None:
            tables = self._initial_tables(prefix, num_computed_tokens)
            restore = prefix is not None and num_computed_tokens == prefix.num_tokens
            num_reserved = self._num_evictable(tables) + (self.state.num_reserved(prefix) if restore else 0)
            return num_needed <= self.pool.num_free_blocks - num_reserved
        # Blocks the window release would drop to zero refs become free first.
        num_released = sum(1 for block_id in self._window_blocks(state, num_computed_tokens)
                           if self.pool.ref_count(block_id) == 1)
        return num_needed <= self.pool.num_free_blocks + num_released

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks, last blocks first, so its tail is
        evicted before its (possibly shared) head. Unknown ids are ignored."""
        loads = self._loads.pop(request_id, None)
        if loads is not None and self.offload is not None:  # admitted, its load never started
            self.offload.unpin([(load.block_hash, load.group_id) for load in loads])
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        load_id = self._load_ids.pop(request_id, None)
        if load_id is not None and self.offload is not None and self.offload.is_loading(load_id):
            self._parked[load_id] = state  # a read still writes its blocks: freed when it ends
            return
        self._release_blocks(state)

    def _release_blocks(self, state: _RequestBlocks) -> None:
        state_pages = self.state.release_order(state.tables, state.snapshots) if self.state.group_ids else {}
        attention = [table for group_id, table in enumerate(state.tables) if not self.plan.is_state_group(group_id)]
        num_slots = max([len(table) for table in attention] + [index + 1 for index in state_pages])
        tail_first = []
        for index in reversed(range(num_slots)):
            tail_first += [table[index] for table in attention if index < len(table) and table[index] != NULL_BLOCK_ID]
            tail_first += state_pages.get(index, [])
        self.pool.free(tail_first)

    # ---- offload tier loads ----------------------------------------------------------

    def start_tier_read(self, request_id: str) -> bool:
        """Start loading the tier pages the request's prefix hit took (once, after `allocate_slots`);
        False when it has none. The outcome comes from `poll_offload`."""
        loads = self._loads.pop(request_id, None)
        if not loads or self.offload is None:
            return False
        self._num_loads_started += 1
        load_id = f"{request_id}#{self._num_loads_started}"  # request ids may be reused; load ids never
        self._loading[load_id] = (request_id, loads)
        self._load_ids[request_id] = load_id
        self.offload.start_tier_read(load_id, loads)
        return True

    def has_tier_reads(self) -> bool:
        """Whether a tier read started here has not been reported by `poll_offload` yet (a request's,
        a peer pin's, or one whose owner was freed meanwhile): whoever polls must keep polling."""
        return bool(self._loading)

    def is_reading_tier(self, request_id: str) -> bool:
        """Whether the request's tier pages are not all in its blocks yet (admitted with tier pages and
        their load not reported by `poll_offload`; once reported, the landed pages are cached)."""
        return request_id in self._loads or request_id in self._load_ids

    def poll_offload(self) -> LoadResults:
        """Loads that landed (their blocks are now in the prefix cache) or failed (the caller frees
        the request and recomputes it) since the last poll."""
        if self.offload is None:
            return LoadResults()
        polled = self.offload.poll()
        results = LoadResults()
        for load_id in polled.landed + polled.failed:
            request_id, loads = self._loading.pop(load_id)
            parked = self._parked.pop(load_id, None)
            if parked is not None:  # the request ended while its pages were read
                self._release_blocks(parked)
                continue
            if self._load_ids.get(request_id) != load_id:
                continue  # the request ended (and its blocks went back) before this poll
            del self._load_ids[request_id]
            if load_id in polled.failed:
                results.failed.append(request_id)
                continue
            for load in loads:
                self.pool.cache(load.block_id, load.block_hash, load.group_id, load.parent_hash)
                if self.plan.is_state_group(load.group_id):  # a snapshot: now copy it into the live page
                    self.state.restore_loaded(self._requests[request_id].tables, load.block_id, load.group_id)
            results.landed.append(request_id)
        return results

    def _offloaded(self, prefix: Optional[PrefixHit], num_computed_tokens: int) -> list[tuple[int, int]]:
        """(group, block index) of the prefix blocks to load from the tier, in-window ones only (state
        snapshots only when the hit's state is restored)."""
        if prefix is None or not prefix.offloaded or self.offload is None:
            return []
        wanted = []
        for group, indexes in zip(self.plan.groups, prefix.offloaded):
            if group.is_state:
                wanted += [(group.group_id, index) for index in indexes if num_computed_tokens == prefix.num_tokens]
                continue
            first_live = first_live_block(group, num_computed_tokens, self.block_size)
            wanted += [(group.group_id, index) for index in indexes if index >= first_live]
        return wanted

    def _allocate_offloaded(self, request_id: str, state: _RequestBlocks, offloaded: list[tuple[int, int]],
                            prefix: PrefixHit) -> None:
        """Fresh blocks for the tier's pages, pinned in the tier until their load ends."""
        hashes = prefix.block_hashes
        loads = []
        keys = [(hashes[index], group_id) for group_id, index in offloaded]
        self.offload.pin(keys)  # type: ignore[union-attr] - _offloaded is empty without a tier
        for group_id, index in offloaded:
            block_id = self.pool.allocate(1, group_id)[0]  # may evict (and store) other pages
            if self.plan.is_state_group(group_id):  # the table is the live page: hold the snapshot beside it
                self.state.hold_loaded(state.snapshots, block_id, group_id, index, hashes[index])
            else:
                state.tables[group_id][index] = block_id
            loads.append(PageLoad(block_id, hashes[index], group_id, hashes[index - 1] if index else None))
        self._loads[request_id] = loads

    # ---- state groups -----------------------------------------------------------------

    def next_snapshot_tokens(self, num_computed_tokens: int, num_prompt_tokens: int) -> Optional[int]:
        """Where a chunk should end for its commit to take the next state snapshot (an interval boundary
        or `prompt_boundary_tokens`); None without state groups or prefix caching."""
        if not self.enable_prefix_caching:
            return None
        return self.state.next_snapshot_tokens(num_computed_tokens, num_prompt_tokens)

    def prompt_boundary_tokens(self, num_prompt_tokens: int) -> int:
        """The computed-token count at which to pass `commit(..., prompt_boundary=True)`."""
        return self.state.prompt_boundary_tokens(num_prompt_tokens)

    def keep_state_handoff(self, request_id: str) -> bool:
        """P/D, prefill side: keep a copy of the request's state as it is now (all but the last prompt
        token computed) in one handoff page per state group, held with its blocks until it is freed;
        `block_ids(..., handoff=True)` names them. False when the pool has no room (or no state groups,
        or an unknown id)."""
        state = self._requests.get(request_id)
        if state is None or not self.state.group_ids:
            return False
        return self.state.keep_handoff(state.tables, state.snapshots)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (source page, destination page) copies of state snapshots and restores recorded since the
        last call, in order: the runner performs them, in order, before the next forward pass. Call it
        at the end of every schedule() (kv/state_pages.py: why their pages stay pinned until the next call)."""
        return self.state.take_copies()

    # ---- tables and counters -----------------------------------------------------------

    def block_ids(self, request_id: str, handoff: bool = False) -> tuple[list[int], ...]:
        """A copy of the request's tables, one list per group (0 = null block). With `handoff`, a state
        group's list is its handoff page (`keep_state_handoff`; empty when it has none), not its live page."""
        state = self._requests.get(request_id)
        if state is None:
            return tuple([] for _ in self.plan.groups)
        tables = tuple(list(table) for table in state.tables)
        if handoff:
            pages = iter(state.snapshots.handoff)
            for group_id in self.state.group_ids:
                tables[group_id][:] = [next(pages)] if state.snapshots.handoff else []
        return tables

    def live_block_ids(self, request_id: str, position: int) -> tuple[list[int], ...]:
        """The tables clipped to what a query at `position` reads: sliding groups
        get null before their window. What a prefill worker hands a decode worker
        that computes the token at `position` itself."""
        tables = self.block_ids(request_id)
        for group, table in zip(self.plan.groups, tables):
            if group.is_state:
                continue
            first_live = min(first_live_block(group, position, self.block_size), len(table))
            table[:first_live] = [NULL_BLOCK_ID] * first_live
        return tables

    def num_blocks_held(self, request_id: str, group_id: int) -> int:
        state = self._requests.get(request_id)
        if state is None:
            return 0
        return sum(1 for block_id in state.tables[group_id] if block_id != NULL_BLOCK_ID)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV, every group together (the null block excluded)."""
        return self.pool.num_usable_blocks

    def num_blocks_in_use_by_group(self) -> tuple[int, ...]:
        return tuple(self.pool.num_in_use_by_group(g.group_id) for g in self.plan.groups)

    def usage_by_group(self) -> list[float]:
        """Fraction of the pool's usable blocks each group holds in use."""
        usable = self.pool.num_usable_blocks
        return [self.pool.num_in_use_by_group(g.group_id) / usable for g in self.plan.groups]

    # ---- internals -------------------------------------------------------------------

    def _check_token_counts(self, num_computed_tokens: int, num_new_tokens: int) -> None:
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_computed_tokens} and {num_new_tokens}")

    def _initial_tables(self, prefix: Optional[PrefixHit], num_computed_tokens: int) -> list[list[int]]:
        """A new request's tables: the prefix blocks still inside each group's
        window at `num_computed_tokens` (the rest are never referenced)."""
        if prefix is None or prefix.num_tokens == 0:
            return [[] for _ in self.plan.groups]
        tables = []
        for group, ids in zip(self.plan.groups, prefix.block_ids):
            if group.is_state:
                tables.append([])  # the live page comes at admission; the snapshot is restored into it
                continue
            first_live = min(first_live_block(group, num_computed_tokens, self.block_size), len(ids))
            tables.append([NULL_BLOCK_ID] * first_live + list(ids[first_live:]))
        return tables

    def _num_evictable(self, tables: list[list[int]]) -> int:
        """Blocks of a prefix that now count as free: touching them reserves them."""
        return sum(1 for table in tables for b in table if b != NULL_BLOCK_ID and self.pool.ref_count(b) == 0)

    def _check_prefix(self, prefix: PrefixHit, num_computed_tokens: int) -> None:
        num_blocks, rest = divmod(prefix.num_tokens, self.block_size)
        malformed = (rest or len(prefix.block_ids) != self.num_groups
                     or any(len(ids) != num_blocks for ids in prefix.block_ids)
                     or len(prefix.block_hashes) not in (0, num_blocks))
        if malformed:
            raise ValueError(f"malformed prefix hit for {self.num_groups} groups of block size {self.block_size}")
        if num_computed_tokens < prefix.num_tokens:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} < prefix hit {prefix.num_tokens}")
        for group_id, ids in enumerate(prefix.block_ids):
            for index, block_id in enumerate(ids):
                if block_id == NULL_BLOCK_ID:
                    continue
                if prefix.block_hashes:
                    valid = self.pool.lookup(prefix.block_hashes[index], group_id) == block_id
                else:
                    valid = self.pool.owner(block_id) == group_id and self.pool.is_cached(block_id)
                if not valid:
                    raise StalePrefixHit(f"block {block_id} of group {group_id} no longer holds the prefix")
        for group_id, indexes in enumerate(prefix.offloaded):
            for index in indexes:
                if self.offload is None or self.offload.lookup(prefix.block_hashes[index], group_id) is None:
                    raise StalePrefixHit(f"block {index} of group {group_id} left the offload tier")

    def _admit(self, request_id: str, tables: list[list[int]]) -> _RequestBlocks:
        for group_id, table in enumerate(tables):
            self.pool.touch([b for b in table if b != NULL_BLOCK_ID], group_id)
        # Prefix blocks are already in the cache: start committing after them.
        state = _RequestBlocks(tables, [len(t) for t in tables], [0] * len(tables), 0)
        self._requests[request_id] = state
        return state

    def _growth(self, tables: list[list[int]], num_computed_tokens: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Per group: (null entries, new blocks) to append so the table covers
        the target slots; blocks wholly outside the window become null entries."""
        target = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        growth = []
        for group, table in zip(self.plan.groups, tables):
            if group.is_state:
                growth.append((0, 0))  # one live page, whatever the length
                continue
            first_live = first_live_block(group, num_computed_tokens, self.block_size)
            num_null = max(0, min(target, first_live) - len(table))
            num_new = max(0, target - max(len(table), first_live))
            growth.append((num_null, num_new))
        return growth

    def _advance(self, request_id: str, state: _RequestBlocks, num_computed_tokens: int,
                 prefix: Optional[PrefixHit]) -> None:
        """Validate a running request's next call and release its out-of-window blocks."""
        if prefix is not None:
            raise ValueError(f"request {request_id} already has blocks; a prefix applies only on admission")
        if num_computed_tokens < state.num_computed_tokens:
            raise ValueError(f"request {request_id}: num_computed_tokens went back "
                             f"from {state.num_computed_tokens} to {num_computed_tokens}")
        self._release_window(state, num_computed_tokens)
        # The release stands even if the allocation fails, so record how far it went.
        state.num_computed_tokens = num_computed_tokens

    def _window_blocks(self, state: _RequestBlocks, num_computed_tokens: int) -> list[int]:
        """Non-null blocks of sliding groups that slid out of the window, oldest first."""
        block_ids = []
        for group, table in zip(self.plan.groups, state.tables):
            if group.is_state:
                continue
            end = min(first_live_block(group, num_computed_tokens, self.block_size), len(table))
            block_ids += [b for b in table[state.num_released[group.group_id]:end] if b != NULL_BLOCK_ID]
        return block_ids

    def _release_window(self, state: _RequestBlocks, num_computed_tokens: int) -> None:
        released = self._window_blocks(state, num_computed_tokens)
        for group, table in zip(self.plan.groups, state.tables):
            if group.is_state:
                continue
            end = min(first_live_block(group, num_computed_tokens, self.block_size), len(table))
            start = state.num_released[group.group_id]
            if end > start:
                table[start:end] = [NULL_BLOCK_ID] * (end - start)
                state.num_released[group.group_id] = end
        # Oldest first: they are the least likely to be part of a future hit.
        self.pool.free(released)

    def check_invariants(self) -> None:
        """Pool invariants plus: every table entry is null or a block in use by
        that group, with enough references, no sliding table keeps a block
        that has left its window, and the state groups' pages are sound."""
        self.pool.check_invariants()
        refs: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            for group, table in zip(self.plan.groups, state.tables):
                if group.is_state:  # its live page, and the snapshot pages it holds (tier loads)
                    refs.update(table)
                    refs.update(page for group_id, page in zip(self.state.group_ids, state.snapshots.handoff)
                                if group_id == group.group_id)
                    refs.update(ref.block_id for ref in state.snapshots.refs
                                if ref.held and ref.group_id == group.group_id)
                    continue
                first_live = first_live_block(group, state.num_computed_tokens, self.block_size)
                for index, block_id in enumerate(table):
                    if block_id == NULL_BLOCK_ID:
                        continue
                    if self.pool.ref_count(block_id) == 0 or self.pool.owner(block_id) != group.group_id:
                        raise KVInvariantError(f"request {request_id}: block {block_id} in group "
                                               f"{group.group_id}'s table is not in use by that group")
                    if index < first_live and not isinstance(group.spec, FullAttentionSpec):
                        raise KVInvariantError(f"request {request_id}: block {block_id} left group "
                                               f"{group.group_id}'s window but was kept")
                    refs[block_id] += 1
        for block_id, count in refs.items():
            if self.pool.ref_count(block_id) < count:
                raise KVInvariantError(f"block {block_id} is in {count} tables with "
                                       f"{self.pool.ref_count(block_id)} refs")
        if self.state.group_ids:
            self.state.check_invariants({rid: state.tables for rid, state in self._requests.items()},
                                        {rid: state.snapshots for rid, state in self._requests.items()})
