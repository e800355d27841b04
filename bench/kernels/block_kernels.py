"""Micro-benchmark of the native block matmuls at decode sizes: one SmolLM2 layer's four Q4_1
products (1 and 4 rows) and the Q8_0 output head (1 row), each checked against the dequantized
weights first. The library is cached per source, so comparing two kernels means running this on
two checkouts one after the other (the figures in docs/benchmarks.md were taken that way):

    python -m bench.kernels.block_kernels [--rounds 7] [--out bench/results/block_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch


from bench.kernels.timing import median_ms
from pdserve.kernels.native import cpu_kernels_error, ops
from pdserve.models.quant.blocks import PackedWeight, dequantize, quantize_q4_1, quantize_q8_0

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
HEAD_SHAPE = (49152, 576)


def _check(weight: PackedWeight, x: torch.Tensor, multiply: Callable) -> None:
    expected = x @ dequantize(weight, torch.float32).t()
    error = ((multiply(x, weight.blocks) - expected).abs().max() / expected.abs().max()).item()
    if error > 1e-4:
        raise SystemExit(f"kernel disagrees with the dequantized weights: relative error {error:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="bench/results/block_kernels.json")
    args = parser.parse_args()
    if cpu_kernels_error() is not None:
        raise SystemExit(f"native kernels unavailable: {cpu_kernels_error()}")
    torch.manual_seed(0)
    layer = [quantize_q4_1(torch.randn(n, k)) for n, k in LAYER_SHAPES]
    head = quantize_q8_0(torch.randn(*HEAD_SHAPE))
    results = {}
    for rows in (1, 4):
        xs = [torch.randn(rows, k) for _, k in LAYER_SHAPES]
        for weight, x in zip(layer, xs):
            _check(weight, x, ops().q4_1_linear)

        def layer_products(xs: list[torch.Tensor] = xs) -> None:
            for weight, x in zip(layer, xs):
                ops().q4_1_linear(x, weight.blocks)

        results[f"layer's four Q4_1 products, {rows} row(s)"] = median_ms(layer_products, 30, args.rounds)
    x = torch.randn(1, HEAD_SHAPE[1])
    _check(head, x, ops().q8_0_linear)
    results["Q8_0 output head, 1 row"] = median_ms(lambda: ops().q8_0_linear(x, head.blocks), 5, args.rounds)
    print(f"| product | ms (median of {args.rounds}) |")
    print("|---|---:|")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "median_ms": results}, f, indent=2)


if __name__ == "__main__":
    main()
