"""Serving benchmark: open-loop streaming load with synthetic prompts against any OpenAI-compatible
server (`run`), P/D (`pdserve up`) against one colocated `pdserve serve` on the same cores
(`compare`), or each system at each Poisson rate (`sweep`: SLO attainment and the goodput rate, the
highest rate at which 90% of requests meet the SLO, as in DistServe). Every run prints throughput,
latency (TTFT, TPOT, ITL, E2E) and SLO tables, through our proxy also p50/p99 of the P/D handoff's
components (its `pdserve_proxy_handoff_seconds`), and writes JSON (`--out`) and plots (`--plot-dir`).

Invariant: every system sees the same requests (prompts, lengths and arrivals come from the seed),
one system at a time, never two at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
import tempfile
import time
from typing import Iterator, Optional, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.lib.machine import CpuMeter
from bench.lib.launch import REPO_ROOT, LaunchError, ServerProcess, free_port, pdserve_argv
from bench.lib.load import run_open_loop
from bench.lib.machine import wait_for_idle
from bench.lib.report import cell, format_report, markdown_table, write_json
from bench.lib.stats import (
    DEFAULT_SLO, RunSummary, TailBound, TailCheck, attainment, goodput_rate, histogram_quantile, percentile,
    summarize_run, tail_check,
)
from bench.lib.stream import RequestRecord
from bench.lib.workloads import (
    Endpoint, RequestClass, WorkloadError, build_requests, long_class_name, parse_mix, single_class, warmup_requests,
)
from pdserve.api.handoff import COMPONENTS, DECODE_COMPONENTS
from proxy.routing.disaggregation import Slo

logger = logging.getLogger("bench.serve")

# The comparison's workload, sized for two cores and under ten minutes for both
# systems: one prompt in four is long (three prefill chunks of 512 tokens), and
# arrivals keep a few short streams decoding whenever a long prompt lands, while
# neither system is pushed past what it can serve.
COMPARE_MIX = "long:1536:32:0.25,short:128:96:0.75"
COMPARE_NUM_PROMPTS = 32
COMPARE_REQUEST_RATE = 0.2
QUICK_MIX = "long:512:8:0.25,short:32:16:0.75"
_NUM_BLOCKS = 1024  # 16k tokens per worker: room for every request of the workload at once
_READY_TIMEOUT_S = 300.0
_NOISY_FOREIGN_FRACTION = 0.15
# MLPerf Inference's interactive scenario bounds p99 TTFT and p99 TPOT over a run at about 3-4x and 2x
# a large model's unloaded latencies on its reference GPUs; the same multiples of this model's on two
# CPU cores (a 1,536-token prompt in ~3.3 s, ~10 ms a token) give its row in the sweep.
INTERACTIVE_TAIL = TailBound(ttft_ms=10_000.0, tpot_ms=20.0)


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=None,
                       help=f"requests in the measured run (default: 100; compare: {COMPARE_NUM_PROMPTS})")
    group.add_argument("--request-rate", type=float, default=None,
                       help=f"Poisson arrivals per second (default: inf, all at once; compare: {COMPARE_REQUEST_RATE})")
    group.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    group.add_argument("--seed", type=int, default=0, help="prompts, lengths, class order and arrivals")
    group.add_argument("--input-len", default=None, help="prompt tokens: 128 (default) or a uniform range 64-256")
    group.add_argument("--output-len", default=None, help="output tokens (ignore_eos): 128 (default) or 64-256")
    group.add_argument("--mix", default=None,
                       help="name:input:output:fraction,...; overrides --input-len/--output-len "
                            f"(compare's default: {COMPARE_MIX})")
    group.add_argument("--num-warmups", type=int, default=2, help="short requests before measuring (not counted)")
    group.add_argument("--model", default=None, help="model name to send (default: the server's only model)")
    group.add_argument("--no-logprobs", action="store_true",
                       help="do not ask for logprobs=0 (then a chunk may hold more than one token)")
    slo = parser.add_argument_group("latency objective")
    slo.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO.ttft_ms)
    slo.add_argument("--slo-ttft-ms-per-token", type=float, default=DEFAULT_SLO.ttft_ms_per_token)
    slo.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO.tpot_ms)
    slo.add_argument("--tail-ttft-ms", type=float, default=INTERACTIVE_TAIL.ttft_ms,
                     help="sweep: the MLPerf-style interactive row's p99 TTFT bound (default: 3x an unloaded "
                          "1,536-token prompt's TTFT on two cores)")
    slo.add_argument("--tail-tpot-ms", type=float, default=INTERACTIVE_TAIL.tpot_ms,
                     help="sweep: its p99 TPOT bound (default: 2x the unloaded TPOT)")


SYSTEMS = ("pd", "static", "up", "colocated", "replicas")


def _add_system_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default="pd,colocated",
                        help=f"comma-separated, from {', '.join(SYSTEMS)} (pd: pdserve up, static disaggregation, "
                             "P and D pinned to halves of the machine; static: the same with the cores handed over; "
                             "up: pdserve up with its defaults; replicas: one single-threaded pdserve serve per "
                             "core, each pinned, behind pdserve proxy's least-loaded routing, DistServe's baseline)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    parser.add_argument("--num-blocks", type=int, default=_NUM_BLOCKS, help="KV pool of each worker, in blocks")
    parser.add_argument("--colocated-threads", type=int, default=None,
                        help="torch threads of the colocated worker (default: every usable core)")
    parser.add_argument("--wait-for-idle-s", type=float, default=0.0,
                        help="before each system's run, wait up to this long for the machine to go idle "
                             "(for shared machines; 0: do not wait)")
    parser.add_argument("--server-args", default="",
                        help="extra flags for every system's server command, shell-quoted, e.g. "
                             "'--dtype bfloat16' (named in each system's label)")
    parser.add_argument("--quick", action="store_true", help="a tiny workload, to check the plumbing")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="benchmark one running server")
    run.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    run.add_argument("--label", default=None, help="the system's name in tables and plots (default: the URL)")
    run.add_argument("--out", default=None, help="JSON report path")
    run.add_argument("--plot-dir", default=None, help="write PNG plots here")
    run.add_argument("--worker-url", action="append", help="a decode worker behind the proxy: its handoff "
                     "components (d_ticket, d_admit, d_pull, d_first_step) join the table; repeatable")
    _add_workload_flags(run)
    compare = commands.add_parser("compare", help="`pdserve up` vs one colocated `pdserve serve`, same cores")
    compare.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "serve_pd_vs_colocated.json"))
    compare.add_argument("--plot-dir", default=os.path.join(REPO_ROOT, "docs", "figures", "serving"))
    compare.add_argument("--interleave", action="store_true", help="start the systems together and send each "
                         "request to each in turn, one at a time, the first alternating: TTFTs paired on one "
                         "state of the machine (the handoff budget: P/D against colocated)")
    _add_system_flags(compare)
    sweep = commands.add_parser("sweep", help="each system at each rate: SLO attainment and the goodput rate")
    sweep.add_argument("--rates", default="0.1,0.2,0.3,0.4", help="Poisson rates (requests/s), comma-separated")
    sweep.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "serve_goodput.json"))
    sweep.add_argument("--plot-dir", default=None, help="write the attainment-vs-rate plot here")
    sweep.add_argument("--plot-from", default=None, help="draw the plot from this sweep report instead of measuring")
    _add_system_flags(sweep)
    _add_workload_flags(compare)
    _add_workload_flags(sweep)
    args = parser.parse_args(argv)
    _apply_workload_defaults(parser, args)
    return args


def _apply_workload_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The comparison's defaults are its reference workload; a single run defaults to a plain burst."""
    if args.command in ("compare", "sweep"):
        args.system_names = [name.strip() for name in args.systems.split(",") if name.strip()]
        if not args.system_names or any(name not in SYSTEMS for name in args.system_names):
            parser.error(f"--systems takes names from {', '.join(SYSTEMS)}")
    if args.command == "sweep":
        try:
            args.rate_list = sorted(float(rate) for rate in args.rates.split(","))
        except ValueError:
            parser.error("--rates takes comma-separated numbers")
        if not args.rate_list or args.rate_list[0] <= 0:
            parser.error("--rates must be positive")
        args.request_rate = args.rate_list[0]
    if args.command in ("compare", "sweep"):
        if args.mix is None and args.input_len is None and args.output_len is None:
            args.mix = QUICK_MIX if args.quick else COMPARE_MIX
        if args.num_prompts is None:
            args.num_prompts = 8 if args.quick else COMPARE_NUM_PROMPTS
        if args.request_rate is None:
            args.request_rate = 1.0 if args.quick else COMPARE_REQUEST_RATE
    args.num_prompts = 100 if args.num_prompts is None else args.num_prompts
    args.request_rate = math.inf if args.request_rate is None else args.request_rate
    try:
        args.classes = parse_mix(args.mix) if args.mix else single_class(args.input_len or "128",
                                                                            args.output_len or "128")
        build_requests(args.classes, args.num_prompts, args.request_rate, args.seed)  # fail now, not mid-run
    except WorkloadError as exc:
        parser.error(str(exc))
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")


