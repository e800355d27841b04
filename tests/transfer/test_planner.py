"""plan_pull pairs block tables into descriptor index lists; validate_remote_block_ids guards wire data."""

from __future__ import annotations

import pytest

from pdserve.api.errors import InvalidRequest
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.transfer.planner import (
    HandoffSide, InvalidRemoteBlockIds, PullPlan, Run, StateMove, StatePage, contiguous_runs, plan_pull,
    plan_state_moves, validate_remote_block_ids)
from pdserve.transfer.state_ranges import StateSlotMove, StateSplit, rank_state_moves


def sides(tables, block_size=4, first_blocks=None):
    firsts = first_blocks or [0] * len(tables)
    return [HandoffSide(block_size, first, ids) for ids, first in zip(tables, firsts)]


def test_plan_pairs_positions_and_flattens_groups_in_order():
    plan = plan_pull(sides([[7, 3, 9], [4, 11]]), sides([[1, 2, 5], [6, 8]]), num_tokens=12)
    assert plan == PullPlan(local_ids=(1, 2, 5, 6, 8), remote_ids=(7, 3, 9, 4, 11), unit_tokens=4,
                            num_units_per_group=(3, 2), uncached_blocks=(0, 0))
    assert plan.num_units == 5


def test_plan_drops_null_entries_on_either_side():
    plan = plan_pull(sides([[0, 0, 4, 11, 20]]), sides([[0, 3, 6, 0, 9]]), num_tokens=20)
    assert plan.local_ids == (6, 9)
    assert plan.remote_ids == (4, 20)
    assert plan.num_units_per_group == (2,)


def test_plan_skips_the_tokens_decode_already_holds():
    # D holds 12 tokens (3 blocks of 4): only the 4th block of the full group and the window's blocks past it.
    plan = plan_pull(sides([[7, 3, 9, 12], [4, 11]], first_blocks=[0, 2]),
                     sides([[1, 2, 5, 10], [6, 8]], first_blocks=[0, 2]), num_tokens=16, num_held_tokens=12)
    assert plan.local_ids == (10, 8)
    assert plan.remote_ids == (12, 11)
    assert plan.num_units_per_group == (1, 1)


def test_plan_of_a_full_prefix_hit_is_empty_but_keeps_group_counts():
    plan = plan_pull(sides([[7, 3], [5, 6]]), sides([[1, 2], [3, 4]]), num_tokens=8, num_held_tokens=8)
    assert plan.num_units == 0
    assert plan.num_units_per_group == (0, 0)


def test_plan_moves_only_what_both_tables_cover():
    plan = plan_pull(sides([[7, 3]]), sides([[1, 2, 5]]), num_tokens=12)
    assert (plan.local_ids, plan.remote_ids) == ((1, 2), (7, 3))
    plan = plan_pull(sides([[7, 3, 9]]), sides([[1, 2]]), num_tokens=12)
    assert (plan.local_ids, plan.remote_ids) == ((1, 2), (7, 3))


def test_plan_stops_at_the_prompt_end():
    plan = plan_pull(sides([[7, 3, 9]]), sides([[1, 2, 5]]), num_tokens=5)  # tokens 0..4: blocks 0 and 1
    assert (plan.local_ids, plan.remote_ids) == ((1, 2), (7, 3))


def test_plan_rejects_a_group_count_mismatch():
    with pytest.raises(InvalidRemoteBlockIds, match="1 groups, this worker has 2"):
        plan_pull(sides([[7]]), sides([[1], [2]]), num_tokens=4)


def test_plan_rejects_block_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="do not pair"):
        plan_pull(sides([[7]], block_size=16), sides([[1]], block_size=24), num_tokens=4)


def test_plan_cuts_larger_decode_blocks_into_units_of_the_prefill_block():
    """P blocks of 16, D blocks of 32: each D block takes two P blocks, slot 0 then slot 1 (the module diagram)."""
    plan = plan_pull(sides([[11, 12, 20, 21, 30]], block_size=16), sides([[5, 9, 4]], block_size=32),
                     num_tokens=70)
    assert plan.unit_tokens == 16
    assert plan.local_ids == (10, 11, 18, 19, 8)
    assert plan.remote_ids == (11, 12, 20, 21, 30)
    assert plan.uncached_blocks == (0,)


