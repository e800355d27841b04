"""Single-row float32 products at SmolLM2's decode sizes: BLAS (`F.linear`) against pdserve's
native kernel (`pdserve_cpu::f32_row_linear`), rounds interleaved in one process, after checking
that both agree.

    python -m bench.kernels.float_row_linear [--rounds 7] [--out bench/results/float_row_linear.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F


from bench.kernels.timing import mean_ms
from pdserve.kernels.native import cpu_kernels_error, ops

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
HEAD_SHAPE = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="bench/results/float_row_linear.json")
    args = parser.parse_args()
    if cpu_kernels_error() is not None:
        raise SystemExit(f"native kernels unavailable: {cpu_kernels_error()}")
    weights = [torch.randn(n, k) for n, k in LAYER_SHAPES]
    xs = [torch.randn(1, k) for _, k in LAYER_SHAPES]
    head, x_head = torch.randn(*HEAD_SHAPE), torch.randn(1, HEAD_SHAPE[1])
    for weight, x in zip(weights + [head], xs + [x_head]):
        torch.testing.assert_close(ops().f32_row_linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    variants = {"BLAS (F.linear)": F.linear, "native f32_row_linear": ops().f32_row_linear}
    samples = {name: {"layer": [], "head": []} for name in variants}
    for _ in range(args.rounds):
        for name, multiply in variants.items():
            samples[name]["layer"].append(mean_ms(lambda f=multiply: [f(x, w) for w, x in zip(weights, xs)], 20))
            samples[name]["head"].append(mean_ms(lambda f=multiply: f(x_head, head), 10))
    medians = {name: {part: statistics.median(values) for part, values in parts.items()}
               for name, parts in samples.items()}
    print(f"| product (1 row, float32) | {' | '.join(variants)} |")
    print("|---|---:|---:|")
    print("| a layer's four products (ms) | " + " | ".join(f"{medians[n]['layer']:.3f}" for n in variants) + " |")
    print("| output head 49152 x 576 (ms) | " + " | ".join(f"{medians[n]['head']:.3f}" for n in variants) + " |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "median_ms": medians}, f, indent=2)


if __name__ == "__main__":
    main()