def workload_dict(args: argparse.Namespace) -> dict:
    classes: Sequence[RequestClass] = args.classes
    return {
        "classes": [c.describe() for c in classes], "num_prompts": args.num_prompts,
        "request_rate_per_s": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.concurrency, "seed": args.seed, "logprobs": not args.no_logprobs,
        "long_class": long_class_name(classes), "num_warmups": args.num_warmups,
    }


def measure(label: str, endpoint: Endpoint, args: argparse.Namespace,
            server_pids: Sequence[int] = ()) -> tuple[RunSummary, list[RequestRecord]]:
    """Warm up, then the measured run with a progress bar; other processes' CPU share when pids are known."""
    if args.num_warmups:
        warm = run_open_loop(endpoint.base_url, endpoint.calls(warmup_requests(args.num_warmups, args.seed)))
        failed = [r.error for r in warm.records if not r.ok]
        if failed:
            logger.warning("%s: %d warm-up requests failed, first: %s", label, len(failed), failed[0])
    requests = build_requests(args.classes, args.num_prompts, args.request_rate, args.seed)
    meter = CpuMeter(server_pids) if server_pids else None
    handoff_urls = [endpoint.base_url, *(getattr(args, "worker_url", None) or [])]
    handoff_before = handoff_buckets(handoff_urls)
    if meter is not None:
        meter.start()
    with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, mininterval=1.0) as bar:
        result = run_open_loop(endpoint.base_url, endpoint.calls(requests), args.concurrency,
                               on_done=lambda record: bar.update(1))
    summary = summarize_run(label, result.records, result.duration_s, long_class_name(args.classes))
    summary.foreign_cpu_fraction = meter.foreign_fraction() if meter is not None else None
    summary.handoff_ms = handoff_percentiles(handoff_before, handoff_buckets(handoff_urls))
    if (summary.foreign_cpu_fraction or 0.0) > _NOISY_FOREIGN_FRACTION:
        logger.warning("%s: other processes used %.0f%% of the CPUs meanwhile; its latencies are not clean",
                       label, summary.foreign_cpu_fraction * 100)
    for record in result.records:
        if record.error is not None:
            logger.warning("%s: request %d failed: %s", label, record.index, record.error)
    return summary, result.records


