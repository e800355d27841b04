"""Soak: thousands of requests through `pdserve up` with hostile ones mixed in; nothing may fail, leak or grow.

    python3 bench/soak.py --num-requests 2000 --concurrency 32 --hostile-fraction 0.1 \\
        --out bench/results/soak.json

Starts `pdserve up` (prefill + decode + proxy, embedded SmolLM2), asks each good request
once alone for its baseline answer, then sends the whole mix (bench/_soak_load.py) at the
given concurrency. Prints success counts, latency percentiles, peak and final pinned blocks
and KV usage, and each process's RSS at the start, after the first half of the requests and
at the end; writes it all as JSON. Exits 1 when a good request failed or changed its answer,
a hostile one got no 4xx, any answer was a 5xx, or blocks stayed pinned or in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, REPO_ROOT)

import httpx  # noqa: E402

from bench._soak_load import Result, build_plan, good_calls, run_plan, send  # noqa: E402
from bench.serving.launch import ServerProcess, descendant_pids, free_port  # noqa: E402

_PROCESS_ROLES = ("proxy", "prefill", "decode")


@dataclass
class Watch:
    """What a background thread saw of the workers and the processes, every `interval_s`."""

    peak_pinned_blocks: int = 0
    peak_kv_usage: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    rss_mib: dict[str, dict[str, float]] = field(default_factory=dict)  # moment -> role -> MiB


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def process_pids(up: ServerProcess) -> dict[str, int]:
    """The proxy's and the workers' pids among `up`'s children, by their command line, and each
    worker's NIXL agent process ("prefill agent", "decode agent"; pools are shared with it)."""
    pids, argvs = {}, {}
    for pid in descendant_pids(up.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argvs[pid] = f.read().split(b"\0")
        role = next((r for r in _PROCESS_ROLES if r.encode() in argvs[pid]), None)
        if role is not None and b"pdserve.app.cli" in argvs[pid]:
            pids[role] = pid
    for role, worker in list(pids.items()):
        for pid in descendant_pids(worker):
            if b"pdserve.transfer.agent_process" in argvs.get(pid, []):
                pids[f"{role} agent"] = pid
    return pids


def load(url: str) -> dict:
    return httpx.get(url + "/load", timeout=5).json()


def watch(urls: dict[str, str], stop: threading.Event, into: Watch, interval_s: float = 0.5) -> None:
    while not stop.wait(interval_s):
        try:
            loads = {role: load(url) for role, url in urls.items()}
        except httpx.HTTPError:
            continue
        into.peak_pinned_blocks = max(into.peak_pinned_blocks, loads["prefill"]["num_pinned_blocks"])
        for role, report in loads.items():
            into.peak_kv_usage[role] = max(into.peak_kv_usage[role], report["kv_usage"])


def start_cluster(num_blocks: int, log_dir: str) -> tuple[ServerProcess, dict[str, str]]:
    ports = {role: free_port() for role in _PROCESS_ROLES}
    argv = [sys.executable, "-m", "pdserve.app.cli", "up", "--port", str(ports["proxy"]), "--prefill-port",
            str(ports["prefill"]), "--decode-port", str(ports["decode"]), "--num-blocks", str(num_blocks),
            "--log-level", "warning"]
    up = ServerProcess("pdserve up", argv, ports["proxy"], os.path.join(log_dir, "up.log"))
    up.start()
    up.wait_ready(600)
    return up, {role: f"http://127.0.0.1:{ports[role]}" for role in ("prefill", "decode")}


async def baselines(base_url: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        answers = {}
        for call in good_calls():
            result = await send(client, 0, call)
            if result.status != 200:
                raise RuntimeError(f"baseline {call.name} failed: {result.status} {result.error}")
            answers[call.name] = result.text
        return answers


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def summarize(results: list[Result], expected: dict[str, str]) -> dict:
    goods = [r for r in results if r.kind == "good"]
    hostiles = [r for r in results if r.kind == "hostile"]
    return {
        "good": {"ok": sum(r.status == 200 and r.text == expected[r.name] for r in goods),
                 "failed": [(r.name, r.status, r.error) for r in goods if r.status != 200],
                 "wrong_answer": [r.name for r in goods if r.status == 200 and r.text != expected[r.name]],
                 "latency_s": percentiles([r.latency_s for r in goods])},
        "hostile": {"4xx": sum(400 <= r.status < 500 for r in hostiles),
                    "not_4xx": [(r.name, r.status, r.error) for r in hostiles if not 400 <= r.status < 500],
                    "latency_s": percentiles([r.latency_s for r in hostiles])},
        "left_mid_stream": sum(r.kind == "leave" for r in results),
        "num_5xx": sum(r.status >= 500 for r in results),
    }


def wait_idle(urls: dict[str, str], timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {role: load(url) for role, url in urls.items()}
        settled = loads["prefill"]["num_pinned_blocks"] == 0 and all(r["kv_usage"] == 0 for r in loads.values())
        if settled or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


def soak(args: argparse.Namespace, log_dir: str) -> dict:
    up, urls = start_cluster(args.num_blocks, log_dir)
    try:
        expected = asyncio.run(baselines(up.base_url))
        pids = process_pids(up)
        seen = Watch()
        seen.rss_mib["start"] = {role: rss_mib(pid) for role, pid in pids.items()}
        done = [0]
        tenth = max(1, args.num_requests // 10)

        def on_done(result: Result) -> None:
            done[0] += 1
            if done[0] % tenth == 0:  # a timeline, so growth can be told from a one-off step
                seen.rss_mib[f"{done[0]}"] = {role: rss_mib(pid) for role, pid in pids.items()}
            if done[0] == args.num_requests // 2:
                seen.rss_mib["half"] = {role: rss_mib(pid) for role, pid in pids.items()}

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(urls, stop, seen), daemon=True)
        watcher.start()
        started = time.monotonic()
        plan = build_plan(args.num_requests, args.hostile_fraction, args.seed)
        results = asyncio.run(run_plan(up.base_url, plan, args.concurrency, on_done))
        duration_s = time.monotonic() - started
        final = wait_idle(urls, args.settle_timeout_s)
        stop.set()
        watcher.join()
        seen.rss_mib["end"] = {role: rss_mib(pid) for role, pid in pids.items()}
    finally:
        up.stop()
    return {"config": vars(args), "duration_s": duration_s, **summarize(results, expected),
            "peak_pinned_blocks": seen.peak_pinned_blocks, "peak_kv_usage": seen.peak_kv_usage,
            "final_pinned_blocks": final["prefill"]["num_pinned_blocks"],
            "final_kv_usage": {role: report["kv_usage"] for role, report in final.items()},
            "rss_mib": seen.rss_mib}


def report(run: dict) -> str:
    good, hostile = run["good"], run["hostile"]
    lines = [
        f"requests {run['config']['num_requests']} at concurrency {run['config']['concurrency']} in "
        f"{run['duration_s']:.0f} s",
        f"good: {good['ok']} ok, {len(good['failed'])} failed, {len(good['wrong_answer'])} wrong answers",
        f"hostile: {hostile['4xx']} got a 4xx, {len(hostile['not_4xx'])} did not; "
        f"{run['left_mid_stream']} clients left mid-stream; 5xx answers: {run['num_5xx']}",
        "", "| latency (s) | mean | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("good", "hostile"):
        stats = run[name]["latency_s"]
        if stats:
            lines.append(f"| {name} | " + " | ".join(f"{stats[k]:.3f}" for k in ("mean", "p50", "p90", "p99", "max"))
                         + " |")
    lines += ["", f"pinned blocks: peak {run['peak_pinned_blocks']}, final {run['final_pinned_blocks']}",
              "KV usage: peak " + ", ".join(f"{r} {v:.1%}" for r, v in run["peak_kv_usage"].items())
              + "; final " + ", ".join(f"{r} {v:.1%}" for r, v in run["final_kv_usage"].items()),
              "", "| RSS (MiB) | start | after half | end | growth in the second half |", "|---|---:|---:|---:|---:|"]
    rss = run["rss_mib"]
    processes = list(rss["start"])  # the roles, then the workers' agent processes
    for role in processes:
        half, end = rss.get("half", {}).get(role, 0.0), rss["end"].get(role, 0.0)
        lines.append(f"| {role} | {rss['start'].get(role, 0.0):.1f} | {half:.1f} | {end:.1f} | {end - half:+.1f} |")
    marks = [key for key in rss if key.isdigit()]
    lines += ["", "RSS (MiB) after every tenth of the requests:", "| process | " + " | ".join(marks) + " |",
              "|---|" + "---:|" * len(marks)]
    for role in processes:
        lines.append(f"| {role} | " + " | ".join(f"{rss[mark].get(role, 0.0):.0f}" for mark in marks) + " |")
    return "\n".join(lines)


def passed(run: dict) -> bool:
    return (not run["good"]["failed"] and not run["good"]["wrong_answer"] and not run["hostile"]["not_4xx"]
            and run["num_5xx"] == 0 and run["final_pinned_blocks"] == 0
            and all(v == 0 for v in run["final_kv_usage"].values()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hostile-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=400, help="per worker (small: every page gets reused)")
    parser.add_argument("--settle-timeout-s", type=float, default=60.0)
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as log_dir:
        run = soak(args, log_dir)
    print(report(run))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(run, f, indent=1, default=str)
    return 0 if passed(run) else 1


if __name__ == "__main__":
    sys.exit(main())
