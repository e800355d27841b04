"""The GPU pool sizing rule (pdserve/kv/sizing.py), on the numbers a worker measures."""

from __future__ import annotations

import pytest

from pdserve.kv.sizing import DeviceMemory, InsufficientDeviceMemory, kv_pool_budget

GIB = 1 << 30
TOTAL, CONTEXT, WEIGHTS, WORKSPACE = 80 * GIB, GIB // 2, 16 * GIB, 4 * GIB


def measured(used_by_others: int = 0) -> DeviceMemory:
    free_before = TOTAL - CONTEXT - used_by_others
    return DeviceMemory(TOTAL, free_before, free_before - WEIGHTS, WORKSPACE)


def test_alone_on_the_gpu_the_pool_fills_the_share_less_weights_and_workspace():
    budget = kv_pool_budget(measured(), 0.9)
    assert budget.pool_bytes == int(TOTAL * 0.9) - WEIGHTS - WORKSPACE
    assert not budget.limited_by_free_memory
    assert WEIGHTS + WORKSPACE + budget.pool_bytes <= 0.9 * TOTAL  # the worker's peak fits its share


def test_memory_another_process_holds_shrinks_the_pool_to_what_is_free():
    budget = kv_pool_budget(measured(used_by_others=30 * GIB), 0.9)
    assert budget.limited_by_free_memory
    free_after_load = TOTAL - CONTEXT - 30 * GIB - WEIGHTS
    assert budget.pool_bytes == free_after_load - WORKSPACE - int(TOTAL * 0.01)
    assert free_after_load - WORKSPACE - budget.pool_bytes >= int(0.01 * TOTAL)  # a margin stays free at the peak


def test_two_workers_on_one_gpu_each_hold_their_share():
    first = kv_pool_budget(measured(), 0.45).pool_bytes
    first_peak = WEIGHTS + WORKSPACE + first
    assert first_peak <= 0.45 * TOTAL
    second = kv_pool_budget(measured(used_by_others=first_peak + CONTEXT), 0.45)
    assert second.pool_bytes == first and not second.limited_by_free_memory
    assert 2 * CONTEXT + 2 * first_peak <= TOTAL


def test_no_room_is_a_clear_error_naming_the_knobs():
    memory = DeviceMemory(24 * GIB, int(23.5 * GIB), int(7.5 * GIB), 6 * GIB)  # 16 GiB of weights on 24 GiB
    with pytest.raises(InsufficientDeviceMemory, match="--gpu-memory-utilization 0.8.*--max-num-batched-tokens"):
        kv_pool_budget(memory, 0.8)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match="utilization"):
        kv_pool_budget(measured(), utilization)
