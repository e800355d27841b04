"""Decode-step time of the in-process engine with small-batch matmuls as F.linear
(baseline) versus weight @ x.T (what the models use), side by side in one process.

    python3 bench/decode_step.py [--rounds 3] [--out bench/results/decode_step.json]

Prints a table and writes JSON; the figures are ratios on the same engine and weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pdserve.models.layers as layers  # noqa: E402
from pdserve.models.loader import load_model  # noqa: E402
from pdserve.request import GenerationRequest  # noqa: E402
from tests.engine.harness import greedy, make_engine  # noqa: E402

VARIANTS = {"F.linear (baseline)": 1, "weight @ x.T": 256}  # the small-batch row threshold


def step_ms(loop, prompt: list[int], concurrency: int, num_steps: int) -> float:
    """Mean wall time of `num_steps` decode steps with `concurrency` requests running."""
    for index in range(concurrency):
        request_id = f"c{concurrency}-{index}-{time.monotonic_ns()}"
        loop.submit(GenerationRequest(request_id, tuple(prompt), greedy(num_steps + 8, ignore_eos=True)), lambda o: None)
    loop._drain_inbox(block=False)
    while any(r.num_computed_tokens < len(prompt) for r in loop.scheduler.requests.values()):
        loop.step()
    started = time.perf_counter()
    for _ in range(num_steps):
        loop.step()
    elapsed = (time.perf_counter() - started) / num_steps
    loop.run_until_idle()
    return elapsed * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="bench/results/decode_step.json")
    args = parser.parse_args()
    engine = make_engine(loaded=load_model(None, torch.float32, torch.device("cpu")), num_blocks=2048)
    prompt = list(range(1000, 1180))
    results: dict[str, dict[int, list[float]]] = {name: {1: [], 16: []} for name in VARIANTS}
    for _ in range(args.rounds):  # interleaved so background load hits both alike
        for name, threshold in VARIANTS.items():
            layers._SMALL_BATCH_ROWS = threshold
            for concurrency in (1, 16):
                results[name][concurrency].append(step_ms(engine.engine.engine_loop, prompt, concurrency, args.steps))
    base = {c: statistics.median(results["F.linear (baseline)"][c]) for c in (1, 16)}
    print(f"{'variant':<22} {'c=1 ms/step':>12} {'c=16 ms/step':>13} {'c=16 vs baseline':>17}")
    summary = {}
    for name in VARIANTS:
        medians = {c: statistics.median(results[name][c]) for c in (1, 16)}
        summary[name] = {"median_ms": medians, "runs_ms": results[name]}
        print(f"{name:<22} {medians[1]:>12.1f} {medians[16]:>13.1f} {base[16] / medians[16]:>16.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
