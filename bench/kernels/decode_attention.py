"""Micro-benchmark of the native decode attention at the embedded model's shapes (9 query heads
over 3 KV heads of 64, block size 16) for one query row at several context lengths, each call on
a different layer slot of one 30-layer pool, as a decode step walks them (so the keys come from
memory, not cache). The library is cached per source, so comparing two kernels means running
this on two checkouts one after the other; the two page layouts are compared side by side in one
run: `token` (the pages of P/D protocol 2: tokens outer, heads inner) and `head` (today's, heads
outermost: pdserve/kv/layout.py), the same kernel reading both through strided views:

    python -m bench.kernels.decode_attention [--keys 200 400 1000 2000] [--out bench/results/decode_attention.json]
    python -m bench.kernels.decode_attention --device cuda --rows 16   # the torch path on a GPU, bfloat16

Prints microseconds per call per layout, the head layout's time over the token layout's, and the
same less a one-key call (the Python and dispatch cost).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


from bench.kernels.timing import median_ms
from pdserve.runner.decode_attention import attend_decode_torch, build_decode_rows
from pdserve.kernels.native import cpu_kernels_error, ops
from pdserve.kv.specs import FullAttentionSpec
from pdserve.kv.layout import KVPoolLayout

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, HEADS = 30, 16, 3, 64, 9


LAYOUTS = ("token", "head")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[200, 400, 1000, 2000])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="bench/results/decode_attention.json")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=16, help="decode rows per call (--device cuda)")
    args = parser.parse_args()
    torch.manual_seed(0)
    # Each context length measures both layouts back to back, so drift on a noisy machine hits both.
    if args.device == "cuda":
        results = {keys: {layout: cuda_microseconds_per_call(keys, args.rows, args.rounds, layout)
                          for layout in LAYOUTS} for keys in args.keys}
        columns, extra = "| rows ", lambda value: f"| {args.rows} "
        record = {"device": torch.cuda.get_device_name()}
    else:
        if cpu_kernels_error() is not None:
            raise SystemExit(f"native kernels unavailable: {cpu_kernels_error()}")
        overhead = microseconds_per_call(1, args.rounds)
        results = {keys: {layout: microseconds_per_call(keys, args.rounds, layout) for layout in LAYOUTS}
                   for keys in args.keys}
        columns = f"| head less a one-key call ({overhead:.1f} us) "
        extra = lambda value: f"| {value['head'] - overhead:.1f} "  # noqa: E731
        record = {"one_key_us": overhead}
    print(f"| keys | token layout, us per call | head layout, us per call | head / token {columns}|")
    print("|---:|---:|---:|---:|---:|")
    for keys, value in results.items():
        print(f"| {keys} | {value['token']:.1f} | {value['head']:.1f} | {value['head'] / value['token']:.2f} "
              f"{extra(value)}|")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), **record, "us_per_call": results}, f, indent=2)

if __name__ == "__main__":
    main()
