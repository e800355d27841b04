"""The TP KV-transfer benchmark's pure parts: cases, descriptor expectations (checked against the
planner's run merging over the rank readers' chunk ids), block ids, rank carving, ratios and the
table; plus one tiny end-to-end run over NIXL (slow)."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from bench.transfer.kv_pull import main
from bench.transfer.tp import (
    TP_SHAPES, add_ratios, block_ids, cases, coalescing_gains, expected_descriptors, format_table,
    parse_pair, rank_layouts, rank_views, sample_blocks, sources_per_rank, split_problem,
)
from pdserve.kv.head_split import chunk_heads, head_sources, rank_kv_heads
from pdserve.transfer.planner import contiguous_runs


def _runs_summed_over_ranks(num_kv_heads: int, prefill_tp: int, decode_tp: int, local_ids: list[int],
                            remote_ids: list[int]) -> int:
    """What the rank readers ask NIXL for: per decode rank and source rank, chunk ids in units of
    `chunk_heads` heads, merged into runs by the planner."""
    heads = chunk_heads(num_kv_heads, decode_tp, prefill_tp)
    total = 0
    for rank in range(decode_tp):
        local_chunks = rank_kv_heads(num_kv_heads, decode_tp, rank)[1] // heads
        remote_chunks = rank_kv_heads(num_kv_heads, prefill_tp, 0)[1] // heads
        for source in head_sources(num_kv_heads, decode_tp, rank, prefill_tp):
            local = [b * local_chunks + source.local_offset // heads for b in local_ids]
            remote = [b * remote_chunks + source.remote_offset // heads for b in remote_ids]
            total += len(contiguous_runs(local, remote))
    return total


# --- cases ------------------------------------------------------------------------------------------

def test_cases_put_the_reference_first_and_cover_both_allocations():
    got = cases([(2, 1), (1, 2), (2, 1)])
    assert [(c.prefill_tp, c.decode_tp, c.allocation) for c in got] == [
        (1, 1, "contiguous"), (1, 1, "scattered"), (2, 1, "contiguous"), (2, 1, "scattered"),
        (1, 2, "contiguous"), (1, 2, "scattered")]
    assert got[2].label == "2->1"
    with pytest.raises(ValueError):
        cases([(1, 2)], ["packed"])


def test_pairs_parse_and_bad_ones_are_refused():
    assert parse_pair("2:4") == (2, 4)
    assert parse_pair("4->1") == (4, 1)
    for bad in ("2", "0:1", "1:2:3", "a:b"):
        with pytest.raises(ValueError):
            parse_pair(bad)


def test_split_problem_wants_every_rank_to_own_a_share_of_the_heads():
    assert split_problem(8, [(1, 2), (4, 1), (2, 2)]) is None
    assert "3 ranks" in split_problem(8, [(1, 3)])
    assert "replicated" in split_problem(2, [(1, 4)])  # 4 ranks over 2 heads: legal, but not what this bench times


# --- descriptors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2),
                                                  (4, 4), (8, 1)])
@pytest.mark.parametrize("allocation", ["contiguous", "scattered"])
def test_expected_descriptors_match_what_the_rank_readers_merge(prefill_tp, decode_tp, allocation):
    local, remote = block_ids(37, 200, allocation, seed=7)
    expected = expected_descriptors(prefill_tp, decode_tp, 37, allocation)
    assert expected == _runs_summed_over_ranks(8, prefill_tp, decode_tp, local, remote)


def test_descriptor_counts_before_and_after_coalescing():
    assert sources_per_rank(4, 1) == 4 and sources_per_rank(1, 4) == 1 and sources_per_rank(2, 2) == 1
    # equal TP, contiguous: one descriptor per decode rank; scattered: one per (block, rank)
    assert expected_descriptors(1, 1, 512, "contiguous") == 1
    assert expected_descriptors(2, 2, 512, "contiguous") == 2
    assert expected_descriptors(2, 2, 512, "scattered") == 1024
    # a split never merges: max(P, D) descriptors per block either way
    for allocation in ("contiguous", "scattered"):
        assert expected_descriptors(1, 2, 512, allocation) == 1024
        assert expected_descriptors(2, 1, 512, allocation) == 1024
        assert expected_descriptors(4, 1, 128, allocation) == 512
        assert expected_descriptors(1, 4, 128, allocation) == 512
    assert expected_descriptors(2, 1, 0, "scattered") == 0


# --- block ids and rank pools ----------------------------------------------------------------------

def test_block_ids_skip_the_null_block_and_scattered_ones_never_follow_on_both_sides():
    local, remote = block_ids(50, 120, "contiguous", seed=1)
    assert local == remote == list(range(1, 51))
    local, remote = block_ids(100, 120, "scattered", seed=1)  # dense: merges would be likely if not redrawn
    assert len(set(local)) == len(set(remote)) == 100 and 0 not in local + remote
    assert max(local + remote) < 120
    assert len(contiguous_runs(local, remote)) == 100
    assert block_ids(100, 120, "scattered", seed=1) == (local, remote)  # deterministic
    with pytest.raises(ValueError):
        block_ids(120, 120, "contiguous", seed=1)
    with pytest.raises(ValueError):
        block_ids(3, 120, "packed", seed=1)


def test_rank_pools_tile_the_buffer_and_hold_their_heads():
    shape = TP_SHAPES["tiny"]
    full = shape.layout()
    for tp in (1, 2, 4):
        layouts = rank_layouts(shape, tp)
        assert [offset for offset, _ in layouts] == [r * full.pool_bytes // tp for r in range(tp)]
        assert sum(layout.pool_bytes for _, layout in layouts) == full.pool_bytes
        assert all(layout.num_kv_heads == shape.num_kv_heads // tp and layout.slab_bytes == full.slab_bytes
                   for _, layout in layouts)
    buffer = torch.zeros(full.pool_bytes, dtype=torch.int8)
    views = rank_views(buffer, shape, 2)
    assert [offset for _, offset in views] == [0, full.pool_bytes // 2]
    assert views[1][0].shape == (shape.num_pool_blocks, full.page_bytes // 2)
    assert views[1][0].data_ptr() == buffer.data_ptr() + full.pool_bytes // 2


def test_sample_blocks_take_both_ends_and_the_middle_once():
    ids = list(range(1, 21))
    samples = sample_blocks(ids, [i + 100 for i in ids])
    assert samples == [(1, 101), (2, 102), (3, 103), (4, 104), (11, 111), (17, 117), (18, 118), (19, 119),
                       (20, 120)]
    assert sample_blocks([5], [9]) == [(5, 9)]


# --- ratios and the table --------------------------------------------------------------------------

def _row(memory, tokens, p, d, allocation, gbps, memcpy_gbps=10.0, descriptors=1):
    return {"memory": memory, "prompt_tokens": tokens, "prefill_tp": p, "decode_tp": d, "allocation": allocation,
            "pull_gbps": gbps, "pull_s": 1.0 / gbps, "num_bytes": 1e9, "descriptors": descriptors,
            "memcpy_gbps": memcpy_gbps, "foreign_cpu_fraction": 0.05}


def test_ratios_are_against_the_same_memory_prompt_and_allocation():
    rows = add_ratios([
        _row("4k-pages", 2048, 1, 1, "contiguous", 4.0), _row("4k-pages", 2048, 1, 1, "scattered", 2.0),
        _row("4k-pages", 2048, 2, 1, "contiguous", 1.0), _row("4k-pages", 2048, 2, 1, "scattered", 1.0),
        _row("huge-pages", 2048, 1, 1, "scattered", 8.0), _row("huge-pages", 2048, 1, 2, "scattered", 6.0),
        _row("huge-pages", 8192, 1, 2, "scattered", 6.0),  # no reference measured
    ])
    assert [r["vs_1to1"] for r in rows] == [1.0, 1.0, 0.25, 0.5, 1.0, 0.75, None]
    assert rows[0]["vs_memcpy"] == pytest.approx(0.4)
    assert coalescing_gains(rows) == {("4k-pages", 2048, "1->1"): 2.0, ("4k-pages", 2048, "2->1"): 1.0}


def test_table_has_one_line_per_row_with_the_ratios():
    rows = add_ratios([_row("huge-pages", 8192, 1, 1, "contiguous", 5.0, descriptors=1),
                       _row("huge-pages", 8192, 1, 4, "scattered", 2.5, descriptors=2048)])
    rows[1]["foreign_cpu_fraction"] = None
    lines = format_table(rows).splitlines()
    assert len(lines) == 4 and lines[1].startswith("|---")
    assert lines[2] == ("| huge-pages | 8192 | 1->1 | contiguous | 1 | 1000.0 | 200.0 | 5.00 | 1.00 | 0.50 "
                        "| 10.00 | 5% |")
    # no scattered 1->1 measured: no ratio against it (a contiguous one is not the same reference)
    assert "| 1->4 | scattered | 2048 |" in lines[3] and lines[3].endswith("| 2.50 | - | 0.25 | 10.00 | ? |")


# --- end to end over NIXL --------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_run_pulls_and_verifies_every_pair(tmp_path):
    pytest.importorskip("nixl")
    out = tmp_path / "tp.json"
    assert main(["--mode", "tp", "--shape", "tiny", "--prompt-tokens", "64", "--reps", "1", "--memory", "huge-pages",
                 "--pairs", "1:2", "2:1", "2:2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    pulls = report["pulls"]
    assert {(r["prefill_tp"], r["decode_tp"], r["allocation"]) for r in pulls} == {
        (p, d, a) for p, d in ((1, 1), (1, 2), (2, 1), (2, 2)) for a in ("contiguous", "scattered")}
    for r in pulls:
        assert r["descriptors"] == expected_descriptors(r["prefill_tp"], r["decode_tp"], 4, r["allocation"])
        assert r["slabs_checked"] > 0 and r["num_bytes"] == 4 * TP_SHAPES["tiny"].layout().page_bytes
    assert not multiprocessing.active_children()
