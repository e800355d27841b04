"""The block-size KV-transfer benchmark's pure parts: pairs, cases, the unit pairs of a prompt (token
for token), ratios and tables; plus one tiny end-to-end run over NIXL (slow)."""

from __future__ import annotations

import json
import multiprocessing

import numpy as np
import pytest

from bench.transfer.block_size import (
    BS_SHAPES, Case, add_ratios, cases, chunk_pairs, format_table, parse_pair, pool_blocks, rows_of, token_bytes)
from bench.transfer.kv_pull import main
from pdserve.transfer.token_units import unit_geometry


def test_pairs_parse_and_sizes_that_do_not_divide_are_refused():
    assert parse_pair("16:32") == (16, 32)
    assert parse_pair("32->16") == (32, 16)
    for bad in ("16", "16:24", "0:16", "a:b", "1:2:3"):
        with pytest.raises(ValueError):
            parse_pair(bad)


def test_cases_put_the_page_pull_first_and_time_mismatches_both_ways():
    assert cases([(32, 16), (16, 32), (32, 16)]) == [
        Case(16, 16, "pages"), Case(32, 16, "direct"), Case(32, 16, "staged"), Case(16, 32, "direct"),
        Case(16, 32, "staged")]
    assert Case(16, 32, "direct").label == "16->32"


def test_pools_hold_the_largest_prompt_and_room_to_scatter():
    assert pool_blocks(8192, 16) == 512 + 256 + 1
    assert pool_blocks(8192, 32) == 256 + 128 + 1


def test_bytes_per_token_are_one_head_vector_per_row():
    shape = BS_SHAPES["smollm2"]
    assert rows_of(shape) == 180
    assert token_bytes(shape) * 16 == shape.layout().page_bytes  # block 16


@pytest.mark.parametrize("prefill_block,decode_block", [(16, 32), (32, 16), (16, 16), (16, 64)])
def test_chunk_pairs_move_each_token_of_each_row_to_its_place(prefill_block, decode_block):
    """Simulated on arrays: every (row, token) lands where both block tables put it."""
    rows, num_tokens, head = 3, 128, 2  # head: elements of one token in one row
    prefill_ids, decode_ids = [5, 1, 7, 3, 0, 2, 6, 4][:num_tokens // prefill_block], \
        [2, 0, 3, 1, 5, 4, 7, 6][:num_tokens // decode_block]
    prefill = np.arange(8 * rows * prefill_block * head).reshape(8, rows, prefill_block, head)
    decode = np.full((8, rows, decode_block, head), -1)
    geometry = unit_geometry(decode[0].size, rows, prefill[0].size, rows)
    local, remote = chunk_pairs(geometry, prefill_ids, decode_ids, prefill_block, decode_block, num_tokens, rows)
    unit = geometry.unit_bytes
    decode.reshape(-1, unit)[local] = prefill.reshape(-1, unit)[remote]
    for t in range(num_tokens):
        expected = prefill[prefill_ids[t // prefill_block], :, t % prefill_block]
        assert (decode[decode_ids[t // decode_block], :, t % decode_block] == expected).all(), t


def _row(memory, tokens, p, d, read, gbps, descriptors=1):
    return {"memory": memory, "prompt_tokens": tokens, "prefill_block": p, "decode_block": d, "read": read,
            "pull_gbps": gbps, "pull_s": 1.0 / gbps, "num_bytes": 1e9, "descriptors": descriptors,
            "memcpy_gbps": 10.0, "auto_picks": read if read == "pages" else "staged", "foreign_cpu_fraction": 0.1}


def test_ratios_are_against_the_page_pull_of_the_same_memory_and_prompt():
    rows = add_ratios([_row("huge-pages", 2048, 16, 16, "pages", 8.0), _row("huge-pages", 2048, 16, 32, "direct", 2.0),
                       _row("huge-pages", 2048, 16, 32, "staged", 6.0), _row("4k-pages", 2048, 32, 16, "staged", 3.0)])
    assert [r["vs_pages"] for r in rows] == [1.0, 0.25, 0.75, None]
    assert rows[2]["vs_memcpy"] == pytest.approx(0.6)
    lines = format_table(rows).splitlines()
    assert len(lines) == 6 and lines[1].startswith("|---")
    assert lines[4] == ("| huge-pages | 2048 | 16->32 | staged | 1 | 1000.0 | 166.7 | 6.00 | 0.75 | 0.60 | 10.00 "
                        "| staged | 10% |")
    assert lines[5].endswith("| 3.00 | - | 0.30 | 10.00 | staged | 10% |")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_run_pulls_verifies_and_reports_every_case(tmp_path):
    pytest.importorskip("nixl")
    out = tmp_path / "block_size.json"
    assert main(["--mode", "block-size", "--shape", "tiny", "--prompt-tokens", "128", "--reps", "1", "--memory", "huge-pages",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    pulls = report["pulls"]
    assert [(r["prefill_block"], r["decode_block"], r["read"]) for r in pulls] == [
        (16, 16, "pages"), (16, 32, "direct"), (16, 32, "staged"), (32, 16, "direct"), (32, 16, "staged")]
    rows = rows_of(BS_SHAPES["tiny"])
    page_pull = pulls[0]
    for r in pulls:
        assert r["pages_checked"] > 0  # check_landed raised inside the bench had a token landed wrong
        assert r["num_bytes"] == 128 * token_bytes(BS_SHAPES["tiny"]) and r["pull_gbps"] > 0
        assert r["vs_pages"] == pytest.approx(r["pull_gbps"] / page_pull["pull_gbps"])
    by_case = {(r["prefill_block"], r["decode_block"], r["read"]): r for r in pulls}
    assert by_case[(16, 32, "direct")]["descriptors"] == by_case[(32, 16, "direct")]["descriptors"] == 8 * rows
    assert by_case[(16, 32, "staged")]["descriptors"] <= 8 and by_case[(32, 16, "staged")]["descriptors"] <= 4
    assert by_case[(16, 32, "staged")]["staging_bytes"] > 0 and by_case[(16, 32, "direct")]["staging_bytes"] == 0
    assert not multiprocessing.active_children()
