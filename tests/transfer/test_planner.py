"""plan_pull pairs block tables into descriptor index lists; validate_remote_block_ids guards wire data."""

from __future__ import annotations

import pytest

from pdserve.api.errors import InvalidRequest
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.transfer.planner import (
    InvalidRemoteBlockIds, PullPlan, Run, contiguous_runs, plan_pull, validate_remote_block_ids)


def test_plan_pairs_positions_and_flattens_groups_in_order():
    plan = plan_pull([[7, 3, 9], [4, 11]], [[1, 2, 5], [6, 8]], None)
    assert plan == PullPlan(local_ids=(1, 2, 5, 6, 8), remote_ids=(7, 3, 9, 4, 11), num_blocks_per_group=(3, 2))
    assert plan.num_blocks == 5


def test_plan_drops_null_entries_on_either_side():
    plan = plan_pull([[0, 0, 4, 11, 20]], [[0, 3, 6, 0, 9]])
    assert plan.local_ids == (6, 9)
    assert plan.remote_ids == (4, 20)
    assert plan.num_blocks_per_group == (2,)


def test_plan_skips_blocks_decode_already_holds_per_group():
    plan = plan_pull([[7, 3, 9, 12], [0, 0, 4, 11]], [[1, 2, 5, 10], [0, 0, 6, 8]], skip_blocks=[3, 1])
    assert plan.local_ids == (10, 6, 8)
    assert plan.remote_ids == (12, 4, 11)
    assert plan.num_blocks_per_group == (1, 2)


def test_plan_of_a_full_prefix_hit_is_empty_but_keeps_group_counts():
    plan = plan_pull([[7, 3], [5, 6]], [[1, 2], [3, 4]], skip_blocks=[2, 2])
    assert plan.num_blocks == 0
    assert plan.num_blocks_per_group == (0, 0)


def test_plan_accepts_a_remote_table_shorter_than_the_local_one():
    plan = plan_pull([[7, 3]], [[1, 2, 5]])
    assert plan.local_ids == (1, 2)
    assert plan.remote_ids == (7, 3)


def test_plan_rejects_a_remote_table_longer_than_the_local_one():
    with pytest.raises(InvalidRemoteBlockIds, match="group 0 has 3 blocks"):
        plan_pull([[7, 3, 9]], [[1, 2]])


def test_plan_rejects_a_group_count_mismatch():
    with pytest.raises(InvalidRemoteBlockIds, match="1 groups, this worker has 2"):
        plan_pull([[7]], [[1], [2]])


@pytest.mark.parametrize("skip_blocks", [[1], [1, -1], [0, 0, 0]])
def test_plan_rejects_skip_blocks_of_the_wrong_shape(skip_blocks):
    with pytest.raises(ValueError, match="skip_blocks"):
        plan_pull([[7], [8]], [[1], [2]], skip_blocks)


def test_plan_of_manager_live_tables_moves_only_the_sliding_window():
    """P's live tables (sliding group clipped) against D's fresh tables for the same prompt."""
    plan = plan_groups([SlidingWindowSpec(8), FullAttentionSpec()])
    prefill = KVCacheManager(plan, num_blocks=64, block_size=4)
    decode = KVCacheManager(plan, num_blocks=64, block_size=4)
    num_prompt_tokens = 30  # 8 blocks; the last token is recomputed on D, at position 29
    assert prefill.allocate("p", 0, num_prompt_tokens)
    assert decode.allocate("d", num_prompt_tokens - 1, 1)
    remote = prefill.live_block_ids("p", num_prompt_tokens - 1)
    local = decode.block_ids("d")
    pull = plan_pull(remote, local)
    # full group (0): all 8 blocks; sliding group (1): window 8 tokens at position 29 reads 22..29 -> blocks 5..7
    assert pull.num_blocks_per_group == (8, 3)
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
