"""Turns per-group block tables of P and D into the two descriptor index lists of one READ,
and validates the remote block ids a decode worker receives on the wire.

Invariant: a pair (local, remote) is emitted only for a position both tables
hold a real block at, past the blocks D already has, and each remote block at
most once, so a READ never touches the null page or writes a block twice.
Torch-free and nixl-free.

Both tables of a group are positional (entry k covers tokens [k*bs, (k+1)*bs)),
as `KVCacheManager.live_block_ids` produces them; 0 is the null block:

    position          0    1    2    3    4
    remote (P) sw  [  0 ,  0 ,  4 , 11 , 20 ]   slid out of the window on P
    local  (D) sw  [  0 ,  0 ,  6 ,  2 ,  9 ]
    skip_blocks = 3        ^^^^ D has position 2 already (prefix hit)
    pairs             (2<-11), (9<-20)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pdserve.api.errors import InvalidRequest
from pdserve.kv.block_pool import NULL_BLOCK_ID

_PARAM = "kv_transfer_params.remote_block_ids"


class InvalidRemoteBlockIds(InvalidRequest):
    """remote_block_ids from kv_transfer_params cannot address the peer's pool."""

    def __init__(self, message: str):
        super().__init__(f"invalid remote_block_ids: {message}", param=_PARAM)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Descriptor index lists of one READ: local page local_ids[i] <- remote page remote_ids[i]."""

    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    num_blocks_per_group: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.local_ids)


def plan_pull(remote_block_ids: Sequence[Sequence[int]], local_block_ids: Sequence[Sequence[int]],
              skip_blocks: Optional[Sequence[int]] = None) -> PullPlan:
    """Pair each group's remote and local tables position by position.

    Drops positions where either side is the null block and the first
    `skip_blocks[g]` positions of group g (blocks D already holds). A remote
    table may be shorter than the local one (D may already hold room for
    tokens P has not computed), never longer.
    """
    num_groups = len(local_block_ids)
    if len(remote_block_ids) != num_groups:
        raise InvalidRemoteBlockIds(f"{len(remote_block_ids)} groups, this worker has {num_groups}")
    skips = [0] * num_groups if skip_blocks is None else list(skip_blocks)
    if len(skips) != num_groups or any(skip < 0 for skip in skips):
        raise ValueError(f"skip_blocks must hold {num_groups} non-negative counts, got {skip_blocks!r}")
    local_ids: list[int] = []
    remote_ids: list[int] = []
    counts: list[int] = []
    for group_id, (remote, local, skip) in enumerate(zip(remote_block_ids, local_block_ids, skips)):
        if len(remote) > len(local):
            raise InvalidRemoteBlockIds(f"group {group_id} has {len(remote)} blocks, "
                                        f"the local table only {len(local)}")
        num_before = len(local_ids)
        for position in range(skip, len(remote)):
            if remote[position] != NULL_BLOCK_ID and local[position] != NULL_BLOCK_ID:
                local_ids.append(local[position])
                remote_ids.append(remote[position])
        counts.append(len(local_ids) - num_before)
    return PullPlan(tuple(local_ids), tuple(remote_ids), tuple(counts))


def validate_remote_block_ids(remote_block_ids: Any, num_groups: int, num_remote_blocks: int,
                              max_blocks_per_group: int) -> list[list[int]]:
    """Check wire data before it addresses anything; returns it as lists of ints.

    Rejects: not a list of `num_groups` lists, a group longer than
    `max_blocks_per_group`, an entry that is not an int (bools included),
    negative or >= `num_remote_blocks`, and a non-null id appearing twice
    (in one group or across groups: a block belongs to one group at a time).
    """
    if not isinstance(remote_block_ids, (list, tuple)):
        raise InvalidRemoteBlockIds(f"expected a list of {num_groups} lists, got {type(remote_block_ids).__name__}")
    if len(remote_block_ids) != num_groups:
        raise InvalidRemoteBlockIds(f"expected {num_groups} groups, got {len(remote_block_ids)}")
    seen: dict[int, int] = {}
    checked: list[list[int]] = []
    for group_id, group in enumerate(remote_block_ids):
        if not isinstance(group, (list, tuple)):
            raise InvalidRemoteBlockIds(f"group {group_id} must be a list, got {type(group).__name__}")
        if len(group) > max_blocks_per_group:
            raise InvalidRemoteBlockIds(f"group {group_id} has {len(group)} blocks, "
                                        f"at most {max_blocks_per_group} allowed")
        for block_id in group:
            _check_block_id(group_id, block_id, num_remote_blocks)
            if block_id != NULL_BLOCK_ID:
                if block_id in seen:
                    raise InvalidRemoteBlockIds(f"block {block_id} appears twice "
                                                f"(groups {seen[block_id]} and {group_id})")
                seen[block_id] = group_id
        checked.append(list(group))
    return checked


def _check_block_id(group_id: int, block_id: Any, num_remote_blocks: int) -> None:
    if not isinstance(block_id, int) or isinstance(block_id, bool):
        raise InvalidRemoteBlockIds(f"group {group_id} holds {block_id!r}, not an integer block id")
    if not 0 <= block_id < num_remote_blocks:
        raise InvalidRemoteBlockIds(f"group {group_id} holds block {block_id}, "
                                    f"outside the peer's pool of {num_remote_blocks} blocks (0..{num_remote_blocks - 1})")


@dataclass(frozen=True, slots=True)
class Run:
    """Pages (or chunks) local_first.. <- remote_first.., `count` of them, contiguous on both sides."""

    local_first: int
    remote_first: int
    count: int


def contiguous_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[Run]:
    """The pairs (local_ids[i] <- remote_ids[i]) grouped into runs that are consecutive on both
    sides, in order: each run can move as one descriptor.

        local  [ 5, 6, 7, 9, 10 ]      runs: (5 <- 20, 3 pages), (9 <- 30, 1), (10 <- 40, 1)
        remote [20,21,22,30, 40 ]
    """
    runs: list[Run] = []
    for local_id, remote_id in zip(local_ids, remote_ids):
        last = runs[-1] if runs else None
        follows = last is not None and (local_id, remote_id) == (last.local_first + last.count,
                                                                 last.remote_first + last.count)
        if last is not None and follows:
            runs[-1] = Run(last.local_first, last.remote_first, last.count + 1)
        else:
            runs.append(Run(local_id, remote_id, 1))
    return runs
