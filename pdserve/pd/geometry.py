"""Which blocks of a prompt travel from P to D: the one alignment rule both sides use.

Invariant: for every group, P hands over exactly the blocks at indices
`handoff_range(...)` of its table, in order, and D writes them into the same
indices of its own table. The range ends at the prompt's last block and starts
at the first block the last prompt token still reads (sliding-window groups
drop what slid out; full groups start at 0). A recurrent-state group hands over one page,
whatever the prompt's length: P's handoff page (the state after all but the last prompt token,
kv/state_pages.py), written into D's live page; none for a one-token prompt (D computes it from
zeros). Torch-free.

    prompt of 30 tokens, block_size 4 (8 blocks), window 8; the last prompt
    token (position 29) reads keys 22..29, i.e. blocks 5..7:
      block index          0   1   2   3   4   5   6   7
      full group         [ x   x   x   x   x   x   x   x ]  handoff_range = range(0, 8)
      sliding group      [ .   .   .   .   .   x   x   x ]  handoff_range = range(5, 8)
      state group        [ h ]                                  handoff_range = range(0, 1)
"""

from __future__ import annotations

from typing import Optional, Sequence

from pdserve.kv.prefix import first_live_block
from pdserve.kv.specs import KVGroup, KVGroupPlan
from pdserve.transfer.planner import HandoffSide


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
