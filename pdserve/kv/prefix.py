"""Prefix-cache matching across hybrid KV groups.

Invariant: a hit of L tokens is usable by every group at once: each full-
attention group holds blocks [0, L/bs), each sliding group holds the blocks
covering every key position the token at L attends to, and each state group
holds a snapshot of the state after token L (cached under the hash of block
L/bs - 1), from the device pool or, with an offload tier, from the tier (device
first). Takes no references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from pdserve.kv.block_pool import NULL_BLOCK_ID, KVInvariantError
from pdserve.kv.specs import FullAttentionSpec, KVGroup, KVGroupPlan, RecurrentStateSpec, SlidingWindowSpec


class BlockLookup(Protocol):
    """What matching reads: the block pool, or a router's view of one worker's cache."""

    def lookup(self, block_hash: bytes, group_id: int) -> Optional[int]:
        """The block cached under (block_hash, group_id), or None."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """`num_tokens` prompt tokens whose KV is cached; `block_ids[g]` holds
    num_tokens // block_size ids for group g (0 where a sliding group needs none,
    where the block is in the offload tier, and in a state group everywhere but
    the last index, which holds the snapshot page). `offloaded[g]` lists the block
    indexes of group g to load from the tier (empty without one).
    `block_hashes` lets the manager check the hit is still valid when used."""

    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    block_hashes: tuple[bytes, ...] = ()
    offloaded: tuple[tuple[int, ...], ...] = ()

    @property
    def num_offloaded_blocks(self) -> int:
        return sum(len(indexes) for indexes in self.offloaded)

    def num_device_tokens(self, block_size: int) -> int:
        """Tokens before the first block any group loads from the tier: the part the device pool served."""
        first = min((min(indexes) for indexes in self.offloaded if indexes), default=self.num_tokens // block_size)
        return first * block_size

    @classmethod
    def empty(cls, num_groups: int) -> "PrefixHit":
        return cls(0, ((),) * num_groups)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # find_prefix calls while caching is enabled
    num_query_tokens: int = 0  # prompt tokens those calls asked about
    num_hit_tokens: int = 0  # tokens they found cached
    num_offload_hit_tokens: int = 0  # of those, tokens from the first block loaded from the offload tier on


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most blocks a prompt can take from the cache: never its last token, which is always
    computed for its logits. One rule for the workers and for the proxy's predictions."""
    return max(0, num_prompt_tokens - 1) // block_size


def first_live_block(group: KVGroup, num_tokens: int, block_size: int) -> int:
    """Index of the first block a query at position `num_tokens` still reads:
    every block before it lies wholly outside the group's attention window."""
    return group.spec.needed_from(num_tokens) // block_size


OFFLOADED = -1  # what a tiered lookup answers for a block held by the tier only


class TieredLookup:
    """The device pool first, then the tier: a block found only in the tier reads as OFFLOADED."""

    def __init__(self, pool: BlockLookup, tier: BlockLookup):
        self.pool, self.tier = pool, tier

    def lookup(self, block_hash: bytes, group_id: int) -> Optional[int]:
        block_id = self.pool.lookup(block_hash, group_id)
        if block_id is None and self.tier.lookup(block_hash, group_id) is not None:
            return OFFLOADED
        return block_id


def match_prefix(pool: BlockLookup, plan: KVGroupPlan, block_hashes: Sequence[bytes], max_blocks: int,
                 block_size: int, tier: Optional[BlockLookup] = None) -> PrefixHit:
    """The longest prefix of at most `max_blocks` blocks every group can serve, from the pool
    or the tier (the same rule: a sliding group needs only the blocks in its window at the hit,
    a state group only its snapshot at the hit)."""
    if tier is not None:
        return _split_offloaded(match_prefix(TieredLookup(pool, tier), plan, block_hashes, max_blocks, block_size))
    limit = max(0, min(max_blocks, len(block_hashes)))
    state_groups = [g for g in plan.groups if isinstance(g.spec, RecurrentStateSpec)]
    while True:
        num_blocks, found = _attention_hit(pool, plan, block_hashes, limit, block_size)
        # The latest boundary at or before the attention hit where every state group has a snapshot;
        # a shorter limit can change a sliding group's answer, so match again until both agree.
        num_state_blocks = _latest_snapshot(pool, state_groups, block_hashes, num_blocks)
        if num_state_blocks == num_blocks:
            break
        limit = num_state_blocks
    block_ids = []
    for group in plan.groups:
        if isinstance(group.spec, RecurrentStateSpec):
            snapshot = (pool.lookup(block_hashes[num_blocks - 1], group.group_id),) if num_blocks else ()
            block_ids.append((NULL_BLOCK_ID,) * (num_blocks - len(snapshot)) + snapshot)
        else:
            block_ids.append(_hit_ids(group, found[group.group_id], num_blocks, block_size))
    return PrefixHit(num_blocks * block_size, tuple(block_ids), tuple(block_hashes[:num_blocks]))


