"""The one rule for which blocks of a prompt travel from P to D."""

from __future__ import annotations

import pytest

from pdserve.kv.specs import FullAttentionSpec, KVGroup, SlidingWindowSpec
from pdserve.pd.geometry import handoff_range, handoff_sides, handoff_slices
from pdserve.transfer.planner import HandoffSide

FULL = KVGroup(0, FullAttentionSpec(), (0,))
SLIDING_8 = KVGroup(1, SlidingWindowSpec(8), (1,))


def test_full_attention_hands_over_every_prompt_block():
    assert handoff_range(FULL, 30, 4) == range(0, 8)
    assert handoff_range(FULL, 32, 4) == range(0, 8)
    assert handoff_range(FULL, 33, 4) == range(0, 9)


@pytest.mark.parametrize("num_prompt, expected", [(30, range(5, 8)), (8, range(0, 2)), (9, range(0, 3)), (3, range(0, 1))])
def test_sliding_window_hands_over_the_blocks_the_last_token_reads(num_prompt, expected):
    # The last prompt token at position n-1 reads keys n-8 .. n-1.
    assert handoff_range(SLIDING_8, num_prompt, 4) == expected
    assert len(expected) <= SlidingWindowSpec(8).max_blocks_held(num_prompt, 4)


def test_slices_and_sides_follow_the_ranges():
    ranges = [range(0, 8), range(5, 8)]
    tables = [list(range(100, 108)), [0, 0, 0, 0, 0, 205, 206, 207]]
    slices = handoff_slices(tables, ranges)
    assert slices == [list(range(100, 108)), [205, 206, 207]]
    sides = handoff_sides(slices, ranges, 4)
    assert sides == [HandoffSide(4, 0, list(range(100, 108))), HandoffSide(4, 5, [205, 206, 207])]
    assert (sides[1].first_token, sides[1].end_token) == (20, 32)


def test_the_window_starts_on_each_block_size_own_boundary():
    """Window 8 at position 29 reads keys 22..29: blocks of 4 from token 20, blocks of 16 from token 16."""
    assert handoff_range(SLIDING_8, 30, 4).start * 4 == 20
    assert handoff_range(SLIDING_8, 30, 16).start * 16 == 16