def handoff_buckets(urls: Sequence[str]) -> dict[str, dict[float, float]]:
    """The handoff histograms now: component -> {bucket edge: cumulative count}, P/D requests only: the
    proxy's (the first URL) and D's own components from the workers' (`run --worker-url`); {} from a
    server without them (`pdserve serve`)."""
    buckets: dict[str, dict[float, float]] = {}
    for url in urls:
        try:
            families = list(text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text))
        except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text: another kind of server
            continue
        for sample in (sample for family in families for sample in family.samples):
            labels = sample.labels
            if (sample.name == "pdserve_proxy_handoff_seconds_bucket" and labels.get("mode") == "disaggregated") or \
                    (sample.name == "pdserve_pd_handoff_seconds_bucket" and labels["component"] in DECODE_COMPONENTS):
                buckets.setdefault(labels["component"], {})[float(labels["le"])] = sample.value
    return buckets


def handoff_percentiles(before: dict[str, dict[float, float]],
                        after: dict[str, dict[float, float]]) -> dict[str, dict[str, float]]:
    """p50 and p99 (ms) of each component over the requests `after` counted beyond `before` (the run)."""
    table = {}
    for component in (c for c in COMPONENTS if c in after):
        earlier = before.get(component, {})
        run = sorted((edge, count - earlier.get(edge, 0.0)) for edge, count in after[component].items())
        if run and run[-1][1] > 0:
            table[component] = {"n": run[-1][1], "p50_ms": histogram_quantile(0.5, run) * 1e3,
                                "p99_ms": histogram_quantile(0.99, run) * 1e3}
    return table


