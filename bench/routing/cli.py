"""Routing benchmark (`python -m bench.routing`): a multi-turn chat workload through `pdserve proxy`
with each routing policy in turn over two prefill and two decode workers: prompt tokens computed,
prefix-cache hits, TTFT, KV bytes pulled, turns without a prefill leg, tokens pulled from peers.
`--rounds N` alternates the policies (A B A B ...) and pools each one's turns; a "+peer" policy's
figures are also given over the same policy without peer pulls (its off arm).
Invariant: every policy runs the same conversations (same seeds: questions, arrivals, think times)
on the same warm workers, each from empty prefix caches, one policy at a time.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Optional, Sequence

from bench.lib.launch import REPO_ROOT, LaunchError, metric_sum
from bench.lib.load import run_conversations
from bench.lib.machine import CpuMeter, wait_for_idle
from bench.routing.cluster import ClusterSpec, RoutingCluster, scrape
from bench.routing.report import PEER, PolicyResult, format_table, merge, plot, summarize, verdict, write_json
from bench.routing.workload import THINK_DISTRIBUTIONS, WorkloadSpec, build_conversations

logger = logging.getLogger("bench.routing")
POLICIES = ("round_robin", "least_loaded", "prefix", "kv_aware")
PROXY_COUNTERS = ("pdserve_proxy_kv_prediction_error_tokens_sum",)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = WorkloadSpec()
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, run in this order; a policy with +peer (round_robin+peer) runs it "
                             "with peer pulls (the proxy's --peer-pull)")
    parser.add_argument("--num-conversations", type=int, default=defaults.num_conversations)
    parser.add_argument("--min-turns", type=int, default=defaults.min_turns)
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
    parser.add_argument("--num-system-prompts", type=int, default=defaults.num_system_prompts)
    parser.add_argument("--conversations-per-s", type=float, default=defaults.conversations_per_s,
                        help="Poisson arrivals of conversations; 0: all at once (N concurrent users)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="tokens per answer")
    parser.add_argument("--think-time-s", "--think-s", type=float, default=defaults.think_time_s,
                        help="after each answer; the mean with --think-distribution exponential")
    parser.add_argument("--think-distribution", choices=THINK_DISTRIBUTIONS, default=defaults.think_distribution)
    parser.add_argument("--rounds", type=int, default=1, help="run the policy list this many times, alternating")
    parser.add_argument("--num-decode", type=int, default=ClusterSpec().num_decode, help="decode workers")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--num-blocks", type=int, default=ClusterSpec().num_blocks, help="KV pool per worker")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "routing.json"))
    parser.add_argument("--plot-dir", default=None, help="write PNG plots here")
    parser.add_argument("--log-dir", default=None, help="process logs (default: a temporary directory)")
    parser.add_argument("--wait-for-idle-s", type=float, default=0.0,
                        help="before each policy, wait up to this long for the machine to go idle (0: do not wait)")
    args = parser.parse_args(argv)
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = {p.removesuffix(PEER) for p in args.policy_list} - set(POLICIES)
    if unknown or args.rounds < 1:
        parser.error(f"unknown policies: {sorted(unknown)}" if unknown else "--rounds must be >= 1")
    return args


def workload_of(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(num_conversations=args.num_conversations, min_turns=args.min_turns, max_turns=args.max_turns,
                        num_system_prompts=args.num_system_prompts, conversations_per_s=args.conversations_per_s,
                        max_tokens=args.max_tokens, think_time_s=args.think_time_s,
                        think_distribution=args.think_distribution, seed=args.seed)


def _delta(before: dict, after: dict, names: Sequence[str], metric: str) -> float:
    return sum(after[name][metric] - before[name][metric] for name in names)


def measure_policy(cluster: RoutingCluster, policy: str, spec: WorkloadSpec, wait_for_idle_s: float) -> PolicyResult:
    cluster.reset()
    if wait_for_idle_s > 0:
        wait_for_idle(wait_for_idle_s)
    proxy = cluster.start_proxy(policy)
    try:
        conversations = build_conversations(spec)
        num_turns = sum(len(c.questions) for c in conversations)
        before = cluster.counters()
        pulled_before = cluster.peer_pulled_tokens()
        meter = CpuMeter(cluster.pids())
        meter.start()
        done = [0]
        started_s = time.monotonic()

        def on_turn() -> None:
            done[0] += 1
            if done[0] % 10 == 0:
                logger.info("%s: %d/%d turns, %.0f s", policy, done[0], num_turns, time.monotonic() - started_s)

        body = {"max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        result = run_conversations(proxy.base_url, conversations, body, on_turn)
        foreign = meter.foreign_fraction()
        cluster.wait_idle()
        after = cluster.counters()
        peer_pulled = cluster.peer_pulled_tokens() - pulled_before
        proxy_counts = scrape(proxy.base_url, PROXY_COUNTERS)
        decode_only = metric_sum(proxy.base_url, "pdserve_proxy_requests_total", mode="decode_only")
    finally:
        cluster.stop_proxy()
    summary = summarize(policy, result)
    summary.foreign_cpu_fraction = foreign
    prefills, decodes = [w.name for w in cluster.prefills], [w.name for w in cluster.decodes]
    ok_records = [r for r in result.records if r.ok]
    computed = "pdserve_engine_computed_prompt_tokens_total"
    return PolicyResult(
        policy=policy, summary=summary, result=result, prompt_tokens=sum(r.num_prompt_tokens for r in ok_records),
        computed_prefill_tokens=_delta(before, after, prefills, computed),
        computed_decode_tokens=_delta(before, after, decodes, computed),
        kv_bytes_pulled=_delta(before, after, decodes, "pdserve_transfer_bytes_total"),
        kv_events=_delta(before, after, [*prefills, *decodes], "pdserve_kv_events_total"),
        decode_only_turns=decode_only,
        prediction_error_tokens=proxy_counts[PROXY_COUNTERS[0]] if policy == "kv_aware" else None,
        peer_pulled_tokens=peer_pulled,
    )


def run(args: argparse.Namespace, command: str) -> int:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-routing-bench-")
    os.makedirs(log_dir, exist_ok=True)
    spec = workload_of(args)
    cluster = RoutingCluster(ClusterSpec(num_decode=args.num_decode, num_blocks=args.num_blocks, log_dir=log_dir))
    rounds: dict[str, list[PolicyResult]] = {policy: [] for policy in args.policy_list}
    load_before = os.getloadavg()
    try:
        cluster.start()
        for round_index in range(args.rounds):
            for policy in args.policy_list:
                logger.info("round %d, policy %s", round_index + 1, policy)
                rounds[policy].append(measure_policy(cluster, policy, spec, args.wait_for_idle_s))
    except LaunchError as exc:
        logger.error("benchmark aborted: %s", exc)
        return 2
    finally:
        cluster.stop()
    results = [merge(runs) for runs in rounds.values()]
    print(format_table(results))
    for line in verdict(results):
        print(line)
    print(f"load average before: {load_before}, after: {os.getloadavg()}")
    extra = {"load_average_before": load_before, "load_average_after": os.getloadavg(),
             "log_dir": log_dir, "rounds": args.rounds}
    write_json(args.out, command, spec.describe(), asdict(cluster.spec), results, extra)
    logger.info("wrote %s", args.out)
    if args.plot_dir:
        for path in plot(results, args.plot_dir):
            logger.info("wrote %s", path)
    return 0 if all(r.summary.num_failed == 0 for r in results) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench.routing", *(argv if argv is not None else sys.argv[1:])])
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
