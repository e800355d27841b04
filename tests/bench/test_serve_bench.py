"""The serving benchmark's pure parts: workload specs, arrivals, stream parsing, latency statistics,
tables and the JSON report (no server, no model)."""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest

from bench.lib.stream import RequestRecord, StreamError, chunk_num_tokens, parse_event
from bench.lib.workloads import Endpoint
from bench.lib.report import format_latency_table, format_report, format_throughput_table, write_json
from bench.lib.stats import (
    describe, histogram_quantile, itl_gaps, percentile, prefill_windows, split_gaps_by_windows, summarize_run, tpot_s, ttft_s,
)
from bench.lib.workloads import (
    PROMPT_TOKEN_ID_HIGH, PROMPT_TOKEN_ID_LOW, LengthRange, WorkloadError, build_requests, class_counts,
    long_class_name, parse_mix, poisson_offsets_s, single_class, warmup_requests,
)


def _record(index: int, class_name: str, sent_s: float, chunk_times_s: list[float], num_prompt_tokens: int = 10,
            error: str | None = None) -> RequestRecord:
    record = RequestRecord(index, class_name, num_prompt_tokens, len(chunk_times_s), sent_s=sent_s)
    record.chunk_times_s = list(chunk_times_s)
    record.chunk_num_tokens = [1] * len(chunk_times_s)
    record.num_output_tokens = len(chunk_times_s)
    record.done_s = chunk_times_s[-1] if chunk_times_s else None
    record.error = error
    return record


# --- workload -------------------------------------------------------------------------------

def test_length_parses_fixed_and_inclusive_uniform_ranges():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse(" 64-256 ") == LengthRange(64, 256)
    rng = random.Random(1)
    draws = {LengthRange.parse("3-5").sample(rng) for _ in range(200)}
    assert draws == {3, 4, 5}


@pytest.mark.parametrize("text", ["", "abc", "0", "9-3", "1-2-3", "-5"])
def test_length_rejects_malformed_or_empty_ranges(text):
    with pytest.raises(WorkloadError):
        LengthRange.parse(text)


def test_mix_parses_named_classes_with_ranges():
    classes = parse_mix("long:2000:32:0.2, short:100-200:128:0.8")
    assert [c.name for c in classes] == ["long", "short"]
    assert classes[0].input_len == LengthRange(2000, 2000) and classes[0].output_len == LengthRange(32, 32)
    assert classes[1].input_len == LengthRange(100, 200) and classes[1].fraction == 0.8
    assert long_class_name(classes) == "long"
    assert classes[1].describe() == "short:100-200:128:0.8"


@pytest.mark.parametrize("text", [
    "long:2000:32", "long:2000:32:0.5,short:128:128:0.4", "a:1:1:0.5,a:2:2:0.5", ":1:1:1", "a:1:1:x", "a:1:1:-1", "",
])
def test_mix_rejects_bad_entries_and_fractions_not_adding_to_one(text):
    with pytest.raises(WorkloadError):
        parse_mix(text)


def test_single_class_workload_has_no_long_class_to_contrast():
    assert long_class_name(single_class("128", "16")) is None


def test_class_counts_are_exact_shares_that_add_up():
    classes = parse_mix("long:2000:32:0.2,short:128:128:0.8")
    assert class_counts(classes, 40) == [8, 32]
    assert sum(class_counts(parse_mix("a:1:1:0.34,b:1:1:0.33,c:1:1:0.33"), 10)) == 10
    assert class_counts(classes, 3) == [1, 2]  # 0.6 rounds up: a short run still gets its long prompt


