"""The engine benchmark's bookkeeping: workload, stream parsing, ratios, targets, table and JSON (no model)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from bench.engine.peers import transformers_serve_argv, transformers_serve_extra_body
from bench.engine.llama_server import llama_server_argv, raw_decode_result
from bench.engine.systems import IGNORE_EOS_BODY, BenchError, HttpTarget, stream_one
from bench.engine.report import (
    GENERATE, LLAMA_BENCH, LLAMA_SERVER, SERVE, SUBJECT_FP32, BenchReport, LongPromptResult, PhaseResult, RequestSample, Roofline,
    check_targets, format_long_prompts, format_table, ratio_vs_best_peer, summarize, write_json,
)
from bench.engine.workload import chat_messages, full_workload, long_prompt_messages, quick_workload
from bench.lib.stats import percentile


def _phase(system: str, concurrency: int, tokens_per_s: float, tpot_s: float = 0.0) -> PhaseResult:
    return PhaseResult(system=system, concurrency=concurrency, num_requests=1,
                       num_output_tokens=int(tokens_per_s * 10), wall_s=10.0, ttft_p50_s=0.1,
                       tpot_p50_s=tpot_s or 1.0 / tokens_per_s)


def _results(pdserve_c1: float, pdserve_c16: float, fp32_c1: float = 30.0) -> list[PhaseResult]:
    return [
        _phase(GENERATE, 1, 20.0), _phase(SERVE, 1, 13.0), _phase(LLAMA_SERVER, 1, 40.0),
        _phase(SUBJECT_FP32, 1, fp32_c1), _phase("pdserve", 1, pdserve_c1),
        _phase(GENERATE, 16, 80.0), _phase(SERVE, 16, 50.0), _phase(LLAMA_SERVER, 16, 100.0),
        _phase(SUBJECT_FP32, 16, 90.0), _phase("pdserve", 16, pdserve_c16),
        _phase(LLAMA_BENCH, 1, 60.0),  # last, so the rows above keep their indices
    ]


def _roofline() -> Roofline:
    return Roofline(weight_bytes=500_000_000, read_bandwidth_bytes_per_s=10e9, matmul_params=100_000_000,
                    matmul_concurrency=16, matmul_flops_per_s=50e9, matvec_flops_per_s=10e9,
                    quantized_weight_bytes=100_000_000)


def test_phases_and_their_repeats_never_share_a_prompt_and_warmup_prompts_come_after_all_of_them():
    for workload in (full_workload(), quick_workload()):
        phases = [workload.prompt_indices(c, attempt) for attempt in range(3) for c in workload.concurrencies]
        flat = [i for phase in phases for i in phase]
        assert len(flat) == len(set(flat)) == 3 * workload.num_requests
        assert [len(p) for p in phases[:3]] == [workload.num_requests_by_concurrency[c] for c in workload.concurrencies]
        assert min(workload.warmup_indices(16)) > max(flat)
    with pytest.raises(KeyError):
        full_workload().prompt_indices(3)


def test_prompts_differ_from_their_first_words():
    first_words = {chat_messages(i)[0]["content"].split(",")[0] for i in range(64)}
    assert len(first_words) == 64


def test_percentile_interpolates_and_handles_empty_input():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_summary_throughput_is_total_tokens_over_phase_wall_time():
    samples = [RequestSample(ttft_s=0.2, e2e_s=2.2, num_output_tokens=21), RequestSample(0.4, 4.4, 41)]
    result = summarize("pdserve", 4, samples, wall_s=5.0)
    assert result.output_tokens_per_s == pytest.approx(62 / 5.0)
    assert result.ttft_p50_s == pytest.approx(0.3)
    assert result.tpot_p50_s == pytest.approx(0.1)
    assert RequestSample(0.2, 0.2, 1).tpot_s is None


def test_ratio_compares_with_the_best_peer_at_the_same_concurrency_only():
    results = _results(pdserve_c1=66.0, pdserve_c16=300.0)
    by_key = {(r.system, r.concurrency): r for r in results}
    # llama-bench's raw decode (60) is a bound, not a peer server: llama-server (40) is the best peer
    assert ratio_vs_best_peer(results, by_key[("pdserve", 1)]) == pytest.approx(66.0 / 40.0)
    assert ratio_vs_best_peer(results, by_key[("pdserve", 16)]) == pytest.approx(3.0)
    assert ratio_vs_best_peer(results, by_key[(SUBJECT_FP32, 16)]) == pytest.approx(0.9)  # pdserve is no peer of itself
    assert ratio_vs_best_peer(results, by_key[(LLAMA_SERVER, 16)]) == pytest.approx(1.0)
    assert ratio_vs_best_peer(results, by_key[(GENERATE, 16)]) == pytest.approx(0.8)


def test_targets_compare_quantized_with_llama_server_and_llama_bench_and_fp32_with_generate():
    met = check_targets(_results(pdserve_c1=60.0, pdserve_c16=250.0, fp32_c1=30.0))
    assert [(c.required_ratio, round(c.measured_ratio, 3), c.met) for c in met] == [
        (1.5, 1.5, True), (2.5, 2.5, True), (0.9, 1.0, True), (1.5, 1.5, True)]
    missed = check_targets(_results(pdserve_c1=53.0, pdserve_c16=249.0, fp32_c1=29.0))
    assert [c.met for c in missed] == [False, False, False, False]  # 53 / 60 = 0.88 of the raw decode
    assert "pdserve c=16 tokens/s vs llama-server" in [c.name for c in met]
    assert f"pdserve c=1 decode tokens/s vs {LLAMA_BENCH}" in [c.name for c in met]


def test_llama_bench_target_compares_decode_rates_not_output_over_wall_time():
    """llama-bench generates from an empty prompt; a server's phase also holds each request's prefill."""
    results = _results(pdserve_c1=60.0, pdserve_c16=250.0)
    results[4] = _phase("pdserve", 1, 30.0, tpot_s=1 / 57.0)  # half its wall time in TTFT, 57 tok/s decoding
    llama_bench = next(c for c in check_targets(results) if LLAMA_BENCH in c.name)
    assert llama_bench.measured_ratio == pytest.approx(57.0 / 60.0) and llama_bench.met


def test_llama_bench_records_become_one_row_of_tokens_over_summed_time():
    records = [{"n_prompt": 0, "n_gen": 128, "samples_ns": [2_000_000_000, 2_000_000_000, 4_000_000_000]}]
    row = raw_decode_result(records, LLAMA_BENCH)
    assert (row.concurrency, row.num_requests, row.num_output_tokens) == (1, 3, 384)
    assert row.output_tokens_per_s == pytest.approx(384 / 8.0)  # not the mean of 64, 64 and 32 tok/s
    with pytest.raises(BenchError):
        raw_decode_result([{"n_prompt": 512, "n_gen": 0, "samples_ns": [1]}], LLAMA_BENCH)


def test_a_target_whose_baseline_did_not_run_is_missed_not_met():
    results = [r for r in _results(pdserve_c1=66.0, pdserve_c16=300.0) if r.system != LLAMA_SERVER]
    checks = check_targets(results)
    assert [c.measured_ratio for c in checks[:2]] == [None, None]
    assert not checks[0].met and checks[2].met and checks[3].met


def test_failed_peer_is_a_reason_not_a_zero_and_does_not_count_as_best():
    results = _results(pdserve_c1=66.0, pdserve_c16=300.0)
    results[7] = PhaseResult(system=LLAMA_SERVER, concurrency=16, error="exited with 1: no model")
    assert results[7].output_tokens_per_s is None
    assert ratio_vs_best_peer(results, results[9]) == pytest.approx(300.0 / 80.0)
    table = format_table(results)
    assert "not run: exited with 1: no model" in table


def test_table_has_one_row_per_system_and_concurrency_plus_ceilings():
    table = format_table(_results(pdserve_c1=66.0, pdserve_c16=300.0), _roofline())
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == 15
    assert "| 1 | pdserve | 66.0 | 100 | 15 | 1.65x | - |" in rows
    assert f"| 1 | {LLAMA_BENCH} | 60.0 | 100 | 17 | 1.50x | - |" in rows  # its own rate over the best server's
    assert "| 1 | ceiling: weight bytes / read bandwidth | 20.0 | - | - | - | - |" in rows
    assert "| 1 | ceiling: quantized weight bytes / read bandwidth | 100.0 | - | - | - | - |" in rows
    assert "| 1 | ceiling: measured matmul FLOP/s at M=1 | 50.0 | - | - | - | - |" in rows
    assert "| 16 | ceiling: measured matmul FLOP/s at M=16 | 250.0 | - | - | - | - |" in rows


def test_long_prompt_table_compares_time_to_first_token_with_llama_server():
    results = [LongPromptResult(LLAMA_SERVER, 1030, [0.9, 1.2, 1.0]), LongPromptResult("pdserve", 1030, [0.5, 0.4, 0.6]),
               LongPromptResult(GENERATE, 1030, error="out of memory")]
    table = format_long_prompts(results).splitlines()
    assert "| pdserve | 1030 | 500 | 500, 400, 600 | 2.00x |" in table
    assert "| llama-server | 1030 | 1000 | 900, 1200, 1000 | 1.00x |" in table
    assert any("not run: out of memory" in line for line in table)


def test_long_prompts_are_unique_and_grow_with_their_line_count():
    short, longer = long_prompt_messages(0, 3)[0]["content"], long_prompt_messages(0, 30)[0]["content"]
    assert len(longer) > 5 * len(short)
    assert long_prompt_messages(1, 3)[0]["content"] != short
    workload = full_workload()
    flat = [i for c in workload.concurrencies for i in workload.prompt_indices(c)]
    assert not set(workload.long_prompt_indices()) & (set(flat) | set(workload.warmup_indices(16)))


def test_llama_server_gets_one_slot_per_request_and_pdserve_kv_capacity():
    argv = llama_server_argv("/opt/llama-server", "/m.gguf", 8123, num_slots=16, num_kv_tokens=16384, num_threads=2)
    assert argv[argv.index("--parallel") + 1] == "16" and argv[argv.index("--ctx-size") + 1] == "16384"
    assert "--kv-unified" in argv and argv[argv.index("-m") + 1] == "/m.gguf"
    assert IGNORE_EOS_BODY["ignore_eos"] is True


def test_json_holds_rows_ratios_roofline_and_targets(tmp_path):
    report = BenchReport(command="python3 bench/engine.py --quick", machine={"num_cpus": 2},
                         workload={"max_tokens": 32}, results=_results(66.0, 300.0), roofline=_roofline(),
                         long_prompts=[LongPromptResult("pdserve", 1030, [0.5])])
    path = tmp_path / "nested" / "engine.json"
    write_json(report, str(path))
    data = json.loads(path.read_text())
    assert data["command"] == "python3 bench/engine.py --quick"
    assert len(data["results"]) == 11
    pdserve_c16 = next(r for r in data["results"] if r["system"] == "pdserve" and r["concurrency"] == 16)
    assert pdserve_c16["output_tokens_per_s"] == pytest.approx(300.0)
    assert pdserve_c16["ratio_vs_best_peer"] == pytest.approx(3.0)
    assert data["roofline"]["bandwidth_tokens_per_s"] == pytest.approx(20.0)
    assert data["roofline"]["matmul_tokens_per_s"] == pytest.approx(250.0)
    assert data["roofline"]["matvec_tokens_per_s"] == pytest.approx(50.0)
    assert data["roofline"]["quantized_bandwidth_tokens_per_s"] == pytest.approx(100.0)
    assert [t["met"] for t in data["targets"]] == [True, True, True, True]
    assert data["long_prompt_ttft"][0]["ttft_median_s"] == pytest.approx(0.5)


def _sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _stream(body: bytes, status_code: int = 200) -> RequestSample:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status_code, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestSample:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = HttpTarget("http://bench", "m", {"ignore_eos": True})
            return await stream_one(client, target, 7, max_tokens=3)

    sample = asyncio.run(go())
    assert seen[0]["ignore_eos"] is True and seen[0]["max_tokens"] == 3 and seen[0]["stream"] is True
    return sample


def test_stream_counts_usage_tokens_over_content_events():
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    content = {"choices": [{"delta": {"content": "ab"}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    assert _stream(_sse(role, content, content, usage)).num_output_tokens == 3
    without_usage = _stream(_sse(role, content, content))
    assert without_usage.num_output_tokens == 2
    assert 0 < without_usage.ttft_s <= without_usage.e2e_s


def test_stream_raises_on_http_error_and_on_error_events():
    with pytest.raises(BenchError, match="HTTP 503"):
        _stream(b"busy", status_code=503)
    with pytest.raises(BenchError, match="mid-stream"):
        _stream(_sse({"error": {"message": "boom"}}))
    with pytest.raises(BenchError, match="not a JSON event"):
        _stream(b"data: {truncated\n\n")


def test_transformers_serve_gets_pdserve_kv_capacity_and_no_eos():
    argv = transformers_serve_argv("/tmp/hf", 8123, num_kv_tokens=16384)
    assert argv[argv.index("--cb-num-blocks") + 1] == "64"
    assert argv[argv.index("serve") + 1] == "/tmp/hf" and "--continuous-batching" in argv
    assert json.loads(transformers_serve_extra_body()["generation_config"])["eos_token_id"] == -1


def test_cpu_meter_counts_this_process_as_its_own_and_reports_a_fraction():
    from bench.lib.machine import CpuMeter, _process_ticks

    before = _process_ticks(os.getpid())
    meter = CpuMeter(pids=[])
    meter.start()
    deadline_s = time.monotonic() + 0.3
    while time.monotonic() < deadline_s:  # burn CPU in the measured process
        pass
    fraction = meter.foreign_fraction()
    assert _process_ticks(os.getpid()) > before
    assert fraction is not None and 0.0 <= fraction <= 1.0
    assert _process_ticks(2**22 + 12345) == 0  # a process that does not exist


def test_cpu_meter_counts_a_child_it_ran_to_completion_as_its_own_work():
    """llama-bench runs as a child of the benchmark: its CPU time must not count as other processes'."""
    import subprocess
    import sys

    from bench.lib.machine import CpuMeter

    meter = CpuMeter(pids=[])
    start = meter._snapshot()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert meter._snapshot().own_ticks - start.own_ticks >= 0.25 * os.sysconf("SC_CLK_TCK")


