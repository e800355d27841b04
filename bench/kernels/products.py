"""One row's products at SmolLM2's decode sizes, native block kernels and float32 against BLAS.

Q4_1 block products (a layer's four) and the Q8_0 head through the native kernels; float32 rows
through BLAS (`F.linear`) against the native `f32_row_linear`. Each is checked first against the
dequantized weights (or BLAS)."""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from bench.kernels.timing import mean_ms, median_ms
from bench.lib.report import markdown_table
from pdserve.kernels.native import cpu_kernels_error, ops
from pdserve.models.quant.blocks import PackedWeight, dequantize, quantize_q4_1, quantize_q8_0

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
HEAD_SHAPE = (49152, 576)


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--rounds", type=int, default=7)


def _check(weight: PackedWeight, x: torch.Tensor, multiply: Callable) -> None:
    expected = x @ dequantize(weight, torch.float32).t()
    error = ((multiply(x, weight.blocks) - expected).abs().max() / expected.abs().max()).item()
    if error > 1e-4:
        raise SystemExit(f"kernel disagrees with the dequantized weights: relative error {error:.2e}")


def block_products(rounds: int) -> dict[str, float]:
    """Median ms of a layer's four Q4_1 products (1 and 4 rows) and of the Q8_0 head (1 row)."""
    torch.manual_seed(0)
    layer = [quantize_q4_1(torch.randn(n, k)) for n, k in LAYER_SHAPES]
    head = quantize_q8_0(torch.randn(*HEAD_SHAPE))
    results = {}
    for rows in (1, 4):
        xs = [torch.randn(rows, k) for _, k in LAYER_SHAPES]
        for weight, x in zip(layer, xs):
            _check(weight, x, ops().q4_1_linear)
        products = lambda xs=xs: [ops().q4_1_linear(x, w.blocks) for w, x in zip(layer, xs)]  # noqa: E731
        results[f"a layer's four Q4_1 products, {rows} row(s), native"] = median_ms(products, 30, rounds)
    x = torch.randn(1, HEAD_SHAPE[1])
    _check(head, x, ops().q8_0_linear)
    results["Q8_0 output head, 1 row, native"] = median_ms(lambda: ops().q8_0_linear(x, head.blocks), 5, rounds)
    return results


def float_products(rounds: int) -> dict[str, float]:
    """Median ms of a layer's four float32 products and of the float32 head, one row, BLAS and native."""
    weights = [torch.randn(n, k) for n, k in LAYER_SHAPES]
    xs = [torch.randn(1, k) for _, k in LAYER_SHAPES]
    head, x_head = torch.randn(*HEAD_SHAPE), torch.randn(1, HEAD_SHAPE[1])
    for weight, x in zip(weights + [head], xs + [x_head]):
        torch.testing.assert_close(ops().f32_row_linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    variants = {"BLAS (F.linear)": F.linear, "native f32_row_linear": ops().f32_row_linear}
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, multiply in variants.items():
            layer = f"a layer's four float32 products, 1 row, {name}"
            samples.setdefault(layer, []).append(mean_ms(lambda f=multiply: [f(x, w) for w, x in zip(weights, xs)], 20))
            samples.setdefault(f"float32 head 49152 x 576, 1 row, {name}", []).append(
                mean_ms(lambda f=multiply: f(x_head, head), 10))
    return {name: statistics.median(values) for name, values in samples.items()}


def run(args: argparse.Namespace) -> tuple[str, dict]:
    if cpu_kernels_error() is not None:
        raise SystemExit(f"native kernels unavailable: {cpu_kernels_error()}")
    results = block_products(args.rounds) | float_products(args.rounds)
    table = markdown_table(["product", f"ms (median of {args.rounds})"],
                           [(name, f"{value:.3f}") for name, value in results.items()])
    return table, {"median_ms": results}