def format_handoff_table(runs: Sequence[tuple[RunSummary, Sequence[RequestRecord]]]) -> str:
    rows = [(summary.label, component, int(part["n"]), f"{part['p50_ms']:.2f}", f"{part['p99_ms']:.2f}")
            for summary, _ in runs for component, part in summary.handoff_ms.items()]
    return ("P/D handoff components (pdserve_proxy_handoff_seconds, D's pdserve_pd_handoff_seconds; quantiles "
            "interpolated within buckets)\n" + markdown_table(["system", "component", "requests", "p50 ms", "p99 ms"], rows))


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_ttft_ms, args.slo_ttft_ms_per_token, args.slo_tpot_ms)


def format_slo_table(runs: Sequence[tuple[RunSummary, Sequence[RequestRecord]]], slo: Slo) -> str:
    rows = []
    for summary, records in runs:
        result = attainment(records, slo)
        goodput = result.num_met / summary.duration_s if summary.duration_s > 0 else 0.0
        rows.append((summary.label, result.num_met, result.num_ttft_missed, result.num_tpot_missed, result.num_failed,
                     cell(result.ratio, ".0%"), f"{goodput:.3f}"))
    return (f"SLO: TTFT <= {slo.ttft_ms:g} ms + {slo.ttft_ms_per_token:g} ms/prompt token, TPOT <= {slo.tpot_ms:g} ms\n"
            + markdown_table(["system", "met", "TTFT missed", "TPOT missed", "failed", "attainment",
                              "goodput (req/s met)"], rows))


def emit(args: argparse.Namespace, runs: list[tuple[RunSummary, list[RequestRecord]]], command: str,
         extra: Optional[dict] = None, table: str = "", workload: Optional[dict] = None) -> None:
    """The tables (and `table` after them), the JSON report; run and compare also their plots."""
    print(format_report([summary for summary, _ in runs]) + "\n\n" + format_slo_table(runs, slo_of(args)))
    if any(summary.handoff_ms for summary, _ in runs):
        print("\n" + format_handoff_table(runs))
    if table:
        print("\n" + table)
    if args.out:
        write_json(args.out, command, workload or workload_dict(args), runs, extra)
        logger.info("wrote %s", args.out)
    if args.plot_dir and args.command != "sweep":
        from bench.lib.plots import plot_all  # matplotlib only when plots are asked for

        for path in plot_all(runs, args.plot_dir):
            logger.info("wrote %s", path)


def run_single(args: argparse.Namespace, command: str) -> int:
    endpoint = Endpoint(args.base_url.rstrip("/"), args.model, with_logprobs=not args.no_logprobs)
    runs = [measure(args.label or args.base_url, endpoint, args)]
    emit(args, runs, command)
    return 0 if runs[0][0].num_failed == 0 else 1


def pd_cluster_argv(port: int, num_blocks: int) -> list[str]:
    """`pdserve up`: it pins prefill and decode to half of the cores each and gives each that many threads."""
    return pdserve_argv("up", port, "--prefill-port", "0", "--decode-port", "0", "--num-blocks", str(num_blocks),
                        "--log-level", "warning")


def colocated_argv(port: int, num_blocks: int, num_threads: int) -> list[str]:
    return pdserve_argv("serve", port, "--num-blocks", str(num_blocks), "--num-threads", str(num_threads),
                        "--log-level", "warning")


