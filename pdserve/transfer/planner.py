"""Turns the per-group handoffs of P and D into the two unit-id lists of one READ, and validates the
remote block ids a decode worker receives on the wire.

Invariant: a pair (local, remote) is emitted only for a unit of tokens both
sides hold a real block at, inside the prompt, past the tokens D already has,
and each unit at most once, so a READ never touches the null page or writes a
unit twice. Torch-free and nixl-free.

Each side hands over a positional slice of its table (`HandoffSide`: entry k
covers tokens [(first_block + k) * bs, (first_block + k + 1) * bs)); 0 is the
null block. The two block sizes may differ (one divides the other): both are
cut into units of the smaller one, and a unit id is `block * (bs // unit) + slot`
(pdserve/transfer/token_units.py). With equal block sizes a unit is a block:

    token              0        16       32       48       64
    remote (P) bs 16   [  11   ][  12   ][  20   ][  21   ]
    local  (D) bs 32   [       5        ][       9        ]
    units (16 tokens)  (5,0)<-11 (5,1)<-12 (9,0)<-20 (9,1)<-21
    unit ids           10<-11    11<-12    18<-20    19<-21

A sliding-window group hands over only its live window, and P's window starts
on P's block boundary: with larger D blocks the first D block of the window may
begin before P's first token. Its head then holds nothing P sent; the attention
mask never reads it for this prompt, but the block must not enter D's prefix
cache (`PullPlan.uncached_blocks`).

A recurrent-state group's side is one whole page (`HandoffSide.is_state`): P's handoff page, the
state after all but the last prompt token, into D's live page. It moves as one unit, so only
between equal block sizes and equal TP sizes (a state page is no grid of token rows, and a rank's
page holds its heads' share), and only when D does not hold that state itself (its prefix cache
restored it: `num_held_tokens` is all but the last token):

    state group   remote (P) [ 37 ] handoff page  ->  local (D) [ 8 ] live page   (one unit each)

Between different block sizes or TP sizes the two sides may cut their state layers into groups
differently (a state page holds as many layers as the attention page allows, kv/page_geometry.py),
and a token unit is no measure of a state slot. State then moves slot by slot
(`plan_state_moves`): each layer's slot of P's handoff page into that layer's slot of D's live
page; each D rank cuts from it the byte ranges of its heads on the P rank(s) holding them, ranges
adjacent on both sides merged (transfer/state_ranges.py); a page's padding never moves:

    P (block 16)  page 37: [ layer 0 ][ pad ]   page 38: [ layer 1 ][ pad ]   page 39: [ layer 2 ][ pad ]
    D (block 32)  page 8:  [ layer 0 ][ layer 2 ][ pad ]                      page 9:  [ layer 1 ][ pad ]
    slot moves    (8, 0) <- (37, 0) | (8, s) <- (39, 0) | (9, 0) <- (38, 0)   s = D's slot bytes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pdserve.api.errors import InvalidRequest
from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.transfer.state_ranges import StateMove, StateSlotMove, StateSplit
from pdserve.transfer.token_units import block_size_problem

__all__ = ["HandoffSide", "InvalidRemoteBlockIds", "PullPlan", "Run", "StateMove", "StatePage", "StateSlotMove",
           "contiguous_runs", "plan_pull", "plan_state_moves", "validate_remote_block_ids"]

_PARAM = "kv_transfer_params.remote_block_ids"


class InvalidRemoteBlockIds(InvalidRequest):
    """remote_block_ids from kv_transfer_params cannot address the peer's pool."""

    def __init__(self, message: str):
        super().__init__(f"invalid remote_block_ids: {message}", param=_PARAM)


