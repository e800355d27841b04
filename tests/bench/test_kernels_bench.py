"""`python -m bench.kernels <mode>`: every mode parses its flags and names its own JSON report; the
table and cell formatters every benchmark prints through. Nothing here measures."""

from __future__ import annotations

import pytest

from bench.kernels.__main__ import MODES, parse_args
from bench.lib.report import cell, markdown_table


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_kernel_mode_parses_and_writes_its_own_report(mode):
    args = parse_args([mode])
    assert args.mode == mode and args.out == f"bench/results/kernels_{mode.replace('-', '_')}.json"


def test_kernel_modes_keep_the_flags_the_docs_name():
    assert parse_args(["attention", "--device", "cuda", "--rows", "16", "--keys", "512", "2048"]).keys == [512, 2048]
    assert parse_args(["fused-layer", "--dtype", "float32", "--concurrency", "16"]).concurrency == 16
    assert parse_args(["step", "--concurrency", "1", "--concurrency", "16"]).concurrency == [1, 16]
    assert parse_args(["moe", "--experts", "8"]).experts == 8


def test_a_missing_value_prints_as_a_dash_never_as_zero():
    assert cell(None) == "-" and cell(None, missing="?") == "?"
    assert cell(0.0) == "0.00" and cell(0.256, ".0%") == "26%" and cell(0.0123, ".1f", 1000) == "12.3"


def test_markdown_table_aligns_every_column_but_the_first_right():
    assert markdown_table(["a", "b", "c"], [("x", 1, 2.5)]).splitlines() == [
        "| a | b | c |", "|---|---:|---:|", "| x | 1 | 2.5 |"]
