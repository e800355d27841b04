"""Decode-step time with each layer as one native call (the default on the CPU) against the
per-op step it replaces, side by side in one process on the embedded model.

    python -m bench.kernels.fused_layer [--dtype auto|float32] [--concurrency 1] [--rounds 5] [--steps 16]

Both variants share one engine; rounds alternate between them so that outside load hits both
alike. Prints the median milliseconds per engine step (schedule, forward, sampling) of each and
their ratio, and writes the samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.kernels.decode_step import make, step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto: the GGUF's blocks; float32: the exact mode")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default="bench/results/fused_layer.json")
    args = parser.parse_args()

    built = make(args.dtype, False)
    loop = built.engine.engine_loop
    decode_step = loop.runner.decode_step
    fused = decode_step._fused
    if fused is None:
        raise SystemExit("this model or machine does not take the fused layer (no native kernels?)")
    prompt = list(range(1000, 1180))
    samples: dict[str, list[float]] = {"fused (one call a layer)": [], "per-op": []}
    with torch.inference_mode():
        step_ms(loop, prompt, args.concurrency, 4)  # warm-up
        for _ in range(args.rounds):
            for name in samples:
                decode_step._fused = fused if name.startswith("fused") else None
                samples[name].append(step_ms(loop, prompt, args.concurrency, args.steps))
    decode_step._fused = fused
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"| variant ({args.dtype}, c={args.concurrency}) | ms per step (median of {args.rounds}) |")
    print("|---|---:|")
    for name, value in medians.items():
        print(f"| {name} | {value:.1f} |")
    ratio = medians["per-op"] / medians["fused (one call a layer)"]
    print(f"fused is {ratio:.2f}x the per-op step")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "samples_ms": samples, "medians_ms": medians, "speedup": ratio}, f, indent=2)
    built.close()


if __name__ == "__main__":
    main()