def test_poisson_arrivals_start_at_zero_increase_and_match_the_rate():
    offsets = poisson_offsets_s(4000, 2.0, random.Random(0))
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.5, rel=0.05)
    assert poisson_offsets_s(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


def test_same_seed_builds_the_same_workload_and_another_seed_does_not():
    classes = parse_mix("long:50-60:4:0.25,short:8:2-6:0.75")
    first = build_requests(classes, 20, 1.5, seed=7)
    assert first == build_requests(classes, 20, 1.5, seed=7)
    assert first != build_requests(classes, 20, 1.5, seed=8)
    assert sum(r.class_name == "long" for r in first) == 5
    for request in first:
        low, high = (50, 60) if request.class_name == "long" else (8, 8)
        assert low <= len(request.prompt_token_ids) <= high
        assert all(PROMPT_TOKEN_ID_LOW <= t < PROMPT_TOKEN_ID_HIGH for t in request.prompt_token_ids)
    assert [r.index for r in first] == list(range(20))


def test_prompts_share_no_prefix_with_each_other_or_the_warmups():
    requests = build_requests(single_class("32", "4"), 30, math.inf, seed=0) + warmup_requests(3, seed=0)
    first_blocks = {r.prompt_token_ids[:16] for r in requests}
    assert len(first_blocks) == len(requests)


@pytest.mark.parametrize("num_requests, rate", [(0, 1.0), (5, 0.0), (5, -1.0)])
def test_build_rejects_empty_runs_and_non_positive_rates(num_requests, rate):
    with pytest.raises(WorkloadError):
        build_requests(single_class("8", "8"), num_requests, rate, seed=0)


# --- stream parsing -----------------------------------------------------------------------------

def test_endpoint_body_forces_exact_lengths_greedy_streaming_and_per_token_chunks():
    request = build_requests(single_class("5", "7"), 1, math.inf, seed=0)[0]
    body = Endpoint("http://x", model="m").body(request)
    assert body["prompt"] == list(request.prompt_token_ids) and body["max_tokens"] == 7
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["logprobs"] == 0 and body["model"] == "m"
    bare = Endpoint("http://x", with_logprobs=False).body(request)
    assert "logprobs" not in bare and "model" not in bare


def test_event_parsing_skips_non_data_and_done_and_raises_on_error_events():
    assert parse_event(": keep-alive") is None
    assert parse_event("data: [DONE]") is None
    assert parse_event('data: {"choices": []}') == {"choices": []}
    with pytest.raises(StreamError):
        parse_event('data: {"error": {"message": "boom"}}')


def test_chunk_tokens_counted_from_logprobs_else_one_per_text_chunk():
    assert chunk_num_tokens({"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    assert chunk_num_tokens({"choices": [{"text": "", "logprobs": {"tokens": ["\ufffd"]}}]}) == 1
    assert chunk_num_tokens({"choices": [{"text": "hello"}]}) == 1
    assert chunk_num_tokens({"choices": [{"text": ""}]}) == 0
    assert chunk_num_tokens({"choices": [], "usage": {"completion_tokens": 9}}) == 0


# --- statistics ---------------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_histogram_quantile_interpolates_within_the_bucket_the_rank_falls_in():
    buckets = [(0.01, 0.0), (0.02, 50.0), (0.05, 99.0), (0.1, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.02)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.015)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.995, buckets) == pytest.approx(0.075)
    assert histogram_quantile(0.99, [(0.01, 0.0), (math.inf, 2.0)]) == 0.01  # past the last edge
    assert histogram_quantile(0.5, [(0.01, 0.0), (math.inf, 0.0)]) is None


def test_handoff_percentiles_count_only_the_runs_requests():
    from bench.serve import handoff_percentiles

    before = {"p_compute": {0.1: 10.0, 0.2: 10.0, math.inf: 10.0}}  # the warm-up's, all under 0.1 s
    after = {"p_compute": {0.1: 10.0, 0.2: 14.0, math.inf: 14.0}, "proxy_hop": {0.001: 4.0, math.inf: 4.0}}
    table = handoff_percentiles(before, after)
    assert list(table) == ["proxy_hop", "p_compute"]  # the order a request meets them
    assert table["p_compute"]["n"] == 4 and table["p_compute"]["p50_ms"] == pytest.approx(150.0)
    assert table["proxy_hop"]["p99_ms"] == pytest.approx(0.99)


def test_describe_reports_mean_percentiles_and_max():
    dist = describe([float(v) for v in range(1, 11)])
    assert (dist.count, dist.mean, dist.p50, dist.max) == (10, 5.5, 5.5, 10.0)
    assert dist.p90 == pytest.approx(9.1) and dist.p99 == pytest.approx(9.91)
    assert describe([]) is None


def test_ttft_tpot_and_gaps_of_one_request():
    record = _record(0, "short", sent_s=1.0, chunk_times_s=[1.5, 1.6, 1.8, 2.1])
    assert ttft_s(record) == pytest.approx(0.5)
    assert tpot_s(record) == pytest.approx((1.1 - 0.5) / 3)  # (e2e - ttft) / (tokens - 1)
    assert [round(b - a, 6) for a, b in itl_gaps(record)] == [0.1, 0.2, 0.3]
    assert tpot_s(_record(1, "short", 0.0, [0.4])) is None  # one token: no time per output token


def test_gaps_split_by_overlap_with_long_prefill_windows():
    records = [
        _record(0, "long", sent_s=1.0, chunk_times_s=[3.0, 3.1]),      # prefill window [1, 3]
        _record(1, "short", sent_s=0.0, chunk_times_s=[0.2, 0.4, 1.9, 3.5, 3.6]),
    ]
    windows = prefill_windows(records, "long")
    assert windows == [(1.0, 3.0)]
    during, outside = split_gaps_by_windows(records, windows, exclude_class="long")
    assert [round(g, 6) for g in during] == [1.5, 1.6]      # 0.4->1.9 and 1.9->3.5 touch the window
    assert [round(g, 6) for g in outside] == [0.2, 0.1]     # the long request's own gap is left out


def test_summary_counts_failures_but_keeps_them_out_of_latencies_and_throughput():
    records = [
        _record(0, "long", 1.0, [2.0, 2.1], num_prompt_tokens=100),   # prefill window [1, 2]
        _record(1, "short", 0.5, [0.6, 0.7, 2.5], num_prompt_tokens=10),
        _record(2, "short", 1.0, [], error="HTTP 503: busy"),
    ]
    summary = summarize_run("sys", records, duration_s=2.5, long_class="long")
    assert (summary.num_requests, summary.num_failed) == (3, 1)
    assert summary.num_input_tokens == 110 and summary.num_output_tokens == 5
    assert summary.output_throughput == pytest.approx(2.0) and summary.request_throughput == pytest.approx(0.8)
    assert summary.total_token_throughput == pytest.approx(46.0)
    assert summary.overall.ttft.count == 2 and summary.overall.ttft.max == pytest.approx(1.0)
    assert set(summary.by_class) == {"long", "short"} and summary.by_class["short"].num_requests == 1
    assert summary.itl_during_long_prefill.count == 1 and summary.itl_during_long_prefill.max == pytest.approx(1.8)
    assert summary.itl_outside_long_prefill.count == 1


# --- tables and JSON ------------------------------------------------------------------------------

def _two_summaries():
    pd = summarize_run("P/D", [_record(0, "long", 0.0, [2.0, 2.1]), _record(1, "short", 2.2, [2.3, 2.4, 2.5])],
                       2.5, long_class="long")
    colocated = summarize_run("colocated", [_record(0, "long", 0.0, [1.0, 1.1]),
                                            _record(1, "short", 0.5, [0.6, 1.0, 1.1])], 1.1, long_class="long")
    colocated.foreign_cpu_fraction = 0.25
    return pd, colocated


def test_throughput_table_has_one_row_per_system_with_unmeasured_cells_as_dashes():
    table = format_throughput_table(_two_summaries()).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| P/D | 2 / 0 | 2.5 |") and table[2].endswith("| - |")
    assert table[3].endswith("| 25% |")


def test_latency_table_puts_systems_side_by_side_per_metric_in_milliseconds():
    lines = format_latency_table(_two_summaries()).splitlines()
    metrics = [line.split(" | ")[0].lstrip("| ") for line in lines[2:]]
    assert metrics[:2] == ["TTFT", "TTFT"] and [line.split(" | ")[1] for line in lines[2:4]] == ["P/D", "colocated"]
    assert "TTFT [long]" in metrics and "ITL [short]" in metrics and metrics[-1] == "E2E"
    ttft_pd = lines[2].split(" | ")
    assert ttft_pd[2] == "1050.0" and ttft_pd[-1] == "2 |"   # mean of 2.0 s and 0.1 s, two samples
    during = [line for line in lines if "while a [long] prompt" in line]
    assert len(during) == 2 and during[0].endswith("| - | - | - | - | - | 0 |")  # nothing overlapped in P/D


def test_json_report_holds_summaries_and_raw_request_timings(tmp_path):
    pd, colocated = _two_summaries()
    records = [_record(0, "long", 0.0, [2.0, 2.1])]
    path = tmp_path / "sub" / "report.json"
    write_json(str(path), "python3 bench/serve.py compare", {"num_prompts": 2}, [(pd, records), (colocated, records)],
               extra={"log_dir": "/tmp/x"})
    report = json.loads(path.read_text())
    assert report["command"] == "python3 bench/serve.py compare" and report["log_dir"] == "/tmp/x"
    assert [run["label"] for run in report["runs"]] == ["P/D", "colocated"]
    run = report["runs"][0]
    assert run["output_tokens_per_s"] == pytest.approx(pd.output_throughput)
    assert run["overall"]["ttft"]["p99"] == pytest.approx(pd.overall.ttft.p99)
    assert run["requests"][0]["chunk_times_s"] == [2.0, 2.1]
    assert "TTFT" in format_report([pd]) and not (tmp_path / "sub" / "report.json.partial").exists()


def test_plots_are_written_as_png_files_for_every_run(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.lib.plots import plot_all

    pd, colocated = _two_summaries()
    runs = [(pd, [_record(0, "long", 0.0, [2.0, 2.1]), _record(1, "short", 2.2, [2.3, 2.45, 2.5])]),
            (colocated, [_record(0, "long", 0.0, [1.0, 1.1]), _record(1, "short", 0.5, [0.6, 1.0, 1.1])])]
    paths = plot_all(runs, str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["latency_cdf.png", "latency_hist.png", "itl_timeline.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_idle_wait_returns_true_once_quiet_long_enough_and_false_at_its_deadline():
    from bench.lib.machine import busy_fraction, wait_for_idle

    busy = busy_fraction(0.05)
    assert busy is None or 0.0 <= busy <= 1.0
    assert wait_for_idle(max_wait_s=2.0, max_busy_fraction=1.0, quiet_s=0.1, sample_s=0.05) is True
    started_s = time.monotonic()
    assert wait_for_idle(max_wait_s=0.3, max_busy_fraction=-1.0, quiet_s=0.1, sample_s=0.05) is False
    assert time.monotonic() - started_s < 3.0  # its deadline, not forever


def test_interleaved_compare_pairs_ttfts_request_by_request_and_skips_failed_pairs():
    from bench.serve import paired_ttft_table

    first = [_record(0, "c", 0.0, [0.50]), _record(1, "c", 1.0, [1.40]), _record(2, "c", 2.0, [2.30])]
    second = [_record(0, "c", 5.0, [5.51]), _record(1, "c", 6.0, [6.38]),
              _record(2, "c", 7.0, [], error="boom")]  # a failed answer pairs with nothing
    runs = [(summarize_run("colocated", first, 3.0), first), (summarize_run("P/D", second, 3.0), second)]
    rows = paired_ttft_table(runs).splitlines()
    assert rows[0].startswith("| TTFT minus colocated, ms | pairs |")
    assert rows[2] == "| P/D | 2 | -17.0 | -5.0 | 7.0 |"  # +10 and -20 ms: P/D minus colocated, pair by pair
