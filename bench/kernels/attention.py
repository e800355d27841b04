"""Paged decode attention at the embedded model's shapes over token-major and heads-outermost pages.

9 query heads over 3 KV heads of 64, block size 16, one query row (CPU, native kernel, float32)
or `--rows` rows (CUDA, the eager torch path, bfloat16) at several context lengths, each call on
another layer slot of one 30-layer pool, as a decode step walks them (keys come from memory, not
cache). The two page layouts run back to back per context length: `token` (P/D protocol 2: tokens
outer, heads inner) and `head` (today's, heads outermost: pdserve/kv/layout.py), the same kernel
reading both through strided views. On the CPU the table also shows the head layout less a
one-key call (the Python and dispatch cost).
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.timing import median_ms
from bench.lib.report import markdown_table
from pdserve.kernels.native import cpu_kernels_error, ops
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import FullAttentionSpec
from pdserve.runner.decode_attention import attend_decode_torch, build_decode_rows

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, HEADS = 30, 16, 3, 64, 9
LAYOUTS = ("token", "head")


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--keys", type=int, nargs="+", default=[200, 400, 1000, 2000])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=16, help="decode rows per call (--device cuda)")


def layer_caches(layout: str, num_blocks: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (k_cache, v_cache) views [blocks, block_size, kv_heads, head_dim] of one pool."""
    if layout == "token":  # [block, layer, K/V, token, head, dim]
        pool = torch.randn(num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device).to(dtype)
        return [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(LAYERS)]
    geometry = KVPoolLayout(num_blocks, LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
    pool = geometry.allocate(device)
    pool.copy_(torch.randn(geometry.shape, device=device))
    return [geometry.layer_view(pool, layer) for layer in range(LAYERS)]


def cuda_microseconds_per_call(keys: int, rows: int, rounds: int, layout: str) -> float:
    """The torch decode attention (what a GPU runs eagerly) for `rows` rows of `keys` keys each, bf16."""
    per_row = keys // BLOCK_SIZE + 1
    slots = layer_caches(layout, rows * per_row + 1, "cuda", torch.bfloat16)
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]
    decode_rows = build_decode_rows(FullAttentionSpec(), tables, [keys] * rows, BLOCK_SIZE, torch.device("cuda"),
                                    include_query_key=False)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(rows, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def every_layer() -> None:
        for k_cache, v_cache in slots:
            attend_decode_torch(q, k_cache, v_cache, decode_rows, HEAD_DIM**-0.5, k_new, k_new)
        torch.cuda.synchronize()

    return median_ms(every_layer, 5, rounds) / LAYERS * 1000


def microseconds_per_call(keys: int, rounds: int, layout: str = "head") -> float:
    num_blocks = keys // BLOCK_SIZE + 2
    slots = layer_caches(layout, num_blocks)
    table = torch.arange(1, num_blocks, dtype=torch.int32)[None, :]
    q = torch.randn(1, HEADS, HEAD_DIM)
    start, end = torch.tensor([0], dtype=torch.int32), torch.tensor([keys], dtype=torch.int32)
    k_new, v_new = torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    attend = ops().paged_decode_attention

    def every_layer() -> None:
        for k_cache, v_cache in slots:
            attend(q, k_cache, v_cache, table, start, end, k_new, v_new, HEAD_DIM**-0.5)

    return median_ms(every_layer, 10, rounds) / LAYERS * 1000


def run(args: argparse.Namespace) -> tuple[str, dict]:
    torch.manual_seed(0)
    if args.device == "cuda":
        measure = lambda keys, layout: cuda_microseconds_per_call(keys, args.rows, args.rounds, layout)  # noqa: E731
        last_column, last = "rows", lambda value: args.rows  # noqa: E731
        record = {"device": torch.cuda.get_device_name()}
    else:
        if cpu_kernels_error() is not None:
            raise SystemExit(f"native kernels unavailable: {cpu_kernels_error()}")
        overhead = microseconds_per_call(1, args.rounds)
        measure = lambda keys, layout: microseconds_per_call(keys, args.rounds, layout)  # noqa: E731
        last_column = f"head less a one-key call ({overhead:.1f} us)"
        last = lambda value: f"{value['head'] - overhead:.1f}"  # noqa: E731
        record = {"one_key_us": overhead}
    results = {keys: {layout: measure(keys, layout) for layout in LAYOUTS} for keys in args.keys}
    table = markdown_table(
        ["keys", "token layout, us per call", "head layout, us per call", "head / token", last_column],
        [(keys, f"{v['token']:.1f}", f"{v['head']:.1f}", f"{v['head'] / v['token']:.2f}", last(v))
         for keys, v in results.items()])
    return table, record | {"us_per_call": results}
