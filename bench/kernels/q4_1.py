"""Q4_1 products at decode batch sizes: the float row tiles against the integer lanes, per activation precision.

The embedded model's four layer products (q|k|v, o, gate|up, down: SmolLM2-135M's shapes) on random
Q4_1 blocks, for each row count, through `pdserve_cpu::q4_1_linear_with`: lanes 0 are the float row
tiles (the batched path before the lanes), 16 (AVX-512 VNNI) or 8 (AVX2) the integer lanes with 22-,
15- or 8-bit activations; `q4_1_linear` itself (what a step runs: the one-row kernel at one row,
past 64 rows on AVX-512 (32 on AVX2) the dequantized matmul); the one-row tiles of AVX-512 VNNI CPUs
(`q4_1_tiled_linear`, which the fused layers use for 1-2 rows); and the dequantized matmul itself
(dequantize_blocks, then torch.mm: what prefill-sized batches run).
The variants run in turn within each repeat; each cell is the median over repeats, in milliseconds
per call, and "x tiles" is the float tiles' median over the cell's.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from bench.kernels.clocks import add_timing_arguments, checked_clock
from bench.lib.report import markdown_table

# (name, out_features, in_features) of one SmolLM2-135M layer's products
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
BITS_BY_DIGITS = {3: 22, 2: 15, 1: 8}


def variants(lane_widths: list[int]) -> list[tuple[str, int, int]]:
    """(label, lanes, digits): lanes -1 is `q4_1_linear` as a step calls it, -2 the one-row tiles
    (with AVX-512 VNNI), -3 the dequantized matmul."""
    widest = lane_widths[0]
    out = [("q4_1_linear", -1, 3), ("float tiles", 0, 3)]
    out += [("one-row tiles", -2, 3)] if widest == 16 else []
    out += [("dequantized matmul", -3, 3)]
    out += [(f"lanes {widest}, {BITS_BY_DIGITS[d]}-bit", widest, d) for d in (3, 2, 1)]
    out += [(f"lanes {w}, 22-bit", w, 3) for w in lane_widths[1:]]
    return out


def compiled_lane_widths() -> list[int]:
    from pdserve.kernels import native

    flags = native._cpu_flags()
    return ([16] if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else []) + [8]


def time_calls(calls: dict[str, Callable[[], torch.Tensor]], repeats: int, clock: Callable[[], float]) -> dict:
    samples: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, call in calls.items():
            start = clock()
            call()
            samples[label].append(clock() - start)
    return {label: 1e3 * statistics.median(values) for label, values in samples.items()}


def product_rows(rows_list: list[int], repeats: int, clock: Callable[[], float]) -> list[dict]:
    from pdserve.kernels.native import cpu_kernels_error, ops
    from pdserve.models.quant.blocks import quantize_q4_1

    if cpu_kernels_error() is not None:
        raise SystemExit(f"the native kernels are unavailable: {cpu_kernels_error()}")
    generator = torch.Generator().manual_seed(0)
    table = []
    for name, out_features, in_features in SHAPES:
        blocks = quantize_q4_1(torch.randn(out_features, in_features, generator=generator) * 0.05).blocks
        row_tiles = ops().q4_1_row_tiles(blocks) if ops().q4_1_row_tiles_supported() else None
        for rows in rows_list:
            x = torch.randn(rows, in_features, generator=generator)
            calls = {}
            for label, lanes, digits in variants(compiled_lane_widths()):
                if lanes == -1:
                    calls[label] = lambda x=x: ops().q4_1_linear(x, blocks)
                elif lanes == -2:
                    calls[label] = lambda x=x: ops().q4_1_tiled_linear(x, row_tiles)
                elif lanes == -3:
                    calls[label] = lambda x=x: torch.mm(x, ops().dequantize_blocks(blocks, 20).t())
                else:
                    calls[label] = lambda x=x, lanes=lanes, digits=digits: ops().q4_1_linear_with(x, blocks, lanes,
                                                                                                  digits)
            time_calls(calls, 2, clock)  # warm caches and the library
            medians = time_calls(calls, repeats, clock)
            tiles = medians["float tiles"]
            table.append({"product": name, "rows": rows,
                          "ms": {label: round(ms, 4) for label, ms in medians.items()},
                          "x_tiles": {label: round(tiles / max(ms, 1e-12), 2) for label, ms in medians.items()}})
    return table


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    parser.add_argument("--repeats", type=int, default=30)
    add_timing_arguments(parser, threads=1, clock="cpu")


def run(args: argparse.Namespace) -> tuple[str, dict]:
    clock = checked_clock(args)
    torch.set_num_threads(args.threads)
    table = product_rows(args.rows, args.repeats, clock)
    labels = list(table[0]["ms"])
    header = ["product", "rows", "float tiles ms"] + [f"{label} x tiles" for label in labels if label != "float tiles"]
    body = [[r["product"], r["rows"], r["ms"]["float tiles"]] + [r["x_tiles"][label] for label in labels
                                                                  if label != "float tiles"] for r in table]
    return markdown_table(header, body), {"products": table}