def _attention_hit(pool: BlockLookup, plan: KVGroupPlan, block_hashes: Sequence[bytes], limit: int,
                   block_size: int) -> tuple[int, dict[int, list[Optional[int]]]]:
    """The longest hit of at most `limit` blocks the attention groups can serve, and what each found."""
    full_groups = [g for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
    sliding_groups = [g for g in plan.groups if isinstance(g.spec, SlidingWindowSpec)]
    found: dict[int, list[Optional[int]]] = {}
    # Full attention reads every earlier key: the hit can be no longer than the
    # left-to-right run of each full group, so those bound the search first.
    for group in full_groups:
        found[group.group_id] = ids = _match_run(pool, block_hashes[:limit], group.group_id)
        limit = len(ids)
    for group in sliding_groups:
        found[group.group_id] = [pool.lookup(h, group.group_id) for h in block_hashes[:limit]]
    return _longest_sliding_hit(sliding_groups, found, limit, block_size), found


def _latest_snapshot(pool: BlockLookup, state_groups: list[KVGroup], block_hashes: Sequence[bytes],
                     num_blocks: int) -> int:
    """Largest k <= num_blocks with a snapshot of every state group under block_hashes[k - 1]."""
    if not state_groups:
        return num_blocks
    for k in range(num_blocks, 0, -1):
        if all(pool.lookup(block_hashes[k - 1], g.group_id) is not None for g in state_groups):
            return k
    return 0


def _split_offloaded(hit: PrefixHit) -> PrefixHit:
    """OFFLOADED entries become null ids plus their indexes in `offloaded`."""
    offloaded = tuple(tuple(i for i, b in enumerate(ids) if b == OFFLOADED) for ids in hit.block_ids)
    block_ids = tuple(tuple(NULL_BLOCK_ID if b == OFFLOADED else b for b in ids) for ids in hit.block_ids)
    return PrefixHit(hit.num_tokens, block_ids, hit.block_hashes, offloaded)


def _match_run(pool: BlockLookup, block_hashes: Sequence[bytes], group_id: int) -> list[int | None]:
    ids: list[int | None] = []
    for block_hash in block_hashes:
        block_id = pool.lookup(block_hash, group_id)
        if block_id is None:
            break
        ids.append(block_id)
    return ids


def _longest_sliding_hit(sliding_groups: list[KVGroup], found: dict[int, list[int | None]], limit: int,
                         block_size: int) -> int:
    """Largest k <= limit such that each sliding group has blocks
    [first_live_block(k * bs), k) all cached. k = 0 always qualifies."""
    # run_ends[g][i]: length of the run of cached blocks ending at index i.
    run_ends: dict[int, list[int]] = {}
    for group in sliding_groups:
        runs, run = [], 0
        for block_id in found[group.group_id]:
            run = run + 1 if block_id is not None else 0
            runs.append(run)
        run_ends[group.group_id] = runs
    for k in range(limit, 0, -1):
        if all(run_ends[g.group_id][k - 1] >= k - first_live_block(g, k * block_size, block_size)
               for g in sliding_groups):
            return k
    return 0


def _hit_ids(group: KVGroup, found: list[int | None], num_blocks: int, block_size: int) -> tuple[int, ...]:
    start = first_live_block(group, num_blocks * block_size, block_size)
    live = found[start:num_blocks]
    if any(block_id is None for block_id in live):
        raise KVInvariantError(f"group {group.group_id} matched a prefix with a missing block")
    return (NULL_BLOCK_ID,) * start + tuple(live)  # type: ignore[arg-type]