def replicas_argv(port: int, num_blocks: int, cores: Sequence[int], extra: Sequence[str]) -> list[str]:
    """DistServe's baseline: one colocated `pdserve serve` per core (one thread, pinned with taskset),
    behind `pdserve proxy` balancing them by load; one shell whose process group holds them all."""
    urls, commands = [], []
    for core in cores:
        worker_port = free_port()
        urls.append(f"http://127.0.0.1:{worker_port}")
        commands.append(["taskset", "-c", str(core), *colocated_argv(worker_port, num_blocks, 1), *extra])
    proxy = pdserve_argv("proxy", port, "--decode", *urls, "--decode-policy", "least_loaded", "--log-level", "warning")
    return ["sh", "-c", "".join(shlex.join(command) + " & " for command in commands) + "exec " + shlex.join(proxy)]


def _servers(args: argparse.Namespace, log_dir: str) -> list[ServerProcess]:
    """The systems asked for, each on the whole machine (`pdserve up` splits it between P and D)."""
    num_cores = len(os.sched_getaffinity(0))
    threads = args.colocated_threads or num_cores
    pd_name = f"P/D: pdserve up (cores: P {num_cores // 2}, D {num_cores - num_cores // 2})"
    options = {
        "pd": (pd_name, "up.log", lambda port: pd_cluster_argv(port, args.num_blocks)
               + ["--disaggregation", "static", "--no-core-handover"]),
        # What a user gets: adaptive disaggregation at the default SLO, cores handed over.
        "up": ("P/D: pdserve up (defaults)", "up-defaults.log", lambda port: pd_cluster_argv(port, args.num_blocks)),
        "static": ("P/D: pdserve up --disaggregation static (cores handed over)", "up-static.log",
                   lambda port: pd_cluster_argv(port, args.num_blocks) + ["--disaggregation", "static"]),
        "colocated": (f"colocated: pdserve serve ({threads} threads, unpinned)", "serve.log",
                      lambda port: colocated_argv(port, args.num_blocks, threads)),
        "replicas": (f"{num_cores} x pdserve serve (1 thread, pinned) behind pdserve proxy (least_loaded)",
                     "replicas.log", lambda port: replicas_argv(port, args.num_blocks, sorted(os.sched_getaffinity(0)),
                                                                shlex.split(args.server_args))),
    }
    extra = shlex.split(args.server_args)
    servers = []
    for system in args.system_names:
        name, log_name, argv_of = options[system]
        port = free_port()
        label = f"{name} + {args.server_args}" if extra else name
        argv = argv_of(port) if system == "replicas" else [*argv_of(port), *extra]  # replicas: extra flags per worker
        servers.append(ServerProcess(label, argv, port, os.path.join(log_dir, log_name),
                                     own_session=system == "replicas"))
    return servers


def each_system(args: argparse.Namespace) -> Iterator[tuple[ServerProcess, Endpoint]]:
    """Each system asked for, started and ready, then stopped before the next starts: a system never
    shares the cores with another. Its logs go to --log-dir (default: a temporary directory)."""
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-serve-bench-")
    os.makedirs(args.log_dir, exist_ok=True)
    for server in _servers(args, args.log_dir):
        try:
            server.start()
            server.wait_ready(_READY_TIMEOUT_S)
            yield server, Endpoint(server.base_url, args.model, with_logprobs=not args.no_logprobs)
        finally:
            server.stop()


def run_interleaved(args: argparse.Namespace, command: str) -> int:
    """Every system up at once, each idle while another serves; request i goes to each system in turn
    (the first system alternating), so the systems' TTFTs pair up request by request."""
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-serve-bench-")
    servers = _servers(args, args.log_dir)
    records: list[list[RequestRecord]] = [[] for _ in servers]
    durations_s = [0.0 for _ in servers]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(_READY_TIMEOUT_S)
        endpoints = [Endpoint(server.base_url, args.model, with_logprobs=not args.no_logprobs) for server in servers]
        for endpoint in endpoints:
            run_open_loop(endpoint.base_url, endpoint.calls(warmup_requests(args.num_warmups, args.seed)))
        for i, request in enumerate(build_requests(args.classes, args.num_prompts, math.inf, args.seed)):
            for k in (range(len(servers)) if i % 2 == 0 else reversed(range(len(servers)))):
                result = run_open_loop(servers[k].base_url, endpoints[k].calls([request]))
                records[k] += result.records
                durations_s[k] += result.duration_s
    except LaunchError as exc:
        logger.error("could not benchmark: %s", exc)
        return 2
    finally:
        for server in servers:
            server.stop()
    runs = [(summarize_run(server.name, recs, duration_s, long_class_name(args.classes)), recs)
            for server, recs, duration_s in zip(servers, records, durations_s)]
    emit(args, runs, command, {"interleaved": True, "log_dir": args.log_dir}, table=paired_ttft_table(runs))
    return 0 if all(summary.num_failed == 0 for summary, _ in runs) else 1


