"""Chaos (`python -m bench.chaos`): SIGKILL the prefill worker, a decode worker or the proxy at forced
phases (bench/chaos/phases.py) under mixed load through the proxy, restart it, and count what each
kill cost per victim and phase (requests ok / cut / lost / wrong / hung, leaked blocks, failed
survivors, recovery time). Good requests are judged against their greedy baseline, asked once alone.
Exits 1 on any cascade, wrong token, hang, leak, missing recovery or request lost to a prefill death.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Optional

import httpx

from bench.chaos.cluster import AUTH, ChaosCluster
from bench.chaos.load import HANG_S, MixedLoad
from bench.chaos.phases import PHASES, PREFILL_CALL, READ_PHASES, STREAM_CALL, Kill, Stage, run_kill
from bench.chaos.report import charge, failures, format_table, rows
from bench.lib.report import write_document
from bench.lib.workloads import baselines, good_calls


def schedule(args: argparse.Namespace, rng: random.Random) -> list[tuple[str, str]]:
    """(victim, phase) per kill: `--plan` cycles its list; else a named phase repeats, `read` cycles
    the READ phases, `any` draws."""
    if args.plan:
        steps = [tuple(step.split("/", 1)) for step in args.plan.split(",")]
        for victim, phase in steps:
            if phase not in PHASES.get(victim, ()):
                raise SystemExit(f"no phase {victim}/{phase}")
        return [steps[index % len(steps)] for index in range(args.kills)]
    plan = []
    for index in range(args.kills):
        victim = args.victim if args.victim != "any" else rng.choice(sorted(PHASES))
        if args.phase == "read":
            phase = READ_PHASES[index % len(READ_PHASES)]
        elif args.phase == "any":
            phase = rng.choice(PHASES[victim])
        else:
            phase = args.phase
        if phase not in PHASES[victim]:
            raise SystemExit(f"{victim} has no phase {phase!r}; it has {', '.join(PHASES[victim])}")
        plan.append((victim, phase))
    return plan


def expected_answers(cluster: ChaosCluster) -> dict[str, str]:
    """Greedy baselines through the proxy; the long prompt's from a decode worker computing it alone
    (what serves it once the prefill worker is dead)."""
    expected = baselines(cluster.proxy.url, [*good_calls(), STREAM_CALL], HANG_S)
    direct = httpx.post(cluster.workers[cluster.decode_names[0]].url + PREFILL_CALL.path, json=PREFILL_CALL.body,
                        headers=AUTH, timeout=120)
    direct.raise_for_status()
    expected[PREFILL_CALL.name] = direct.json()["choices"][0]["text"]
    return expected


def run(args: argparse.Namespace, log_dir: str, on_kill=print) -> dict:
    rng = random.Random(args.seed)
    plan = schedule(args, rng)
    cluster = ChaosCluster(log_dir, args.device, args.num_decode).start()
    kills: list[Kill] = []
    started = time.monotonic()
    try:
        expected = expected_answers(cluster)
        load = MixedLoad(cluster.proxy.url, args.load_threads, args.seed).start()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            stage = Stage(cluster, load, expected, rng, pool)
            for number, (victim, phase) in enumerate(plan, 1):
                kill = run_kill(stage, victim, phase)
                kills.append(kill)
                on_kill(f"kill {number}/{len(plan)}: {victim}/{phase} ({kill.process}) forced={kill.forced} "
                        f"recovery={kill.recovery_s and round(kill.recovery_s, 1)}s leaked={kill.leaked or 0} "
                        f"prefill_died={kill.prefill_died} agent_restarts={kill.agent_restarts} {kill.note}")
        load.stop()
    finally:
        cluster.stop()
    counts = charge(kills, load.results, expected)
    table = rows(kills, counts)
    return {"config": vars(args), "duration_s": time.monotonic() - started, "table": table,
            "failures": failures(kills, table), "requests": len(load.results) + sum(len(k.own) for k in kills),
            "kills": [_kill_record(k) for k in kills]}


def _kill_record(kill: Kill) -> dict:
    record = asdict(kill)
    record.pop("own")
    record["recovery_s"] = kill.recovery_s
    return record


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--victim", choices=("any", *sorted(PHASES)), default="any")
    parser.add_argument("--phase", default="any",
                        help="a phase of the victim (" + "; ".join(f"{v}: {', '.join(p)}" for v, p in PHASES.items())
                             + "), 'read' (decode's READ phases in turn) or 'any'")
    parser.add_argument("--plan", default=None,
                        help="victim/phase,... cycled over the kills (e.g. prefill/in-prefill,decode/mid-read)")
    parser.add_argument("--load-threads", type=int, default=3, help="clients sending good requests meanwhile")
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here")
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.phase == "read" and args.victim not in ("decode", "any"):
        parser.error("--phase read needs --victim decode")
    if args.phase == "read":
        args.victim = "decode"
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        result = run(args, args.log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="chaos-") as log_dir:
            result = run(args, log_dir)
    print(f"\n{len(result['kills'])} kills, {result['requests']} requests in {result['duration_s']:.0f} s\n")
    print(format_table(result["table"]))
    for failure in result["failures"]:
        print("FAILED:", failure)
    if args.out:
        write_document(args.out, json.loads(json.dumps(result, default=str)))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
