"""The tensor-parallel benchmark's pure parts: sizes, head divisibility, threads per rank, decode
tokens/s from chunk times, ratios vs TP=1, the table and the JSON report (no server, no model)."""

from __future__ import annotations

import json
import os
import math

import pytest

from bench.tensor_parallel import (
    ModelShape, SizeResult, aggregate_decode_tokens_per_s, by_round, check_divisible, decode_tokens_per_s,
    format_summary, format_table, parse_args, parse_sizes, prompts, ratio, ratios, report_dict, round_ratios,
    short_error, threads_per_rank, worker_argv,
)
from bench.lib.report import write_document


def _result(tp_size: int, batch1: list[float], streams: float | None, error: str | None = None,
            num_threads: int = 2) -> SizeResult:
    return SizeResult(tp_size, threads_per_rank(num_threads, tp_size), batch1_runs_tokens_per_s=list(batch1),
                      streams_tokens_per_s=streams, error=error)


# --- arguments and the model's shape --------------------------------------------------------------

def test_sizes_parse_in_order_and_reject_bad_lists():
    assert parse_sizes("1,2,3") == [1, 2, 3]
    assert parse_sizes(" 3, 1 ,") == [3, 1]
    for bad in ("", "1,x", "0,1", "2,2", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_default_shape_splits_over_one_two_and_three_ranks_and_others_are_refused():
    shape = ModelShape()
    check_divisible(shape, [1, 2, 3, 6])
    with pytest.raises(ValueError, match=r"\[4, 5\]"):
        check_divisible(shape, [1, 4, 5])
    assert shape.num_heads * shape.head_dim == shape.hidden_size
    # 12 layers of (q, k, v, o, gate, up, down, 2 norms) + embedding, head and final norm
    per_layer = 576 * 576 * 2 + 576 * 288 * 2 + 3 * 576 * 1536 + 2 * 576
    assert shape.num_params() == 12 * per_layer + 2 * 8192 * 576 + 576


def test_threads_per_rank_shares_the_workers_threads_and_never_drops_below_one():
    assert [threads_per_rank(2, n) for n in (1, 2, 3)] == [2, 1, 1]
    assert [threads_per_rank(8, n) for n in (1, 2, 3)] == [8, 4, 2]


def test_threads_per_rank_matches_what_the_worker_does():
    from pdserve.runner.devices import rank_threads

    for num_threads in (1, 2, 5, 8):
        for size in (1, 2, 3):
            assert threads_per_rank(num_threads, size) == rank_threads(num_threads, size)


def test_args_default_and_validate():
    args = parse_args(["--num-threads", "2"])
    assert args.sizes == [1, 2, 3] and args.max_tokens == 96 and args.repeats == 3 and args.streams == 4
    assert args.out.endswith(os.path.join("bench", "results", "tensor_parallel.json")) and args.shape.num_layers == 12
    assert parse_args(["--sizes", "2", "--num-layers", "4"]).shape.num_layers == 4
    for bad in (["--sizes", "4"], ["--max-tokens", "1"], ["--repeats", "0"], ["--sizes", "1,1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_worker_argv_names_the_tp_size_threads_and_cpu():
    argv = worker_argv("/m", 1234, 3, 2, 512)
    assert argv[1:4] == ["-m", "pdserve.app.cli", "serve"]
    flags = dict(zip(argv[4::2], argv[5::2]))
    assert 0 < int(flags.pop("--internal-port")) < 65536  # a free port of its own
    assert flags == {"--model": "/m", "-tp": "3", "--host": "127.0.0.1", "--port": "1234", "--device": "cpu",
                     "--dtype": "float32", "--num-threads": "2", "--num-blocks": "512", "--log-level": "warning"}


def test_prompts_are_reproducible_and_avoid_special_tokens():
    first = prompts(3, 8192, seed=0)
    assert first == prompts(3, 8192, seed=0) and first != prompts(3, 8192, seed=1)
    assert len(first) == 3 and all(len(p) == 32 for p in first)
    assert all(3 <= token < 8192 for p in first for token in p)
    assert len(set(first)) == 3


# --- figures ---------------------------------------------------------------------------------------

def test_decode_rate_counts_tokens_after_the_first_chunk_over_their_span():
    # first token at 1.0 s (prefill), then 4 tokens until 1.4 s: 4 tokens / 0.4 s
    assert decode_tokens_per_s([1.0, 1.1, 1.2, 1.3, 1.4], [1] * 5) == pytest.approx(10.0)
    # chunks with several tokens: the first chunk's 2 are not decode tokens
    assert decode_tokens_per_s([0.5, 1.0, 1.5], [2, 3, 2]) == pytest.approx(5.0)
    assert decode_tokens_per_s([1.0], [1]) is None
    assert decode_tokens_per_s([], []) is None
    assert decode_tokens_per_s([1.0, 1.0], [1, 1]) is None
    with pytest.raises(ValueError):
        decode_tokens_per_s([1.0, 2.0], [1])


def test_aggregate_rate_spans_earliest_first_chunk_to_latest_last_chunk():
    streams = [
        ([0.0, 1.0, 2.0], [1, 1, 1]),  # 2 tokens after its first
        ([0.5, 1.5, 2.5, 4.0], [1, 1, 1, 1]),  # 3 tokens after its first
    ]
    assert aggregate_decode_tokens_per_s(streams) == pytest.approx(5 / 4.0)
    # a stream with one chunk adds no decode tokens but still bounds the span
    assert aggregate_decode_tokens_per_s([([0.0, 2.0], [1, 1]), ([3.0], [1])]) == pytest.approx(1 / 3.0)
    assert aggregate_decode_tokens_per_s([([], []), ([1.0], [1])]) is None
    assert aggregate_decode_tokens_per_s([]) is None
    # one stream alone: the same figure as the batch-1 rate
    one = ([1.0, 1.1, 1.2, 1.3, 1.4], [1] * 5)
    assert aggregate_decode_tokens_per_s([one]) == pytest.approx(decode_tokens_per_s(*one))


def test_ratio_needs_both_figures_and_a_positive_baseline():
    assert ratio(5.0, 10.0) == 0.5
    assert ratio(None, 10.0) is None and ratio(5.0, None) is None and ratio(5.0, 0.0) is None


def test_ratios_divide_by_tp1_and_skip_failed_sizes():
    results = [_result(1, [10.0, 30.0, 20.0], 40.0), _result(2, [8.0, 12.0, 10.0], 30.0),
               _result(3, [], None, error="worker exited")]
    assert results[0].batch1_tokens_per_s == 20.0
    by_size = ratios(results)
    assert by_size["1"] == {"batch1": 1.0, "streams": 1.0}
    assert by_size["2"]["batch1"] == pytest.approx(0.5) and by_size["2"]["streams"] == pytest.approx(0.75)
    assert by_size["3"] == {"batch1": None, "streams": None}


def test_ratios_are_none_without_a_working_tp1():
    assert ratios([_result(2, [10.0], 20.0)]) == {"2": {"batch1": None, "streams": None}}
    failed_base = [_result(1, [10.0], 20.0, error="boom"), _result(2, [5.0], 10.0)]
    assert ratios(failed_base)["2"] == {"batch1": None, "streams": None}


def test_rounds_divide_by_their_own_tp1_and_the_summary_takes_medians():
    rounds = [[_result(1, [20.0], 40.0), _result(2, [16.0], 44.0)],  # a fast TP=1
              [_result(1, [10.0], 40.0), _result(2, [11.0], 40.0)],  # a slow spell on TP=1
              [_result(1, [16.0], 40.0), _result(2, [14.0], 30.0, error="rank lost")]]
    results = []
    for index, round_results in enumerate(rounds):
        for result in round_results:
            result.round_index = index
            results.append(result)
    assert [len(r) for r in by_round(results)] == [2, 2, 2]
    gathered = round_ratios(results)
    assert gathered["2"]["batch1"] == pytest.approx([0.8, 1.1])  # the failed round counts for nothing
    assert gathered["2"]["streams"] == pytest.approx([1.1, 1.0])
    summary = format_summary(results, 4).splitlines()
    assert summary[3] == "| 2 | 0.80 / 1.10 | 0.95x | 1.10 / 1.00 | 1.05x |"
    report = report_dict("cmd", {}, {}, results)
    assert [row["batch1_ratio_vs_tp1"] for row in report["sizes"]][1::2] == pytest.approx([0.8, 1.1, None])
    assert report["median_ratios_vs_tp1"]["2"]["batch1"] == pytest.approx(0.95)
    assert parse_args(["--rounds", "3"]).rounds == 3


def test_a_gloo_row_is_its_own_row_against_the_same_tp1():
    gloo = _result(2, [2.0], 4.0)
    gloo.tensor_path = "gloo"
    results = [_result(1, [20.0], 40.0), _result(2, [16.0], 36.0), gloo]
    by_row = ratios(results)
    assert by_row["2"]["batch1"] == pytest.approx(0.8) and by_row["2 (gloo)"]["batch1"] == pytest.approx(0.1)
    assert format_table(results, 4).splitlines()[4] == "| 2 (gloo) | 2 | 1 | 2.0 | 0.10x | 4.0 | 0.10x | - |"
    assert worker_argv("/m", 1234, 2, 2, 512, "gloo")[-1] == "--no-tp-shared-memory"
    assert worker_argv("/m", 1234, 2, 2, 512, "Python all-reduce")[-1] == "--no-tp-native-all-reduce"
    assert not {"--no-tp-shared-memory", "--no-tp-native-all-reduce"} & set(worker_argv("/m", 1234, 2, 2, 512))
    assert parse_args(["--compare-gloo"]).compare_gloo and not parse_args([]).compare_gloo
    assert parse_args(["--compare-python-all-reduce"]).compare_python_all_reduce


# --- table and report ------------------------------------------------------------------------------

def test_table_has_a_row_per_size_with_ratios_and_failures():
    results = [_result(1, [20.0], 40.0), _result(2, [10.0], 30.0), _result(3, [], None, error="worker exited")]
    results[1].foreign_cpu_fraction = 0.05
    lines = format_table(results, num_streams=4).splitlines()
    assert lines[0] == ("| TP size | ranks | threads per rank | batch-1 decode tok/s | ratio vs TP=1 | 4-stream tok/s "
                        "| ratio vs TP=1 | other CPU |")
    assert len(lines) == 5
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2] == "| 1 | 1 | 2 | 20.0 | 1.00x | 40.0 | 1.00x | - |"
    assert lines[3] == "| 2 | 2 | 1 | 10.0 | 0.50x | 30.0 | 0.75x | 5% |"
    assert lines[4] == "| 3 | 3 | 1 | failed: worker exited | - | - | - | - |"


def test_short_error_keeps_the_last_exception_of_a_log_tail_on_one_line():
    tail = ("pdserve serve -tp 2 exited with 1: Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "ValueError: first\nduring handling\nAttributeError: 'ParallelConfig' object has no attribute 'x'\n")
    assert short_error(tail) == "AttributeError: 'ParallelConfig' object has no attribute 'x'"
    assert short_error("worker   exited\nearly") == "worker exited early"
    long = short_error("y" * 500, limit=50)
    assert len(long) == 50 and long.endswith("...")
    results = [_result(1, [20.0], 40.0), _result(2, [], None, error=tail)]
    assert format_table(results, 4).splitlines()[3].startswith("| 2 | 2 | 1 | failed: AttributeError: ")


def test_report_holds_config_machine_figures_and_ratios(tmp_path):
    results = [_result(1, [20.0, 22.0, 18.0], 40.0), _result(2, [10.0], 30.0)]
    machine = {"cpu_count": 2, "commit": "abc"}
    report = report_dict("python3 bench/tensor_parallel.py", {"sizes": [1, 2]}, machine, results)
    path = tmp_path / "sub" / "report.json"
    write_document(str(path), report)
    loaded = json.loads(path.read_text())
    assert loaded["machine"] == machine and loaded["config"] == {"sizes": [1, 2]}
    first, second = loaded["sizes"]
    assert first["tp_size"] == 1 and first["num_ranks"] == 1 and first["batch1_tokens_per_s"] == 20.0
    assert first["batch1_runs_tokens_per_s"] == [20.0, 22.0, 18.0]
    assert first["batch1_ratio_vs_tp1"] == 1.0 and first["streams_ratio_vs_tp1"] == 1.0
    assert second["threads_per_rank"] == 1
    assert math.isclose(second["batch1_ratio_vs_tp1"], 0.5) and math.isclose(second["streams_ratio_vs_tp1"], 0.75)
