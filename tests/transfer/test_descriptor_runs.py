"""descriptor_runs: direct runs (consecutive on both sides) and staged runs (consecutive on the remote
side once ordered by remote id) cut every pair once, land every chunk where a pair says, and cost
numpy time, not Python time per pair."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.transfer.descriptor_runs import (
    MIN_DESCRIPTORS_SAVED, choose_runs, chunk_descriptors, direct_runs, run_descriptors, staged_runs)
from pdserve.transfer.planner import contiguous_runs
from pdserve.transfer.token_units import UnitGrid, unit_chunk_ids

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_direct_runs_merge_pairs_consecutive_on_both_sides_in_order():
    runs = direct_runs([5, 6, 7, 9, 10], [20, 21, 22, 30, 40])
    assert runs.local_first.tolist() == [5, 9, 10]
    assert runs.remote_first.tolist() == [20, 30, 40]
    assert runs.count.tolist() == [3, 1, 1]
    assert len(runs) == 3


@pytest.mark.parametrize("seed", range(5))
def test_direct_runs_agree_with_the_planners_runs(seed):
    rng = np.random.default_rng(seed)
    local = np.cumsum(rng.integers(0, 3, 200) * (rng.random(200) < 0.5) + 1)  # mostly +1 steps
    remote = rng.permutation(400)[:200] if seed % 2 else np.cumsum(rng.integers(1, 3, 200))
    expected = contiguous_runs(local.tolist(), remote.tolist())
    runs = direct_runs(local, remote)
    assert list(zip(runs.local_first.tolist(), runs.remote_first.tolist(), runs.count.tolist())) == [
        (r.local_first, r.remote_first, r.count) for r in expected]


def test_staged_runs_order_by_remote_id_and_merge_on_the_remote_side_only():
    runs = staged_runs([8, 2, 9, 3, 40], [21, 20, 23, 22, 50])
    assert runs.remote_first.tolist() == [20, 50]
    assert runs.count.tolist() == [4, 1]
    assert runs.staging_first.tolist() == [0, 4]
    assert runs.local_ids_by_remote.tolist() == [2, 8, 3, 9, 40]
    assert runs.num_chunks == 5 and len(runs) == 2


def test_a_remote_id_read_twice_keeps_both_pairs():
    runs = staged_runs([1, 2, 3], [7, 7, 8])
    assert runs.count.sum() == 3
    assert runs.local_ids_by_remote.tolist() == [1, 2, 3]


def land(pool: np.ndarray, local: np.ndarray, staging: np.ndarray, runs) -> None:
    """What a staged read does: the remote runs into staging, then one scatter into the pool."""
    pool[runs.local_ids_by_remote] = staging


@pytest.mark.parametrize("seed", range(4))
def test_staged_and_direct_reads_land_the_same_chunks(seed):
    rng = np.random.default_rng(seed)
    remote_pool = rng.integers(0, 1 << 30, size=(500, 3))
    n = 120
    local = rng.permutation(300)[:n]
    remote = np.sort(rng.permutation(500)[:n]) if seed % 2 else rng.permutation(500)[:n]
    expected = np.zeros((300, 3), dtype=remote_pool.dtype)
    direct = direct_runs(local, remote)
    for lf, rf, c in zip(direct.local_first, direct.remote_first, direct.count):
        expected[lf:lf + c] = remote_pool[rf:rf + c]
    staged = staged_runs(local, remote)
    staging = np.zeros((staged.num_chunks, 3), dtype=remote_pool.dtype)
    for rf, sf, c in zip(staged.remote_first, staged.staging_first, staged.count):
        staging[sf:sf + c] = remote_pool[rf:rf + c]
    got = np.zeros_like(expected)
    land(got, local, staging, staged)
    assert (got == expected).all()
    assert direct.count.sum() == staged.count.sum() == n


def test_a_block_size_mismatch_read_is_one_staged_descriptor_per_remote_page():
    """16 -> 32 tokens: each P page (1 unit per row) lands in half of every row of a D page."""
    rows = 180
    remote_blocks, local_blocks = [7, 3, 12, 5], [4, 9]
    units_remote = remote_blocks  # one unit per P row
    units_local = [b * 2 + half for b in local_blocks for half in (0, 1)]
    local = unit_chunk_ids(UnitGrid(rows, 2), units_local, 0, rows)
    remote = unit_chunk_ids(UnitGrid(rows, 1), units_remote, 0, rows)
    assert len(direct_runs(local, remote)) == 4 * rows
    staged = staged_runs(local, remote)
    assert len(staged) == 4  # 3, 5, 7, 12: none adjacent
    assert staged.count.tolist() == [rows] * 4


def test_empty_and_mismatched_reads():
    assert len(direct_runs([], [])) == 0 and len(staged_runs([], [])) == 0
    for cut in (direct_runs, staged_runs):
        with pytest.raises(ValueError):
            cut([1, 2], [3])


def test_descriptor_arrays_address_runs_of_chunks():
    descs = run_descriptors(1000, np.array([0, 5]), np.array([2, 1]), 64, 3)
    assert descs.dtype == np.uint64
    assert descs.tolist() == [[1000, 128, 3], [1000 + 5 * 64, 64, 3]]
    assert chunk_descriptors(4096, 3, 512, 0).tolist() == [[4096, 512, 0], [4608, 512, 0], [5120, 512, 0]]


def test_auto_stages_reads_whose_small_descriptors_staging_cuts_by_the_factor():
    local = np.arange(64)[::-1].copy()  # reversed: nothing merges directly
    remote = np.arange(64)  # one staged run
    direct, staged = choose_runs(local, remote, 4096, "auto", staged_factor=8, staged_max_descriptor_bytes=4096)
    assert len(direct) == 64 and staged is not None and len(staged) == 1
    assert choose_runs(local, remote, 4096, "auto", 65, 4096)[1] is None  # 64 direct for 1 staged: not 65x
    assert choose_runs(local, remote, 4097, "auto", 8, 4096)[1] is None  # descriptors too large to pay
    assert choose_runs(local, remote, 64, "direct", 1, 1 << 20)[1] is None
    whole_pages = np.arange(4)
    assert choose_runs(whole_pages, whole_pages, 1 << 20, "staged", 100, 0)[1] is not None
    assert choose_runs(whole_pages, whole_pages, 64, "auto", 1, 4096)[1] is None  # 1 direct run: nothing saved
    with pytest.raises(ValueError):
        choose_runs(local, remote, 64, "fast", 8, 4096)


def test_auto_leaves_reads_direct_when_staging_saves_few_descriptors():
    """Staging's own fixed work outweighs fewer than MIN_DESCRIPTORS_SAVED descriptors."""
    saved = MIN_DESCRIPTORS_SAVED
    for n, staged in ((saved, False), (saved + 1, True)):
        local, remote = np.arange(n)[::-1].copy(), np.arange(n)  # n direct descriptors, 1 staged
        assert (choose_runs(local, remote, 4096, "auto", 2, 8192)[1] is not None) is staged, n
        assert choose_runs(local, remote, 4096, "staged", 2, 8192)[1] is not None