def paired_ttft_table(runs: Sequence[tuple[RunSummary, Sequence[RequestRecord]]]) -> str:
    """Each system's TTFT minus the first system's, request by request (both answered)."""
    first = runs[0][1]
    rows = []
    for summary, records in runs[1:]:
        diffs_ms = [(a.chunk_times_s[0] - a.sent_s - b.chunk_times_s[0] + b.sent_s) * 1000
                    for a, b in zip(records, first) if a.ok and b.ok]
        rows.append((summary.label, len(diffs_ms), *(cell(percentile(diffs_ms, q), ".1f") for q in (10, 50, 90))))
    return markdown_table([f"TTFT minus {runs[0][0].label}, ms", "pairs", "p10", "p50", "p90"], rows)


def run_compare(args: argparse.Namespace, command: str) -> int:
    if args.interleave:
        return run_interleaved(args, command)
    runs, systems = [], []
    try:
        for server, endpoint in each_system(args):
            idle = wait_for_idle(args.wait_for_idle_s) if args.wait_for_idle_s > 0 else None
            runs.append(measure(server.name, endpoint, args, server.pids()))
            systems.append({"name": server.name, "argv": list(server.argv[1:]), "machine_idle_before_run": idle})
    except LaunchError as exc:
        logger.error("could not benchmark: %s", exc)
        return 2
    emit(args, runs, command, {"systems": systems, "log_dir": args.log_dir})
    return 0 if all(summary.num_failed == 0 for summary, _ in runs) else 1


def plot_sweep_report(path: str, out_dir: str) -> str:
    """The attainment-vs-rate figure of a written sweep report (its "goodput" and "slo")."""
    import json

    from bench.lib.plots import plot_attainment

    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    table = {name: [tuple(point) for point in entry["attainment_by_rate"]] for name, entry in report["goodput"].items()}
    return plot_attainment(table, Slo(**report["slo"]), out_dir)


def rescore_tails(path: str, bound: TailBound) -> Optional[str]:
    """The MLPerf-style row of a written sweep report at any bound (None: the report keeps no requests,
    as the trimmed copies beside the figures)."""
    import json

    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if not report.get("runs"):
        return None
    tails: dict[str, list[tuple[float, TailCheck]]] = {}
    for run in report["runs"]:
        name, _, rate = run["label"].rpartition(" @ ")
        records = [RequestRecord(**request) for request in run["requests"]]
        tails.setdefault(name, []).append((float(rate.removesuffix("/s")), tail_check(records, bound)))
    return format_tail_table(tails, report["workload"]["rates_per_s"], bound)