def test_wait_for_quiet_gives_up_after_its_budget():
    from bench.lib.machine import wait_for_quiet

    started_s = time.monotonic()
    fraction = wait_for_quiet([], max_foreign_fraction=-1.0, max_wait_s=0.0, window_s=0.05)  # never quiet enough
    assert time.monotonic() - started_s < 3.0  # its budget (0 s), not forever
    assert fraction is not None and 0.0 <= fraction <= 1.0


def test_a_run_can_be_cut_to_some_concurrency_levels_and_names_a_level_it_lacks():
    from bench.engine.report import TargetCheck, format_targets
    from bench.engine.workload import full_workload
    from bench.engine.cli import only_levels

    workload = full_workload()
    cut = only_levels(workload, [1])
    assert cut.concurrencies == (1,) and cut.num_requests_by_concurrency[1] == workload.num_requests_by_concurrency[1]
    assert cut.prompt_indices(1) == workload.prompt_indices(1)  # the same prompts as in a full run
    with pytest.raises(SystemExit, match="no phase at concurrency \\[3\\]"):
        only_levels(workload, [1, 3])
    lines = format_targets([TargetCheck("a", 1.0, None), TargetCheck("b", 1.5, 1.2), TargetCheck("c", 1.0, 1.1)])
    assert lines.splitlines() == ["target a >= 1x: n/a (not measured in this run)", "target b >= 1.5x: 1.20x (MISSED)",
                                  "target c >= 1x: 1.10x (met)"]