def test_the_size_limit_is_on_the_average_direct_descriptor():
    """Runs of 2 chunks of 4 KiB average 8 KiB: within an 8 KiB limit, not within one byte less."""
    pairs = np.arange(128)
    local = pairs // 2 * 10 + pairs % 2  # 0 1, 10 11, 20 21, ...: runs of two
    assert len(direct_runs(local, pairs)) == 64
    assert choose_runs(local, pairs, 4096, "auto", 2, 8192)[1] is not None
    assert choose_runs(local, pairs, 4096, "auto", 2, 8191)[1] is None


def test_runs_cost_numpy_time_not_python_time_per_pair():
    """Llama-3-8B, 8192 tokens, 32 -> 16 tokens: 262,144 pairs (a Python loop takes ~100 ms+)."""
    rows, num_local = 512, 512
    rng = np.random.default_rng(0)
    remote_blocks = rng.permutation(2000)[:num_local // 2] + 1
    local = unit_chunk_ids(UnitGrid(rows, 1), rng.permutation(2000)[:num_local] + 1, 0, rows)
    remote = unit_chunk_ids(UnitGrid(rows, 2), [remote_blocks[k // 2] * 2 + k % 2 for k in range(num_local)], 0, rows)
    best_s = float("inf")
    for _ in range(3):
        started_s = time.perf_counter()
        choose_runs(local, remote, 4096, "staged", staged_factor=2, staged_max_descriptor_bytes=8192)
        best_s = min(best_s, time.perf_counter() - started_s)
    assert best_s < 0.05, f"{len(local)} pairs took {best_s * 1e3:.1f} ms"


def test_the_module_imports_neither_torch_nor_nixl():
    code = ("import sys, pdserve.transfer.descriptor_runs, pdserve.transfer.staging;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