def run_sweep(args: argparse.Namespace, command: str) -> int:
    """Each system started once, then run at every rate (lowest first); attainment per rate, goodput."""
    if args.plot_from:
        tail_table = rescore_tails(args.plot_from, TailBound(args.tail_ttft_ms, args.tail_tpot_ms))
        if tail_table:
            print(tail_table)
        logger.info("wrote %s", plot_sweep_report(args.plot_from, args.plot_dir or os.path.dirname(args.plot_from)))
        return 0
    slo = slo_of(args)
    table: dict[str, list[tuple[float, float]]] = {}
    tails: dict[str, list[tuple[float, TailCheck]]] = {}
    tail_bound = TailBound(args.tail_ttft_ms, args.tail_tpot_ms)
    runs = []
    base_seed = args.seed
    try:
        for server, endpoint in each_system(args):
            # One request of every class first: a system's first long prompt pays one-time costs.
            first = build_requests(args.classes, len(args.classes), math.inf, args.seed ^ 0xC1A55)
            run_open_loop(endpoint.base_url, endpoint.calls(first))
            for index, rate in enumerate(args.rate_list):
                if args.wait_for_idle_s > 0:
                    wait_for_idle(args.wait_for_idle_s)
                # Fresh prompts at each rate (the same for every system): a rerun of the same prompts
                # would be answered from the prefix cache.
                args.request_rate, args.seed = rate, base_seed + index
                summary, records = measure(f"{server.name} @ {rate:g}/s", endpoint, args, server.pids())
                runs.append((summary, records))
                table.setdefault(server.name, []).append((rate, attainment(records, slo).ratio or 0.0))
                tails.setdefault(server.name, []).append((rate, tail_check(records, tail_bound)))
    except LaunchError as exc:
        logger.error("could not benchmark: %s", exc)
        return 2
    args.seed = base_seed
    goodput = {name: {"attainment_by_rate": points, "goodput_rate_per_s": goodput_rate(points)}
               for name, points in table.items()}
    interactive = {"bound": {"ttft_ms": tail_bound.ttft_ms, "tpot_ms": tail_bound.tpot_ms, "quantile": 99.0},
                   "by_rate": {name: [[rate, check.ttft_ms, check.tpot_ms, check.passed] for rate, check in points]
                               for name, points in tails.items()}}
    emit(args, runs, command, {"slo": {"ttft_ms": slo.ttft_ms, "ttft_ms_per_token": slo.ttft_ms_per_token,
                                       "tpot_ms": slo.tpot_ms}, "goodput": goodput, "interactive": interactive,
                               "log_dir": args.log_dir},
         format_goodput_table(table, args.rate_list) + "\n\n" + format_tail_table(tails, args.rate_list, tail_bound),
         workload_dict(args) | {"rates_per_s": args.rate_list})
    if args.plot_dir:
        from bench.lib.plots import plot_attainment  # matplotlib only when plots are asked for

        logger.info("wrote %s", plot_attainment(table, slo, args.plot_dir))
    return 0


def format_tail_table(tails: dict[str, list[tuple[float, TailCheck]]], rates: Sequence[float],
                      bound: TailBound) -> str:
    """The MLPerf-style row: each rate's p99 TTFT / p99 TPOT, whether both meet the bound, and the
    highest rate at which they do (every lower rate too)."""
    def shown(ms: float) -> str:
        return "failed" if math.isinf(ms) else f"{ms:,.0f}"

    rows = []
    for name, points in tails.items():
        checks = dict(points)
        best = None
        for rate, check in sorted(points):
            if not check.passed:
                break
            best = rate
        rows.append((name, *(f"{shown(checks[r].ttft_ms)} / {shown(checks[r].tpot_ms)} "
                             f"{'pass' if checks[r].passed else 'fail'}" if r in checks else "-" for r in rates),
                     "none" if best is None else f"{best:g}/s"))
    return (f"MLPerf-style interactive: p99 TTFT <= {bound.ttft_ms:,.0f} ms and p99 TPOT <= {bound.tpot_ms:g} ms "
            "over each run (a failure counts as infinitely late)\n"
            + markdown_table(["system (p99 TTFT / p99 TPOT, ms)", *(f"{r:g}/s" for r in rates), "highest passing rate"],
                             rows))


def format_goodput_table(table: dict[str, list[tuple[float, float]]], rates: Sequence[float]) -> str:
    rows = [(name, *(cell(dict(points).get(rate), ".0%") for rate in rates),
             "none" if goodput_rate(points) is None else f"{goodput_rate(points):g}/s") for name, points in table.items()]
    return markdown_table(["system", *(f"{rate:g}/s" for rate in rates), "goodput rate (>= 90% met)"], rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench.serve", *(argv if argv is not None else sys.argv[1:])])
    started_s = time.monotonic()
    runners = {"compare": run_compare, "sweep": run_sweep, "run": run_single}
    status = runners[args.command](args, command)
    logger.info("done in %.0f s", time.monotonic() - started_s)
    return status


if __name__ == "__main__":
    sys.exit(main())