def test_plan_cuts_larger_prefill_blocks_into_units_of_the_decode_block():
    plan = plan_pull(sides([[5, 9, 4]], block_size=32), sides([[11, 12, 20, 21, 30]], block_size=16),
                     num_tokens=70, num_held_tokens=32)
    assert plan.local_ids == (20, 21, 30)
    assert plan.remote_ids == (18, 19, 8)  # block 9 slots 0 and 1, then block 4 slot 0


def test_plan_marks_a_decode_block_that_starts_before_the_prefill_window_as_uncached():
    """Sliding window: P (blocks of 16) hands over from token 48 (block 3); D (blocks of 32) needs from
    token 32 (block 1): tokens 32..47 of D's block 1 get nothing, so that block stays out of its cache."""
    plan = plan_pull(sides([[40, 41]], block_size=16, first_blocks=[3]),
                     sides([[7, 8]], block_size=32, first_blocks=[1]), num_tokens=80)
    assert plan.local_ids == (15, 16)  # block 7 slot 1 (tokens 48..63), block 8 slot 0 (64..79)
    assert plan.remote_ids == (40, 41)
    assert plan.uncached_blocks == (2,)


def test_plan_of_manager_live_tables_moves_only_the_sliding_window():
    """P's live tables (sliding group clipped) against D's fresh tables for the same prompt."""
    plan = plan_groups([SlidingWindowSpec(8), FullAttentionSpec()])
    prefill = KVCacheManager(plan, num_blocks=64, block_size=4)
    decode = KVCacheManager(plan, num_blocks=64, block_size=4)
    num_prompt_tokens = 30  # 8 blocks; the last token is recomputed on D, at position 29
    assert prefill.allocate_slots("p", 0, num_prompt_tokens)
    assert decode.allocate_slots("d", num_prompt_tokens - 1, 1)
    remote = prefill.live_block_ids("p", num_prompt_tokens - 1)
    local = decode.block_ids("d")
    pull = plan_pull(sides(remote), sides(local), num_prompt_tokens)
    # full group (0): all 8 blocks; sliding group (1): window 8 tokens at position 29 reads 22..29 -> blocks 5..7
    assert pull.num_units_per_group == (8, 3)
    assert pull.remote_ids[:8] == tuple(remote[0])
    assert pull.remote_ids[8:] == tuple(remote[1][5:])
    assert pull.local_ids[8:] == tuple(local[1][5:])


# ---- validate_remote_block_ids ------------------------------------------------------------


def validate(ids, num_groups=2, num_remote_blocks=100, max_blocks_per_group=8):
    return validate_remote_block_ids(ids, num_groups, num_remote_blocks, max_blocks_per_group)


def test_validate_accepts_ids_with_null_entries_and_returns_lists():
    assert validate(([0, 0, 5, 6], (7, 99))) == [[0, 0, 5, 6], [7, 99]]


@pytest.mark.parametrize(
    "ids, message",
    [
        ("1,2", "expected a list of 2 lists"),
        ([[1, 2]], "expected 2 groups, got 1"),
        ([[1], 5], "group 1 must be a list"),
        ([[1], ["5"]], "group 1 holds '5', not an integer"),
        ([[1], [2.0]], "not an integer"),
        ([[True], [2]], "not an integer"),
        ([[1], [-3]], "block -3, outside the peer's pool of 100 blocks"),
        ([[1], [100]], "block 100, outside"),
        ([[1, 1], [2]], "block 1 appears twice \\(groups 0 and 0\\)"),
        ([[1, 4], [4]], "block 4 appears twice \\(groups 0 and 1\\)"),
        ([list(range(1, 10)), [11]], "group 0 has 9 blocks, at most 8 allowed"),
    ],
)
def test_validate_rejects_malformed_ids_with_a_clear_message(ids, message):
    with pytest.raises(InvalidRemoteBlockIds, match=message) as info:
        validate(ids)
    assert isinstance(info.value, InvalidRequest)
    assert info.value.status_code == 400
    assert info.value.param == "kv_transfer_params.remote_block_ids"


def test_runs_merge_pairs_consecutive_on_both_sides_only():
    assert contiguous_runs([5, 6, 7, 9, 10], [20, 21, 22, 30, 40]) == [Run(5, 20, 3), Run(9, 30, 1), Run(10, 40, 1)]
    assert contiguous_runs([1, 2], [7, 6]) == [Run(1, 7, 1), Run(2, 6, 1)]  # adjacent locally, reversed remotely
    assert contiguous_runs([], []) == []
    pairs = list(zip(range(3, 11), range(100, 108)))
    assert contiguous_runs([p[0] for p in pairs], [p[1] for p in pairs]) == [Run(3, 100, 8)]