@dataclass(frozen=True, slots=True)
class HandoffSide:
    """One worker's handoff of one group: its table entries from index `first_block` on."""

    block_size: int
    first_block: int
    block_ids: Sequence[int]
    is_state: bool = False  # a recurrent-state group's one page, not a run of token blocks

    @property
    def first_token(self) -> int:
        return self.first_block * self.block_size

    @property
    def end_token(self) -> int:
        return (self.first_block + len(self.block_ids)) * self.block_size

    def unit_id(self, token: int, unit_tokens: int) -> int:
        """The unit holding `token` (NULL_BLOCK_ID's units map to a negative id)."""
        index, offset = divmod(token, self.block_size)
        block_id = self.block_ids[index - self.first_block]
        if block_id == NULL_BLOCK_ID:
            return -1
        return block_id * (self.block_size // unit_tokens) + offset // unit_tokens


@dataclass(frozen=True, slots=True)
class StatePage:
    """One worker's handoff page of one state group: its page id, the layer in each slot, one
    slot's bytes on one rank, and how a layer's state splits over ranks."""

    page_id: int
    layer_ids: tuple[int, ...]
    state_bytes: int  # one layer's slot on one rank
    split: StateSplit


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Unit-id lists of one READ: local unit local_ids[i] <- remote unit remote_ids[i]; and the
    state layers' slots it moves besides (`state_moves`: between different block sizes or TP
    sizes; each rank cuts its byte ranges from them, transfer/state_ranges.py)."""

    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    unit_tokens: int
    num_units_per_group: tuple[int, ...]
    uncached_blocks: tuple[int, ...]  # per group: D's table entries [0, n) must not enter its prefix cache
    state_moves: tuple[StateSlotMove, ...] = ()

    @property
    def num_units(self) -> int:
        return len(self.local_ids)

    @property
    def is_empty(self) -> bool:
        return not self.local_ids and not self.state_moves


def plan_pull(remote: Sequence[HandoffSide], local: Sequence[HandoffSide], num_tokens: int,
              num_held_tokens: int = 0) -> PullPlan:
    """Pair each group's remote and local handoffs unit by unit over the prompt's `num_tokens` tokens,
    from the first token both hold that D does not (its prefix cache holds `num_held_tokens`)."""
    if len(remote) != len(local):
        raise InvalidRemoteBlockIds(f"{len(remote)} groups, this worker has {len(local)}")
    if num_held_tokens < 0 or num_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {num_tokens} and {num_held_tokens}")
    sizes = {side.block_size for side in (*remote, *local)}
    if len(sizes) > 2 or any(block_size_problem(min(sizes), size) for size in sizes):
        raise ValueError(f"block sizes {sorted(sizes)} do not pair")
    unit = min(sizes, default=1)
    local_ids: list[int] = []
    remote_ids: list[int] = []
    counts: list[int] = []
    uncached: list[int] = []
    for theirs, ours in zip(remote, local):
        if theirs.is_state or ours.is_state:
            pairs = _state_pairs(theirs, ours, unit, num_tokens, num_held_tokens)
            local_ids += [page for page, _ in pairs]
            remote_ids += [page for _, page in pairs]
            counts.append(len(pairs))
            uncached.append(0)
            continue
        start = max(theirs.first_token, ours.first_token, num_held_tokens)
        end = min(-(-num_tokens // unit) * unit, theirs.end_token, ours.end_token)
        num_before = len(local_ids)
        for token in range(start, end, unit):
            local_unit, remote_unit = ours.unit_id(token, unit), theirs.unit_id(token, unit)
            if local_unit >= 0 and remote_unit >= 0:
                local_ids.append(local_unit)
                remote_ids.append(remote_unit)
        counts.append(len(local_ids) - num_before)
        starts_mid_block = start < end and start % ours.block_size != 0
        uncached.append(start // ours.block_size + 1 if starts_mid_block else 0)
    return PullPlan(tuple(local_ids), tuple(remote_ids), unit, tuple(counts), tuple(uncached))


def _state_pairs(theirs: HandoffSide, ours: HandoffSide, unit_tokens: int, num_tokens: int,
                 num_held_tokens: int) -> list[tuple[int, int]]:
    """(local page, remote page) of a state group: its one page, unless D holds the state itself."""
    if not (theirs.is_state and ours.is_state):
        raise InvalidRemoteBlockIds("a recurrent-state group on one side is an attention group on the other")
    if theirs.block_size != unit_tokens or ours.block_size != unit_tokens:
        raise ValueError(f"state pages move whole, between equal block sizes only (here {ours.block_size}, "
                         f"there {theirs.block_size}, unit {unit_tokens})")
    if len(theirs.block_ids) != len(ours.block_ids) or len(ours.block_ids) > 1:
        raise InvalidRemoteBlockIds(f"a state group hands over at most one page; got {list(theirs.block_ids)} "
                                    f"for {list(ours.block_ids)}")
    if num_held_tokens >= num_tokens - 1:
        return []  # D's own snapshot holds the state after all but the last token
    return [(local_page, remote_page) for local_page, remote_page in zip(ours.block_ids, theirs.block_ids)
            if local_page != NULL_BLOCK_ID and remote_page != NULL_BLOCK_ID]


def plan_state_moves(remote: Sequence[StatePage], local: Sequence[StatePage], num_tokens: int,
                     num_held_tokens: int = 0) -> tuple[StateSlotMove, ...]:
    """Each state layer's slot of P's handoff pages (`remote`) into its slot of D's live pages
    (`local`), in D's page and slot order; none when D holds the state itself (`num_held_tokens`
    is all but the last token) or the prompt has one token (no pages)."""
    if num_held_tokens >= num_tokens - 1 or not remote or not local:
        if bool(remote) != bool(local) and num_tokens >= 2:
            raise InvalidRemoteBlockIds(f"{len(remote)} state pages there, {len(local)} here")
        return ()
    theirs = _state_slots(remote, "remote")
    ours = _state_slots(local, "local")
    if set(theirs) != set(ours):
        raise InvalidRemoteBlockIds(f"state layers {sorted(theirs)} there, {sorted(ours)} here")
    moves: list[StateSlotMove] = []
    for layer_id, (local_page, local_offset, split) in sorted(ours.items(), key=lambda item: item[1][:2]):
        remote_page, remote_offset, remote_split = theirs[layer_id]
        if remote_split != split:
            raise InvalidRemoteBlockIds(f"layer {layer_id} keeps its state as {remote_split} there, {split} here")
        moves.append(StateSlotMove(local_page, local_offset, remote_page, remote_offset, split))
    return tuple(moves)


def _state_slots(pages: Sequence[StatePage], side: str) -> dict[int, tuple[int, int, StateSplit]]:
    """layer id -> (page, byte offset of its slot, split); a layer in two slots or a null page is refused."""
    slots: dict[int, tuple[int, int, StateSplit]] = {}
    for page in pages:
        if page.page_id == NULL_BLOCK_ID:
            raise InvalidRemoteBlockIds(f"a {side} state group hands over the null page")
        for slot, layer_id in enumerate(page.layer_ids):
            if layer_id in slots:
                raise InvalidRemoteBlockIds(f"state layer {layer_id} appears twice on the {side} side")
            slots[layer_id] = (page.page_id, slot * page.state_bytes, page.split)
    return slots


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
