"""SLO attainment and the goodput rate from request records (no servers)."""

from __future__ import annotations

from bench.lib.stream import RequestRecord
from bench.lib.stats import DEFAULT_SLO, attainment, goodput_rate


def record(prompt: int, ttft_s: float, gap_s: float, tokens: int = 5, ok: bool = True) -> RequestRecord:
    chunks = [1.0 + ttft_s + i * gap_s for i in range(tokens)]
    return RequestRecord(0, "c", prompt, tokens, sent_s=1.0, chunk_times_s=chunks, chunk_num_tokens=[1] * tokens,
                         num_output_tokens=tokens, done_s=chunks[-1], error=None if ok else "HTTP 503")


def test_attainment_judges_ttft_against_the_prompt_budget_then_tpot_and_counts_failures_as_misses():
    records = [
        record(1536, 4.0, 0.010),  # budget 4.07 s: met
        record(128, 1.3, 0.010),  # budget 1.256 s: TTFT missed
        record(128, 0.2, 0.030),  # TPOT missed
        record(128, 0.2, 0.010, ok=False),
    ]
    result = attainment(records, DEFAULT_SLO)
    assert (result.num_met, result.num_ttft_missed, result.num_tpot_missed, result.num_failed) == (1, 1, 1, 1)
    assert result.ratio == 0.25


def test_the_goodput_rate_is_the_highest_rate_whose_lower_rates_all_meet_the_target():
    assert goodput_rate([(0.1, 1.0), (0.2, 0.95), (0.3, 0.85), (0.4, 0.92)]) == 0.2
    assert goodput_rate([(0.4, 0.5), (0.1, 0.9)]) == 0.1
    assert goodput_rate([(0.1, 0.5)]) is None


def test_sweep_flags_parse_systems_and_rates_and_refuse_unknown_ones(capsys):
    import pytest

    from bench.serve import parse_args

    args = parse_args(["sweep", "--rates", "0.3,0.1", "--systems", "colocated,up", "--quick"])
    assert args.rate_list == [0.1, 0.3] and args.system_names == ["colocated", "up"]
    for bad in (["sweep", "--systems", "pd,magic"], ["sweep", "--rates", "0.1,x"], ["sweep", "--rates", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_server_args_reach_every_system_and_name_it(tmp_path):
    from bench.serve import _servers, parse_args

    args = parse_args(["sweep", "--systems", "up,colocated", "--server-args", "--dtype bfloat16"])
    servers = _servers(args, str(tmp_path))
    assert [server.argv[-2:] for server in servers] == [["--dtype", "bfloat16"]] * 2
    assert all(server.name.endswith("+ --dtype bfloat16") for server in servers)
    plain = _servers(parse_args(["sweep", "--systems", "up"]), str(tmp_path))
    assert "--dtype" not in plain[0].argv and "+" not in plain[0].name


def test_goodput_table_and_plot(tmp_path):
    from bench.serve import format_goodput_table
    from bench.lib.plots import plot_attainment

    table = {"colocated": [(0.1, 0.95), (0.2, 0.7)], "P/D adaptive": [(0.1, 1.0), (0.2, 0.92)]}
    text = format_goodput_table(table, [0.1, 0.2])
    assert "| colocated | 95% | 70% | 0.1/s |" in text and "| P/D adaptive | 100% | 92% | 0.2/s |" in text
    path = plot_attainment(table, DEFAULT_SLO, str(tmp_path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_replicas_pin_one_single_threaded_worker_per_core_behind_a_least_loaded_proxy(tmp_path):
    import shlex

    from bench.serve import replicas_argv

    argv = replicas_argv(8000, 64, [0, 3], ["--dtype", "bfloat16"])
    assert argv[:2] == ["sh", "-c"]
    *workers, proxy = [shlex.split(part) for part in argv[2].split(" & ")]
    assert [worker[:3] for worker in workers] == [["taskset", "-c", "0"], ["taskset", "-c", "3"]]
    for worker in workers:
        assert worker[worker.index("--num-threads") + 1] == "1" and worker[-2:] == ["--dtype", "bfloat16"]
    worker_urls = [f"http://127.0.0.1:{worker[worker.index('--port') + 1]}" for worker in workers]
    assert proxy[0] == "exec" and "proxy" in proxy and proxy[proxy.index("--port") + 1] == "8000"
    assert proxy[proxy.index("--decode") + 1:proxy.index("--decode") + 3] == worker_urls
    assert proxy[proxy.index("--decode-policy") + 1] == "least_loaded" and "--prefill" not in proxy


def test_the_interactive_row_takes_p99s_over_the_run_counts_failures_as_late_and_finds_the_highest_passing_rate():
    from bench.lib.stats import TailBound, nearest_rank, tail_check
    from bench.serve import format_tail_table

    assert nearest_rank([float(i) for i in range(1, 101)], 99) == 99.0 and nearest_rank([5.0], 99) == 5.0
    bound = TailBound(ttft_ms=1000.0, tpot_ms=20.0)
    fast = [record(128, 0.2, 0.010) for _ in range(99)]
    assert tail_check(fast + [record(128, 3.0, 0.010)], bound).passed  # the slowest 1% is past the p99
    slow_tail = tail_check(fast[:90] + [record(128, 3.0, 0.010)] * 10, bound)
    assert not slow_tail.passed and slow_tail.ttft_ms == 3000.0
    failed = tail_check(fast[:90] + [record(128, 0.2, 0.010, ok=False)] * 10, bound)
    assert not failed.passed and failed.ttft_ms == float("inf")
    assert not tail_check(fast[:90] + [record(128, 0.2, 0.030)] * 10, bound).passed  # TPOT
    tails = {"up": [(0.1, tail_check(fast, bound)), (0.2, slow_tail), (0.3, tail_check(fast, bound))],
             "serve": [(0.1, failed), (0.2, slow_tail)]}
    text = format_tail_table(tails, [0.1, 0.2, 0.3], bound)
    assert "| up | 200 / 10 pass | 3,000 / 10 fail | 200 / 10 pass | 0.1/s |" in text
    assert "| serve | failed / failed fail | 3,000 / 10 fail | - | none |" in text