def test_a_phase_whose_server_dropped_a_connection_runs_again_and_other_errors_stand(monkeypatch):
    import bench.engine.cli as engine
    from bench.engine.report import PhaseResult
    from bench.engine.workload import full_workload

    outcomes = {"dropped": [PhaseResult("s", 1, error="Server disconnected", dropped_connection=True),
                            PhaseResult("s", 1, num_requests=6, num_output_tokens=768, wall_s=12.0)],
                "broken": [PhaseResult("s", 1, error="HTTP 500"), PhaseResult("s", 1, wall_s=1.0)]}
    for name, sequence in outcomes.items():
        attempts = iter(sequence)
        monkeypatch.setattr(engine, "_measure_once", lambda *args, attempts=attempts: next(attempts))
        system = type("System", (), {"name": "s"})()
        result = engine.measure_phase(system, full_workload(), 1, 0.0, num_retries=1)
        if name == "dropped":
            assert result.error is None and result.output_tokens_per_s == 64.0 and result.num_attempts == 2
        else:
            assert result.error == "HTTP 500"


_FAKE_LLAMA_SERVER = '''#!{python}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)  # as this llama.cpp build does on a Xeon with AMX
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"data": [{{"id": "m.gguf"}}]}}' if self.path == "/v1/models" else b"{{}}"
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def test_a_llama_server_killed_by_a_signal_while_starting_is_measured_without_repacked_weights(tmp_path):
    """The row is measured, not left empty, and the report says which llama-server it was."""
    import sys

    from bench.engine.llama_server import NO_REPACK_FLAG, LlamaServerSystem

    binary = tmp_path / "llama-server"
    binary.write_text(_FAKE_LLAMA_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    system = LlamaServerSystem(str(tmp_path / "m.gguf"), str(tmp_path), num_kv_tokens=1024, binary=str(binary))
    system.start(ready_timeout_s=30)
    try:
        system.prepare(1)
        assert "exited with -11" in system.repack_off_reason
        assert system._server.process.poll() is None and NO_REPACK_FLAG in system._server.process.args
        assert httpx.get(system.target().base_url + "/health", timeout=5).status_code == 200
    finally:
        system.close()


def test_llama_bench_runs_with_and_without_repacked_weights_and_neither_is_a_peer_server():
    from bench.engine.llama_server import llama_bench_argv
    from bench.engine.report import LLAMA_BENCH_NO_REPACK, best_peer

    with_repack = llama_bench_argv("/opt/llama-bench", "/m.gguf", 128, 2, repack=True)
    without = llama_bench_argv("/opt/llama-bench", "/m.gguf", 128, 2, repack=False)
    assert with_repack[with_repack.index("--repack") + 1] == "1" and without[without.index("--repack") + 1] == "0"
    assert without[without.index("-n") + 1] == "128" and without[without.index("-t") + 1] == "2"
    results = _results(66.0, 300.0) + [_phase(LLAMA_BENCH_NO_REPACK, 1, 500.0)]
    assert best_peer(results, 1).system == LLAMA_SERVER  # the raw loops are bounds, never the best peer
