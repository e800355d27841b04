"""`python -m bench.kernels <mode>`: every mode parses its flags and names its own JSON report; the
table and cell formatters every benchmark prints through; the state snapshot table's counts on a tiny model;
the decode profile's arithmetic and a tiny run of it on the embedded model."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.kernels.__main__ import MODES, parse_args
from bench.lib.report import cell, markdown_table


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_kernel_mode_parses_and_writes_its_own_report(mode):
    args = parse_args([mode])
    assert args.mode == mode and args.out == f"bench/results/kernels_{mode.replace('-', '_')}.json"


def test_kernel_modes_keep_the_flags_the_docs_name():
    assert parse_args(["moe", "--experts", "8"]).experts == 8
    assert parse_args(["decode-ab", "--baseline", "main", "--model", "gpt-oss-shape"]).model == "gpt-oss-shape"


def test_moe_mode_builds_bf16_and_mxfp4_experts_as_checkpoints_ship_them_and_times_them_beside_float():
    from bench.kernels.moe import gpt_oss_model, moe_layer_rows
    from pdserve.models.quant.mxfp4 import dequantize_mxfp4

    _, floats = gpt_oss_model(1, 4, 2, 64, 32, 128)
    _, mxfp4 = gpt_oss_model(1, 4, 2, 64, 32, 128, "mxfp4")
    _, bfloat16 = gpt_oss_model(1, 4, 2, 64, 32, 128, "bfloat16")
    name = "model.layers.0.mlp.experts.down_proj"
    assert not mxfp4.has(name) and mxfp4.has(name + "_blocks") and mxfp4.has("model.norm.weight")
    weight = floats.get(name).transpose(1, 2)  # rows = outputs
    error = (dequantize_mxfp4(mxfp4.get(name + "_blocks"), mxfp4.get(name + "_scales")) - weight).abs().max()
    assert 0 < error < 0.25 * weight.abs().max()  # the same values, in 4 bits
    assert bfloat16.get(name).dtype == torch.bfloat16 and torch.equal(bfloat16.get(name).float(),
                                                                       floats.get(name).bfloat16().float())
    rows = moe_layer_rows(64, 32, 2, [4], repeats=1)
    assert [row["batch"] for row in rows] == [1, 16]
    assert all(row["native_mxfp4_ms"] > 0 and row["native_bfloat16_ms"] > 0 for row in rows)


def test_a_missing_value_prints_as_a_dash_never_as_zero():
    assert cell(None) == "-" and cell(None, missing="?") == "?"
    assert cell(0.0) == "0.00" and cell(0.256, ".0%") == "26%" and cell(0.0123, ".1f", 1000) == "12.3"


def test_markdown_table_aligns_every_column_but_the_first_right():
    assert markdown_table(["a", "b", "c"], [("x", 1, 2.5)]).splitlines() == [
        "| a | b | c |", "|---|---:|---:|", "| x | 1 | 2.5 |"]


def test_state_mode_pulls_state_pages_that_do_not_grow_with_the_prompt():
    from bench.kernels.state import pull_bytes_rows

    rows = {(r["model"], r["prompt_tokens"]): r for r in pull_bytes_rows([4096, 16384], 16, "float32")}
    hybrid_4k, hybrid_16k = rows[("Qwen3.5-27B shape", 4096)], rows[("Qwen3.5-27B shape", 16384)]
    full_4k = rows[("same, every layer full attention", 4096)]
    assert hybrid_4k["state_pages"] == hybrid_16k["state_pages"] == 48  # one page per DeltaNet layer
    assert full_4k["state_pages"] == 0 and full_4k["data_gib"] == 1.0  # 64 layers x 4 KV heads x 256 x bf16 x 4095
    # A quarter of the layers keep K/V: the attention data is a quarter of the all-attention model's.
    growth = hybrid_16k["data_gib"] - hybrid_4k["data_gib"]
    assert abs(growth - 0.75) < 0.01


def test_snapshotting_every_block_recomputes_only_what_the_kv_allows_and_holds_the_most_pages():
    from bench.kernels.state import add_arguments, snapshot_row, state_model

    parser = argparse.ArgumentParser()
    add_arguments(parser, "state")
    args = parser.parse_args(["--layers", "4", "--hidden", "128", "--intermediate", "128", "--vocab", "512"])
    config, weights, _ = state_model(args)
    every_block, prompt_ends_only = (snapshot_row(config, weights, interval, num_prompts=2) for interval in (1, 0))
    assert every_block["recomputed_tokens"] == every_block["recomputed_kv_bound"]
    assert prompt_ends_only["recomputed_tokens"] > prompt_ends_only["recomputed_kv_bound"]
    assert every_block["snapshot_pages"] > prompt_ends_only["snapshot_pages"] > 0


def _step_record(rows: int = 1, laps: bool = True) -> dict:
    """One decode step as the profiler records it: nested timers, seconds."""
    record = {"rows": rows, "context_tokens": 10 * rows, "laps": laps, "step": 10.0, "execute": 8.0, "forward": 6.0,
              "layers": 4.0, "lm_head": 1.5, "sampling": 0.5}
    if laps:
        record |= {"layer.qkv": 1.0, "layer.mlp_down": 2.5, "layer.final_norm": 0.25}
    return record


def test_decode_profile_takes_each_part_out_of_the_timer_it_ran_inside():
    from bench.kernels.decode import derived_parts

    parts = derived_parts(_step_record())
    assert parts["layers_total"] == 3.75 and parts["final_norm"] == 0.25  # the stack's own final norm
    assert parts["layers_call"] == 4.0 - 1.0 - 2.5 - 0.25
    assert parts["embed_and_inputs"] == 6.0 - 4.0 - 1.5
    assert parts["runner_glue"] == 8.0 - 6.0 - 0.5 and parts["engine_outside_runner"] == 2.0
    assert parts["python_outside_model"] == 4.0 and parts["step"] == 10.0
    own = ("embed_and_inputs", "layer.qkv", "layer.mlp_down", "layers_call", "final_norm", "lm_head", "sampling",
           "runner_glue", "engine_outside_runner")
    assert sum(parts[key] for key in own) == parts["step"]  # the rows add up to the step


def test_decode_ab_takes_each_sides_median_run():
    from bench.kernels.decode_ab import _PART_KEYS, medians

    def run(scale: float) -> dict:
        return {"batches": [{"batch": 1, "parts": {key: {"median_ms": scale} for key in _PART_KEYS}}]}

    assert medians([run(1.0), run(5.0), run(2.0)])[1]["step"] == 2.0


def test_decode_profile_sets_each_kv_dtype_against_the_first_at_the_same_batch():
    from bench.kernels.decode import dtype_rows

    def summary(dtype: str, batch: int, attention_ms: float, step_ms: float) -> dict:
        parts = {"layer.attention": {"median_ms": attention_ms, "bytes": 2_000_000},
                 "layer.store_kv": {"median_ms": 0.5, "bytes": 0}, "step": {"median_ms": step_ms, "bytes": 0}}
        return {"kv_cache_dtype": dtype, "batch": batch, "parts": parts}

    rows = dtype_rows([summary("float32", 1, 1.0, 10.0), summary("float32", 16, 20.0, 90.0),
                       summary("bfloat16", 1, 0.5, 8.0), summary("bfloat16", 16, 16.0, 80.0)])
    assert rows[0] == ["float32", 1, "1.000", "1.00x", "0.500", "1.00x", "10.000", "1.00x", "2.0"]
    assert rows[3][:4] == ["bfloat16", 16, "16.000", "1.25x"] and rows[3][6:8] == ["80.000", "1.12x"]
    without_tiles = summary("float32", 1, 1.0, 11.0) | {"one_row_tiles": False, "batch_activation_bits": 8}
    assert dtype_rows([summary("float32", 1, 1.0, 10.0), without_tiles])[1][:1] == [
        "float32, 8-bit batches, no one-row tiles"]


def test_a_tiny_decode_profile_of_the_embedded_model_has_every_part_and_its_bound(tmp_path):
    from tests.models.test_quantized_blocks import require_native_kernels

    require_native_kernels()
    from bench.kernels.__main__ import main

    out = tmp_path / "decode.json"
    assert main(["decode", "--rounds", "1", "--new-tokens", "2", "--prompt-tokens", "4", "--batches", "1", "2",
                 "--threads", "1", "--out", str(out)]) == 0
    import json

    record = json.loads(out.read_text())
    assert [b["batch"] for b in record["batches"]] == [1, 2]
    for batch in record["batches"]:
        parts = batch["parts"]
        assert batch["num_steps"] == 2 and parts["step"]["median_ms"] >= parts["layers_total"]["median_ms"] > 0
        assert parts["lm_head"]["bytes"] == 49152 * 576 // 32 * 34  # the Q8_0 head, as stored
        assert parts["layer.attention"]["bytes"] > 0 and parts["step"]["bound_ms"] > parts["lm_head"]["bound_ms"] > 0
        assert parts["layer.experts"]["median_ms"] == 0  # a dense model
    assert record["read_bandwidth_bytes_per_s"] > 1e8


def test_q4_1_mode_times_every_variant_of_every_product_against_the_float_tiles():
    import time

    from bench.kernels.q4_1 import SHAPES, compiled_lane_widths, product_rows, variants
    from tests.models.test_quantized_blocks import require_native_kernels

    require_native_kernels()
    rows = product_rows([16], repeats=1, clock=time.process_time)
    assert [(r["product"], r["rows"]) for r in rows] == [(name, 16) for name, _, _ in SHAPES]
    labels = [label for label, _, _ in variants(compiled_lane_widths())]
    assert all(list(r["ms"]) == labels and r["x_tiles"]["float tiles"] == 1.0 for r in rows)
    assert "dequantized matmul" in labels and ("one-row tiles" in labels) == (16 in compiled_lane_widths())


def test_all_reduce_mode_times_both_paths_between_two_real_processes():
    from bench.kernels.all_reduce import run
    from pdserve.parallel.host_collectives import shared_memory_check
    import torch

    from pdserve.kernels.native import cpu_kernels_available

    if shared_memory_check(torch.device("cpu")) is not None or not cpu_kernels_available():
        pytest.skip("the shared-memory path is x86-64 only, the native one needs the kernels")
    table, record = run(parse_args(["all-reduce", "--iterations", "20", "--rounds", "1", "--hidden", "64"]))
    assert record["child_exit_code"] == 0
    assert all(len(values) == 1 and values[0] > 0 for values in record["seconds_per_call"].values())
    assert "| native |" in table and "| Python |" in table
