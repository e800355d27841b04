"""Which blocks of a prompt travel from P to D: the one alignment rule both sides use.

Invariant: for every group, P hands over exactly the blocks at indices
`handoff_range(...)` of its table, in order, and D writes them into the same
indices of its own table. The range ends at the prompt's last block and starts
at the first block the last prompt token still reads (sliding-window groups
drop what slid out; full groups start at 0). A recurrent-state group hands over one page,
whatever the prompt's length: P's handoff page (the state after all but the last prompt token,
kv/state_pages.py), written into D's live page; none for a one-token prompt (D computes it from
zeros). Between different block sizes or TP sizes P and D may cut their state layers into pages
differently, and a rank's slot holds its heads' share (`peer_plan` rebuilds P's plan from its
handshake, its slots cut for its TP size); state then moves layer by layer, each D rank reading
the byte ranges of its heads from the P ranks holding them (`plan_handoff_pull`,
transfer/planner.py `plan_state_moves`, transfer/state_ranges.py). Torch-free.

    prompt of 30 tokens, block_size 4 (8 blocks), window 8; the last prompt
    token (position 29) reads keys 22..29, i.e. blocks 5..7:
      block index          0   1   2   3   4   5   6   7
      full group         [ x   x   x   x   x   x   x   x ]  handoff_range = range(0, 8)
      sliding group      [ .   .   .   .   .   x   x   x ]  handoff_range = range(5, 8)
      state group        [ h ]                                  handoff_range = range(0, 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from pdserve.api.kv_transfer import AgentInfo
from pdserve.kv.prefix import first_live_block
from pdserve.kv.specs import KVGroup, KVGroupPlan, RecurrentStateSpec
from pdserve.transfer.planner import (HandoffSide, InvalidRemoteBlockIds, PullPlan, StatePage, plan_pull,
                                      plan_state_moves)
from pdserve.transfer.state_ranges import StateSplit, rank_state_spec


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def handoff_range(group: KVGroup, num_prompt_tokens: int, block_size: int) -> range:
    """Block indices of `group` whose KV D needs to compute the last prompt token itself (a state
    group: its one handoff page, table index 0)."""
    if group.is_state:
        return range(0, 1 if num_prompt_tokens >= 2 else 0)
    end = num_blocks_for(num_prompt_tokens, block_size)
    start = min(first_live_block(group, num_prompt_tokens - 1, block_size), end)
    return range(start, end)


def handoff_ranges(plan: KVGroupPlan, num_prompt_tokens: int, block_size: int) -> list[range]:
    return [handoff_range(group, num_prompt_tokens, block_size) for group in plan.groups]


def handoff_slices(tables: Sequence[Sequence[int]], ranges: Sequence[range]) -> list[list[int]]:
    """Per group, the table entries at the handoff indices (P: what it sends; D: where they land)."""
    return [list(table[r.start : r.stop]) for table, r in zip(tables, ranges)]


def handoff_sides(slices: Sequence[Sequence[int]], ranges: Sequence[range], block_size: int,
                  plan: Optional[KVGroupPlan] = None) -> list[HandoffSide]:
    """Per group, a handoff slice with where it starts, as the pull planner pairs them (`plan` marks
    the state groups' sides: whole pages, not tokens)."""
    state = set(plan.state_group_ids) if plan is not None else set()
    return [HandoffSide(block_size, r.start, list(ids), is_state=group_id in state)
            for group_id, (ids, r) in enumerate(zip(slices, ranges))]


def peer_plan(plan: KVGroupPlan, wire_groups: Sequence[Any], num_ranks: int = 1,
              their_num_ranks: int = 1) -> KVGroupPlan:
    """The peer's group plan as this worker sees it: this plan's attention groups (the compatibility
    hash made them equal) and the peer's state groups, cut as its handshake's `groups` say (each a
    `GroupWire`: kind, layer_ids), each state spec one of its `their_num_ranks` ranks' share (this
    plan's are one of `num_ranks`'). InvalidRemoteBlockIds when its state layers are not this plan's
    or its ranks cannot split them."""
    attention = [group for group in plan.groups if not group.is_state]
    state_specs = {layer_id: group.spec for group in plan.groups if group.is_state for layer_id in group.layer_ids}
    theirs = [tuple(int(layer) for layer in group.layer_ids) for group in wire_groups if group.kind == "state"]
    if len(wire_groups) - len(theirs) != len(attention) or sorted(sum(theirs, ())) != sorted(state_specs):
        raise InvalidRemoteBlockIds(f"the peer's groups {[list(ids) for ids in theirs]} do not page this worker's "
                                    f"state layers {sorted(state_specs)}")
    groups = list(attention)
    for layer_ids in theirs:
        specs = {state_specs[layer] for layer in layer_ids}
        if len(specs) != 1:
            raise InvalidRemoteBlockIds(f"the peer's state group {list(layer_ids)} mixes layers of different state")
        try:
            spec = rank_state_spec(specs.pop(), num_ranks, their_num_ranks)
        except ValueError as error:
            raise InvalidRemoteBlockIds(f"the peer's {their_num_ranks} tensor-parallel ranks: {error}") from None
        groups.append(KVGroup(len(groups), spec, layer_ids))
    return dataclasses.replace(plan, groups=tuple(groups), geometry=None)


def state_pages(plan: KVGroupPlan, sides: Sequence[HandoffSide], num_ranks: int = 1) -> list[StatePage]:
    """The handoff pages of `plan`'s state groups (one page each, none for a one-token prompt); the
    plan is one rank's of `num_ranks`."""
    pages = []
    for group, side in zip(plan.groups, sides):
        if isinstance(group.spec, RecurrentStateSpec):
            split = StateSplit.of(group.spec, num_ranks)
            pages += [StatePage(page, group.layer_ids, group.spec.state_bytes, split) for page in side.block_ids]
    return pages


def plan_handoff_pull(own_plan: KVGroupPlan, own_block_size: int, own_tables: Sequence[Sequence[int]],
                      their_plan: KVGroupPlan, their_block_size: int, their_block_ids: Sequence[Sequence[int]],
                      num_tokens: int, num_held_tokens: int, num_ranks: int = 1,
                      their_num_ranks: int = 1) -> PullPlan:
    """What D reads of a prompt P handed over: with equal block sizes and TP sizes whole pages
    (state pages too); otherwise attention in token units (or head ranges) and state slot by slot,
    each D rank cutting its heads' byte ranges from them."""
    ours = handoff_ranges(own_plan, num_tokens, own_block_size)
    local = handoff_sides(handoff_slices(own_tables, ours), ours, own_block_size, own_plan)
    remote = handoff_sides(their_block_ids, handoff_ranges(their_plan, num_tokens, their_block_size),
                           their_block_size, their_plan)
    same_pages = their_block_size == own_block_size and their_num_ranks == num_ranks
    if same_pages or not own_plan.state_group_ids:
        return plan_pull(remote, local, num_tokens, num_held_tokens)
    pull = plan_pull([side for side in remote if not side.is_state], [side for side in local if not side.is_state],
                     num_tokens, num_held_tokens)
    moves = plan_state_moves(state_pages(their_plan, remote, their_num_ranks), state_pages(own_plan, local, num_ranks),
                             num_tokens, num_held_tokens)
    state = own_plan.state_group_ids
    return dataclasses.replace(pull, num_units_per_group=pull.num_units_per_group + (0,) * len(state),
                               uncached_blocks=pull.uncached_blocks + (0,) * len(state), state_moves=moves)


def plan_pull_from(agent: AgentInfo, own_plan: KVGroupPlan, own_block_size: int, own_tables: Sequence[Sequence[int]],
                   their_block_ids: Sequence[Sequence[int]], num_tokens: int, num_held_tokens: int,
                   num_ranks: int = 1) -> PullPlan:
    """`plan_handoff_pull` from the worker `agent` describes (its handshake: block size, TP size, state
    groups), into this worker's tables (`own_plan` one rank's of `num_ranks`): the one READ plan of D's
    pull from P and of a peer pull. Between TP sizes it names block ids only; each rank's transport
    reads its heads' slice of them from the peer ranks holding those heads (transfer/ranked_transport.py)."""
    their_ranks = agent.tp_size
    their_plan = (peer_plan(own_plan, agent.geometry.groups, num_ranks, their_ranks) if own_plan.state_group_ids
                  else own_plan)
    return plan_handoff_pull(own_plan, own_block_size, own_tables, their_plan, agent.geometry.block_size,
                             their_block_ids, num_tokens, num_held_tokens, num_ranks, their_ranks)