def test_a_state_group_moves_its_one_page_whole_whatever_the_prompt_length():
    remote = [HandoffSide(4, 0, [7, 3, 9]), HandoffSide(4, 0, [40], is_state=True)]
    local = [HandoffSide(4, 0, [1, 2, 5]), HandoffSide(4, 0, [12], is_state=True)]
    plan = plan_pull(remote, local, num_tokens=12, num_held_tokens=8)
    assert plan.local_ids == (5, 12) and plan.remote_ids == (9, 40)
    assert plan.num_units_per_group == (1, 1) and plan.uncached_blocks == (0, 0)


def test_no_state_page_moves_when_decode_holds_the_state_before_the_last_token():
    remote = [HandoffSide(4, 0, [7, 3, 9]), HandoffSide(4, 0, [40], is_state=True)]
    local = [HandoffSide(4, 0, [1, 2, 5]), HandoffSide(4, 0, [12], is_state=True)]
    plan = plan_pull(remote, local, num_tokens=9, num_held_tokens=8)
    assert plan.local_ids == (5,) and plan.num_units_per_group == (1, 0)


def test_state_pages_refuse_other_block_sizes_and_other_group_kinds():
    with pytest.raises(ValueError, match="equal block sizes only"):
        plan_pull([HandoffSide(4, 0, [7, 3]), HandoffSide(4, 0, [40], is_state=True)],
                  [HandoffSide(8, 0, [1]), HandoffSide(8, 0, [12], is_state=True)], num_tokens=8)
    with pytest.raises(InvalidRemoteBlockIds, match="attention group on the other"):
        plan_pull([HandoffSide(4, 0, [40], is_state=True)], [HandoffSide(4, 0, [12])], num_tokens=8)
    with pytest.raises(InvalidRemoteBlockIds, match="at most one page"):
        plan_pull([HandoffSide(4, 0, [40, 41], is_state=True)], [HandoffSide(4, 0, [12, 13], is_state=True)],
                  num_tokens=8)


ONE = StateSplit(part_rows=(1,), row_bytes=(100,))  # a state layer of 100 bytes, one part


def page(page_id: int, layer_ids: tuple, split: StateSplit = ONE, num_ranks: int = 1) -> StatePage:
    return StatePage(page_id, layer_ids, split.rank_bytes(num_ranks), split)


def test_state_moves_each_layer_into_its_own_slot():
    # P pages one layer a page, D two: layers 0 and 2 share D's page 8, layer 1 has page 9.
    remote = [page(37, (0,)), page(38, (1,)), page(39, (2,))]
    local = [page(8, (0, 2)), page(9, (1,))]
    assert plan_state_moves(remote, local, num_tokens=10) == (
        StateSlotMove(8, 0, 37, 0, ONE), StateSlotMove(8, 100, 39, 0, ONE), StateSlotMove(9, 0, 38, 0, ONE))
    assert plan_state_moves(local, remote, num_tokens=10)[0] == StateSlotMove(37, 0, 8, 0, ONE)
    # Between one-rank workers the slots adjacent on both sides become one range, a page's data only.
    assert rank_state_moves(plan_state_moves(local, local, num_tokens=10), 0, 1, 1) == {
        0: [StateMove(8, 0, 8, 0, 200), StateMove(9, 0, 9, 0, 100)]}


def test_state_moves_none_when_d_holds_the_state_or_the_prompt_has_one_token():
    pages = [page(8, (0,))]
    assert plan_state_moves(pages, pages, num_tokens=10, num_held_tokens=9) == ()
    assert plan_state_moves([], [], num_tokens=1) == ()


@pytest.mark.parametrize("remote, message", [
    ([page(37, (0,))], "state layers \\[0\\] there, \\[0, 1\\] here"),
    ([page(37, (0, 1), StateSplit((1,), (64,)))], "layer 0 keeps its state as .*64.* there"),
    ([page(37, (0,)), page(38, (0, 1))], "state layer 0 appears twice on the remote side"),
    ([page(0, (0, 1))], "the null page"),
])
def test_state_moves_refuse_pages_that_do_not_hold_the_same_layers(remote, message):
    with pytest.raises(InvalidRemoteBlockIds, match=message):
        plan_state_moves(remote, [page(8, (0, 1))], num_tokens=10)
