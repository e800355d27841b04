"""A peer's prefix in its offload tier against one in its pool (`python -m bench.transfer.peer_pin_tier`):
worker A (a prefill worker of the embedded model with a host-memory tier) holds a prefix either in its
pool, or only in its tier (a filler prompt as large as its pool evicted it there). Per prefix length,
side by side: the time of A's `POST /internal/kv/peer_pin` (for a tier hit it includes loading the pages
back into A's pool: pd/peer_pins.py; the copy itself, from A's offload histogram, beside it), and the
time of worker B's answer to the prefix and 32 new tokens (one output token) with a hint naming A, which
pulls the prefix, either way; medians of `--repeats`.
Invariant: every pin is checked (its tokens, and from which medium A lent them, in A's counters) and
released at once; every pull is checked in B's counters; B's cache is reset before each answer.
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
from bench.transfer.peer_pull import AUTH, BLOCK, NEW_TOKENS, TOKEN, answer_s, prompt_of, reset
from pdserve.api.peer_pull import PEER_HINT_HEADER, PEER_PIN_PATH, PeerHint, PeerPinTicket
from pdserve.pd.tickets import RELEASE_PATH

LENGTHS = (64, 256, 512)


def lent(worker: Worker, medium: str) -> float:
    return metric_sum(worker.url, "pdserve_kv_peer_pinned_tokens_total", medium=medium)


def evict(a: Worker, num_pool_blocks: int, salt: int) -> None:
    """A computes a prompt that, with its answer, takes every block of its pool: what it held goes to its tier."""
    answer_s(a, prompt_of(num_pool_blocks * BLOCK - 8, salt), {})


def load_s(worker: Worker) -> float:
    """Seconds A's tier spent copying pages back into its pool, all loads so far."""
    return metric_sum(worker.url, "pdserve_kv_offload_duration_seconds_sum", direction="load")


def pin_s(a: Worker, prefix: list[int], medium: str) -> tuple[float, float]:
    """One pin of `prefix` on A, checked (every full block, lent from `medium`) and released: its round
    trip, and the part of it A's tier spent copying pages."""
    before, loading_before = lent(a, medium), load_s(a)
    started = time.perf_counter()
    response = httpx.post(a.internal_url + PEER_PIN_PATH, json={"token_ids": prefix}, headers=AUTH, timeout=60)
    elapsed_s = time.perf_counter() - started
    response.raise_for_status()
    ticket = PeerPinTicket.model_validate_json(response.content)
    num_full = len(prefix) // BLOCK * BLOCK
    if ticket.num_tokens != num_full or lent(a, medium) - before != num_full:
        raise RuntimeError(f"the pin of {len(prefix)} tokens named {ticket.num_tokens}, not {num_full} from {medium}")
    httpx.post(a.internal_url + RELEASE_PATH, headers=AUTH, timeout=10, json={
        "remote_engine_id": ticket.engine_id, "remote_epoch": ticket.epoch, "remote_request_id": ticket.pin_id,
        "remote_pin_nonce": ticket.nonce}).raise_for_status()
    return elapsed_s, load_s(a) - loading_before


def pull_s(a: Worker, b: Worker, prefix: list[int], prompt: list[int]) -> float:
    reset(b)
    pulled_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled")
    hint = PeerHint(host="127.0.0.1", port=a.internal_port, num_tokens=len(prefix))
    elapsed_s = answer_s(b, prompt, {PEER_HINT_HEADER: hint.to_header()})
    pulled = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before
    if pulled != len(prefix) // BLOCK * BLOCK:
        raise RuntimeError(f"B pulled {pulled} tokens of a {len(prefix)}-token prefix")
    return elapsed_s


def measure(a: Worker, b: Worker, length: int, repeats: int, num_pool_blocks: int) -> dict:
    times: dict[str, list[float]] = {"pin_pool_s": [], "pin_tier_s": [], "tier_copy_s": [], "pull_pool_s": [],
                                     "pull_tier_s": []}
    for repeat in range(repeats):
        prefix = prompt_of(length, salt=length * 100 + repeat)
        prompt = prefix + prompt_of(NEW_TOKENS, salt=7 + repeat)
        answer_s(a, prefix + [1], {})
        evict(a, num_pool_blocks, salt=5000 + repeat)
        pin_tier_s, tier_copy_s = pin_s(a, prefix, "offload")  # loaded back into A's pool by the pin
        times["pin_tier_s"].append(pin_tier_s)
        times["tier_copy_s"].append(tier_copy_s)
        times["pin_pool_s"].append(pin_s(a, prefix, "device")[0])
        evict(a, num_pool_blocks, salt=6000 + repeat)
        times["pull_tier_s"].append(pull_s(a, b, prefix, prompt))
        times["pull_pool_s"].append(pull_s(a, b, prefix, prompt))
        reset(a)
    return {"prefix_tokens": length, **{name: statistics.median(values) for name, values in times.items()},
            "all": times}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prefix lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "peer_pin_tier.json"))
    args = parser.parse_args(argv)
    lengths = [int(text) for text in args.lengths.split(",")]
    # Room for a pin's tier pages: at most half the pool's free blocks (pd/peer_pins.py, MAX_FREE_SHARE).
    num_pool_blocks = 2 * max(lengths) // BLOCK + 8
    logs = tempfile.mkdtemp(prefix="peer-pin-tier-")
    pull_every_hint = ["--internal-token", TOKEN, "--peer-pull-min-tokens", str(BLOCK),
                       "--peer-pull-decision", "threshold"]
    a = Worker("prefill", free_port(), os.path.join(logs, "a.log"),
               ["--num-blocks", str(num_pool_blocks + 1), "--kv-offload-bytes", "256MiB", *pull_every_hint],
               args.device)
    b = Worker("prefill", free_port(), os.path.join(logs, "b.log"),
               ["--num-blocks", str(num_pool_blocks + 64), *pull_every_hint], args.device)
    started = start_workers(a, b)
    try:
        measure(a, b, 64, 1, num_pool_blocks)  # warm-up: B's handshake and NIXL connection to A
        rows = [measure(a, b, length, args.repeats, num_pool_blocks) for length in lengths]
    finally:
        stop_all(a, b, *started)
    print(markdown_table(
        ("prefix tokens", "pin, pool ms", "pin, tier ms", "tier - pool ms", "of it, page copy ms",
         "B's answer, pool ms", "B's answer, tier ms", "tier / pool"),
        [(r["prefix_tokens"], cell(r["pin_pool_s"], ".1f", 1e3), cell(r["pin_tier_s"], ".1f", 1e3),
          cell(r["pin_tier_s"] - r["pin_pool_s"], ".1f", 1e3), cell(r["tier_copy_s"], ".2f", 1e3),
          cell(r["pull_pool_s"], ".1f", 1e3),
          cell(r["pull_tier_s"], ".1f", 1e3), cell(r["pull_tier_s"] / r["pull_pool_s"], ".2f")) for r in rows]))
    write_document(args.out, {"command": " ".join(["python -m bench.transfer.peer_pin_tier", *(argv or sys.argv[1:])]),
                              "new_tokens": NEW_TOKENS, "device": args.device, "num_pool_blocks": num_pool_blocks,
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
