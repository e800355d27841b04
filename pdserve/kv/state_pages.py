"""The state groups' pages: one live page per request, snapshots for the prefix cache, and the copies between them.

Invariant: from its first allocation to its free, a request holds exactly one live page per state
group (its table in that group is that one id), never cached: the forward pass updates it in place.
A snapshot is a page cached under (hash of block k-1, group) that holds the state after token
k*block_size; it is filled and read only by recorded page copies, which the runner performs in
order before the next forward pass. Every page a pending copy reads or writes holds an extra
reference until the copies after the ones it belongs to are taken, so nothing can hand it out
and write it (a tier read, a pull, another request's forward) before its copy ran. A prefill-role
request may also hold one handoff page per state group (`keep_handoff`): a copy of its live page
taken when it had computed all but the last prompt token, what a decode worker pulls (it computes
that token itself); held like the live page, freed with the request's blocks. Torch-free.

    request r, state group g, block_size 4, snapshots every 2 blocks:

    tokens        0...3 | 4...7 | 8..11 | 12..15
    live page     [ 17 ]  (updated in place by every forward pass)
    commit at 8   copy 17 -> 40,  40 cached under (hash[1], g)   (snapshot after token 8)
    commit at 16  copy 17 -> 52,  52 cached under (hash[3], g)

    later request r', same first 12 tokens: the hit is cut to 8 tokens (the latest snapshot);
    admission allocates its live page 23 and records copy 40 -> 23 (the restore)

Pins, in a synchronous engine loop (schedule, then the runner's copies and forward, then update):
copies recorded during update t and schedule t+1 are taken at the end of schedule t+1 and run
before forward t+1; their pages are released when the copies of schedule t+2 are taken, so no
allocation made before those copies ran can reuse them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pdserve.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVInvariantError
from pdserve.kv.prefix import PrefixHit, max_hit_blocks
from pdserve.kv.specs import KVGroupPlan

logger = logging.getLogger(__name__)


def default_snapshot_interval_blocks(plan: KVGroupPlan) -> int:
    """Blocks between periodic snapshots when the caller names none: one snapshot costs one page per
    state group, so snapshotting every ceil(state groups / attention groups) blocks keeps a cached
    prefix's periodic snapshots at most as large as its attention pages (plus the one at the prompt's
    last full block), while a hit loses at most that many blocks to recompute. The scheduler ends a
    prefill chunk at each of these boundaries (a step per interval); docs/benchmarks.md measures it. Qwen3.5-like (48 state groups, one
    attention group): every 48 blocks; a model whose state packs into few pages: nearly every block."""
    num_state = len(plan.state_group_ids)
    num_attention = len(plan.groups) - num_state
    return max(1, -(-num_state // max(1, num_attention)))


@dataclass(slots=True)
class SnapshotRef:
    """A snapshot a request took, restored from or loads from the tier (refreshed in the LRU
    with the request's blocks when it ends)."""

    block_id: int
    group_id: int
    index: int  # the block index k - 1 of the boundary it holds the state at
    block_hash: bytes
    held: bool  # the request holds a reference on it (a tier load's page), released at free


@dataclass(slots=True)
class RequestSnapshots:
    refs: list[SnapshotRef] = field(default_factory=list)
    num_snapshot_blocks: int = 0  # the latest boundary (in blocks) this request snapshotted or restored
    enabled: bool = True  # False once the caller said the live state holds tokens nothing computed
    handoff: tuple[int, ...] = ()  # per state group (in group order): the page a decode worker pulls


class StatePages:
    """Live pages, snapshots and the pending page copies of every state group of one pool."""

    def __init__(self, plan: KVGroupPlan, pool: BlockPool, block_size: int,
                 snapshot_interval_blocks: Optional[int] = None):
        if snapshot_interval_blocks is not None and snapshot_interval_blocks < 0:
            raise ValueError(f"snapshot_interval_blocks must be >= 0 (0: prompt boundaries only), "
                             f"got {snapshot_interval_blocks}")
        self.group_ids = plan.state_group_ids
        self.pool = pool
        self.block_size = block_size
        self.snapshot_interval_blocks = (default_snapshot_interval_blocks(plan) if snapshot_interval_blocks is None
                                         else snapshot_interval_blocks)
        self._copies: list[tuple[int, int]] = []  # (source page, destination page), in order, not yet taken
        # (page, group): one reference each, for the copies not yet taken, and for those taken last time
        self._pins: list[tuple[int, int]] = []
        self._taken_pins: list[tuple[int, int]] = []

    # ---- admission -----------------------------------------------------------------

    def hit_snapshots(self, prefix: Optional[PrefixHit]) -> list[tuple[int, int]]:
        """(group, page) of the device snapshots a prefix hit restores from."""
        if prefix is None or not prefix.num_tokens:
            return []
        return [(g, prefix.block_ids[g][-1]) for g in self.group_ids if prefix.block_ids[g][-1] != NULL_BLOCK_ID]

    def num_reserved(self, prefix: Optional[PrefixHit]) -> int:
        """Snapshot pages of the hit that count as free now: admission pins them before allocating."""
        return sum(1 for _, page in self.hit_snapshots(prefix) if self.pool.ref_count(page) == 0)

    def admit(self, tables: list[list[int]], snapshots: RequestSnapshots, prefix: Optional[PrefixHit],
              restore: bool) -> None:
        """Allocate the live pages (the caller checked there is room); with `restore`, record the copy of
        each device snapshot of the hit into them (tier snapshots restore when their load lands)."""
        sources = self.hit_snapshots(prefix) if restore else []
        for group_id, page in sources:
            self.pool.touch([page], group_id)  # pinned before any allocation can evict it
        for group_id in self.group_ids:
            tables[group_id] = self.pool.allocate(1, group_id)
        if prefix is None or not restore or not prefix.num_tokens:
            return
        index = prefix.num_tokens // self.block_size - 1
        snapshots.num_snapshot_blocks = index + 1
        for group_id, page in sources:
            self._record(page, tables[group_id][0], group_id, source_pinned=True)
            if prefix.block_hashes:  # known by its key: refreshed in the LRU when the request ends
                snapshots.refs.append(SnapshotRef(page, group_id, index, prefix.block_hashes[index], held=False))

    def hold_loaded(self, snapshots: RequestSnapshots, block_id: int, group_id: int, index: int,
                    block_hash: bytes) -> None:
        """A fresh page a tier snapshot loads into: the request holds it until it ends."""
        snapshots.refs.append(SnapshotRef(block_id, group_id, index, block_hash, held=True))
        snapshots.num_snapshot_blocks = max(snapshots.num_snapshot_blocks, index + 1)

    def restore_loaded(self, tables: list[list[int]], block_id: int, group_id: int) -> None:
        """A tier snapshot landed in `block_id`: copy it into the request's live page."""
        self.pool.touch([block_id], group_id)
        self._record(block_id, tables[group_id][0], group_id, source_pinned=True)

    # ---- snapshots -------------------------------------------------------------------

    def prompt_boundary_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt's last full block a repeat of it can hit (0: none): where the caller passes
        `prompt_boundary=True` to commit."""
        return max_hit_blocks(num_prompt_tokens, self.block_size) * self.block_size

    def next_snapshot_tokens(self, num_computed_tokens: int, num_prompt_tokens: int) -> Optional[int]:
        """The first token count after `num_computed_tokens` at which a commit takes a snapshot: a chunk
        that should leave one ends there. None when no boundary is due (or there are no state groups)."""
        if not self.group_ids:
            return None
        candidates = []
        prompt_tokens = self.prompt_boundary_tokens(num_prompt_tokens)
        if prompt_tokens > num_computed_tokens:
            candidates.append(prompt_tokens)
        if self.snapshot_interval_blocks:
            step = self.snapshot_interval_blocks * self.block_size
            candidates.append((num_computed_tokens // step + 1) * step)
        return min(candidates, default=None)

    def is_due(self, num_blocks: int, prompt_boundary: bool) -> bool:
        interval = self.snapshot_interval_blocks
        return num_blocks > 0 and (prompt_boundary or (interval > 0 and num_blocks % interval == 0))

    def snapshot(self, tables: list[list[int]], snapshots: RequestSnapshots, block_hashes: Sequence[bytes],
                 num_computed_tokens: int, prompt_boundary: bool) -> bool:
        """Take a snapshot of every state group if `num_computed_tokens` is a block boundary the policy
        wants and no later one was taken; skipped (False) when the pool cannot give every missing page."""
        num_blocks, rest = divmod(num_computed_tokens, self.block_size)
        if (rest or not snapshots.enabled or num_blocks <= snapshots.num_snapshot_blocks
                or num_blocks > len(block_hashes) or not self.is_due(num_blocks, prompt_boundary)):
            return False
        block_hash = block_hashes[num_blocks - 1]
        cached = {g: self.pool.lookup(block_hash, g) for g in self.group_ids}
        missing = [g for g, page in cached.items() if page is None]
        if len(missing) > self.pool.num_free_blocks:
            logger.debug("no free page for a state snapshot at block %d: skipped", num_blocks)
            return False
        parent = block_hashes[num_blocks - 2] if num_blocks > 1 else None
        for group_id in missing:  # another request's snapshot of the same tokens serves the others
            page = cached[group_id] = self.pool.allocate(1, group_id)[0]  # its reference is the destination's pin
            self._record(tables[group_id][0], page, group_id, source_pinned=False, destination_pinned=True)
            self.pool.cache(page, block_hash, group_id, parent)
        snapshots.refs += [SnapshotRef(page, g, num_blocks - 1, block_hash, held=False) for g, page in cached.items()]
        snapshots.num_snapshot_blocks = num_blocks
        return True

    # ---- P/D handoff ------------------------------------------------------------------

    def keep_handoff(self, tables: list[list[int]], snapshots: RequestSnapshots) -> bool:
        """Give the request one handoff page per state group and record the copy of its live page into
        it (it runs before the next forward pass, so the page holds the state the request has now).
        Idempotent; False (nothing changed) when the pool cannot give every page."""
        if snapshots.handoff:
            return True
        if len(self.group_ids) > self.pool.num_free_blocks:
            return False
        pages = []
        for group_id in self.group_ids:
            page = self.pool.allocate(1, group_id)[0]  # the request's reference; the copy pins it once more
            self._record(tables[group_id][0], page, group_id, source_pinned=False)
            pages.append(page)
        snapshots.handoff = tuple(pages)
        return True

    # ---- copies ---------------------------------------------------------------------

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) page copies recorded since the last call, in order; releases the
        pages of the copies the previous call returned (they ran before the forward pass since)."""
        self.pool.free([page for page, _ in self._taken_pins])
        copies, self._copies = self._copies, []
        self._taken_pins, self._pins = self._pins, []
        return copies

    def _record(self, source: int, destination: int, group_id: int, *, source_pinned: bool,
                destination_pinned: bool = False) -> None:
        if not source_pinned:
            self.pool.touch([source], group_id)
        if not destination_pinned:
            self.pool.touch([destination], group_id)
        self._copies.append((source, destination))
        self._pins += [(source, group_id), (destination, group_id)]

    # ---- release ---------------------------------------------------------------------

    def release_order(self, tables: list[list[int]], snapshots: RequestSnapshots) -> dict[int, list[int]]:
        """Block index -> the request's state pages to free with that index's blocks (the snapshots still
        cached under their key are touched first, so freeing them refreshes them in the LRU beside the
        attention blocks of the same position); the live pages go with index 0."""
        order: dict[int, list[int]] = {}
        for ref in snapshots.refs:
            if not ref.held:
                if self.pool.lookup(ref.block_hash, ref.group_id) != ref.block_id:
                    continue  # evicted (or re-keyed) since: nothing to refresh
                self.pool.touch([ref.block_id], ref.group_id)
            order.setdefault(ref.index, []).append(ref.block_id)
        order.setdefault(0, []).extend(tables[g][0] for g in self.group_ids if tables[g])
        order[0].extend(snapshots.handoff)
        return order

    def check_invariants(self, tables_by_request: dict[str, list[list[int]]],
                         snapshots_by_request: dict[str, RequestSnapshots]) -> None:
        """One live page per request and state group, in use by it, uncached, in no other table;
        held snapshot pages and pinned pages in use by their group."""
        live: dict[int, str] = {}
        for request_id, tables in tables_by_request.items():
            for group_id in self.group_ids:
                table = tables[group_id]
                if len(table) != 1 or table[0] == NULL_BLOCK_ID:
                    raise KVInvariantError(f"request {request_id}: state group {group_id} table {table} is not "
                                           f"one live page")
                page = table[0]
                if self.pool.ref_count(page) == 0 or self.pool.owner(page) != group_id:
                    raise KVInvariantError(f"request {request_id}: live page {page} not in use by group {group_id}")
                if self.pool.is_cached(page):
                    raise KVInvariantError(f"request {request_id}: live page {page} is in the prefix cache")
                if page in live:
                    raise KVInvariantError(f"live page {page} is shared by {live[page]} and {request_id}")
                live[page] = request_id
            snapshots = snapshots_by_request[request_id]
            if snapshots.handoff and len(snapshots.handoff) != len(self.group_ids):
                raise KVInvariantError(f"request {request_id}: handoff pages {snapshots.handoff} are not one per "
                                       f"state group {self.group_ids}")
            for group_id, page in zip(self.group_ids, snapshots.handoff):
                if self.pool.ref_count(page) == 0 or self.pool.owner(page) != group_id or self.pool.is_cached(page):
                    raise KVInvariantError(f"request {request_id}: handoff page {page} not held uncached by "
                                           f"group {group_id}")
                if page in live:
                    raise KVInvariantError(f"handoff page {page} of {request_id} is also a live page")
            for ref in snapshots.refs:
                held_in_use = self.pool.ref_count(ref.block_id) > 0 and self.pool.owner(ref.block_id) == ref.group_id
                if ref.held and not held_in_use:
                    raise KVInvariantError(f"request {request_id}: held snapshot page {ref.block_id} not in use")
        for page, group_id in self._pins + self._taken_pins:
            if self.pool.ref_count(page) == 0 or self.pool.owner(page) != group_id:
                raise KVInvariantError(f"page {page} of a pending state copy is not in use by its group")
