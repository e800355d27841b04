"""Peer pull against recompute (`python -m bench.transfer.peer_pull`): two prefill workers of the
embedded model; for each prefix length, worker B answers a prompt (the prefix and 32 new tokens, one
output token) either computing it all from an empty cache, or with a peer hint naming worker A, which
computed the prefix before: B then pulls A's blocks over NIXL and computes only the new tokens. The
time of B's answer, median of `--repeats`, side by side; the crossover is the shortest prefix where the
pull wins. Invariant: both cases of a length send B the same prompt from an empty prefix cache on B,
one request at a time, and each pull is checked in B's counters (pulled tokens equal the prefix's full
blocks; otherwise the run stops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Optional, Sequence

import httpx

from bench.lib.launch import REPO_ROOT, Worker, free_port, metric_sum, start_workers, stop_all
from bench.lib.report import cell, markdown_table, write_document
from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint

TOKEN = "bench-peer-pull"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}
BLOCK = 16
NEW_TOKENS = 32
LENGTHS = (32, 64, 128, 256, 1024, 2048)


def prompt_of(length: int, salt: int) -> list[int]:
    return [100 + (i * 31 + salt * 997) % 20_000 for i in range(length)]


def answer_s(worker: Worker, prompt: list[int], headers: dict) -> float:
    started = time.perf_counter()
    response = httpx.post(worker.url + "/v1/completions", headers={**AUTH, **headers}, timeout=600,
                          json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - started


def reset(worker: Worker) -> None:
    httpx.post(worker.internal_url + "/internal/kv/reset_prefix_cache", headers=AUTH, timeout=30).raise_for_status()


def measure(a: Worker, b: Worker, length: int, repeats: int) -> dict:
    recompute, pull = [], []
    for repeat in range(repeats):
        prefix = prompt_of(length, salt=length * 100 + repeat)
        prompt = prefix + prompt_of(NEW_TOKENS, salt=7 + repeat)
        reset(b)
        recompute.append(answer_s(b, prompt, {}))
        reset(b)
        answer_s(a, prefix + [1], {})  # A holds the prefix's full blocks
        hint = PeerHint(host="127.0.0.1", port=a.internal_port, num_tokens=length)
        pulled_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled")
        pull.append(answer_s(b, prompt, {PEER_HINT_HEADER: hint.to_header()}))
        pulled = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before
        if pulled != length // BLOCK * BLOCK:
            raise RuntimeError(f"prefix {length}: B pulled {pulled} tokens, expected {length // BLOCK * BLOCK}")
        reset(a)
    return {"prefix_tokens": length, "recompute_s": statistics.median(recompute), "pull_s": statistics.median(pull),
            "recompute_all_s": recompute, "pull_all_s": pull}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prefix lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "peer_pull.json"))
    args = parser.parse_args(argv)
    lengths = [int(text) for text in args.lengths.split(",")]
    logs = tempfile.mkdtemp(prefix="peer-pull-")
    common = ["--num-blocks", str(2 * max(lengths) // BLOCK + 64), "--internal-token", TOKEN,
              "--peer-pull-min-tokens", str(BLOCK), "--peer-pull-decision", "threshold",  # pull at every length
              "--num-threads", str(args.num_threads)]
    a, b = (Worker("prefill", free_port(), os.path.join(logs, f"{name}.log"), common, args.device) for name in "ab")
    started = start_workers(a, b)
    try:
        answer_s(b, prompt_of(64, 1), {})  # warm both up, and B's connection to A (handshake, NIXL connect)
        measure(a, b, 64, 1)
        rows = [measure(a, b, length, args.repeats) for length in lengths]
    finally:
        stop_all(a, b, *started)
    print(markdown_table(("prefix tokens", "recompute ms", "pull ms", "recompute / pull"),
                         [(r["prefix_tokens"], cell(r["recompute_s"], ".1f", 1e3), cell(r["pull_s"], ".1f", 1e3),
                           cell(r["recompute_s"] / r["pull_s"], ".2f")) for r in rows]))
    wins = [r["prefix_tokens"] for r in rows if r["pull_s"] < r["recompute_s"]]
    print(f"crossover: the pull wins from {min(wins)} prefix tokens on" if wins else "the pull never won")
    write_document(args.out, {"command": " ".join(["python -m bench.transfer.peer_pull", *(argv or sys.argv[1:])]),
                              "new_tokens": NEW_TOKENS, "device": args.device, "num_threads": args.num_threads,
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
