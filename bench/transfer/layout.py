"""KV pull bandwidth between two processes over NIXL against an in-process memcpy of the same bytes
(`--mode layout`): one descriptor per page and one per (layer, K|V) piece side by side; plus the
bytes sliding-window clipping saves (Gemma 3 1B, gpt-oss-20b).

On CUDA both pools (and the memcpy baseline's buffers) are GPU memory on that device, so the pull
goes over whatever UCX picks between two processes on one GPU (cuda_ipc unless UCX_TLS says otherwise).

Invariant: both descriptor layouts move the very same bytes between the same two processes (a
prefill child and this process) over the same registered memory; only the way the bytes are
described to NIXL differs.
"""

from __future__ import annotations

import json
import math
import multiprocessing
from typing import Sequence

import torch

from bench.lib.report import markdown_table
from bench.transfer.pools import (
    SHAPES, PoolShape, allocate_bytes, huge_page_kib, medians_with_memcpy, memory_modes, prefill_child,
    serve_until_stopped, synchronize, time_read)
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.transport import PeerInfo

PROMPT_TOKENS = (512, 2048, 4096, 8192)
SEED = 1234

# Gemma 3 1B: 26 layers, every 6th full attention, window 512, 1 KV head x 256, bf16.
GEMMA = dict(num_layers=26, full_every=6, window_tokens=512, num_kv_heads=1, head_dim=256, element_bytes=2,
             block_size=16)
GEMMA_PROMPT_TOKENS = (4096, 16384)
# gpt-oss-20b: 24 layers alternating a 128-token window with full attention, 8 KV heads x 64, bf16.
GPT_OSS_20B = dict(num_layers=24, full_every=2, window_tokens=128, num_kv_heads=8, head_dim=64, element_bytes=2,
                   block_size=16)
CLIPPING_SHAPES = {"Gemma 3 1B": GEMMA, "gpt-oss-20b": GPT_OSS_20B}


def allocate_views(shape: PoolShape, mode: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, pieces): two row views of one pool, [blocks, page_bytes] and [blocks*pieces, piece_bytes]."""
    layout = shape.layout()
    pool = allocate_bytes(layout.pool_bytes, mode, device).view(layout.dtype).view(layout.shape)
    pages = layout.canonical_view(pool)
    return pages, pages.view(shape.num_pool_blocks * shape.num_pieces, layout.page_bytes // shape.num_pieces)


# ---- the prefill child ---------------------------------------------------------------------


def serve_pool(shape_name: str, mode: str, device: str, out: multiprocessing.Queue,
               stop: multiprocessing.Event) -> None:
    """Child: a patterned pool, published twice: as pages and as per-layer pieces."""
    pages, pieces = allocate_views(SHAPES[shape_name], mode, device)
    pages.view(torch.int64).copy_(torch.arange(pages.numel() // 8, dtype=torch.int64).view(pages.shape[0], -1))
    synchronize(device)
    transports = [NixlTransport(pages, f"bench-prefill-pages-{mode}"), NixlTransport(pieces, f"bench-prefill-pieces-{mode}")]
    out.put(json.dumps([t.local_peer_info("bench-prefill", mode).to_dict() for t in transports]))
    serve_until_stopped(transports, stop)


# ---- measurements --------------------------------------------------------------------------


def piece_rows(shape: PoolShape, block_ids: Sequence[int]) -> list[int]:
    """Rows of the per-layer layout holding `block_ids`: piece p of block b sits at
    row p * num_pool_blocks + b, as in a layer-major pool of num_pieces tensors."""
    return [piece * shape.num_pool_blocks + block_id for block_id in block_ids for piece in range(shape.num_pieces)]


def check_bytes(view: torch.Tensor, local_rows: list[int], remote_rows: list[int]) -> None:
    """The rows landed: row r of any view of the child's pool holds int64 words r*W .. r*W+W-1."""
    words = view.view(torch.int64)
    per_row = words.shape[1]
    for local_row, remote_row in zip(local_rows[:4] + local_rows[-4:], remote_rows[:4] + remote_rows[-4:]):
        expected = torch.arange(remote_row * per_row, (remote_row + 1) * per_row, dtype=torch.int64)
        if not torch.equal(words[local_row].cpu(), expected):
            raise RuntimeError(f"local row {local_row} does not hold remote row {remote_row}")


def measure_pulls(shape_name: str, mode: str, device: str, prompt_tokens: Sequence[int], reps: int) -> list[dict]:
    """Every prompt size in one memory mode, against a fresh prefill child."""
    with prefill_child(serve_pool, shape_name, mode, device, timeout_s=120) as (published, child_pid):
        page_info, piece_info = (PeerInfo.from_dict(info) for info in published)
        shape = SHAPES[shape_name]
        pages, pieces = allocate_views(shape, mode, device)
        by_page = NixlTransport(pages, f"bench-decode-pages-{mode}")
        by_piece = NixlTransport(pieces, f"bench-decode-pieces-{mode}")
        keys = by_page.connect(page_info), by_piece.connect(piece_info)
        rows = [measure_prompt(shape, mode, device, num_tokens, (by_page, by_piece), keys, (pages, pieces), reps,
                               child_pid)
                for num_tokens in prompt_tokens]
        by_page.close()
        by_piece.close()
        return rows


def measure_prompt(shape: PoolShape, mode: str, device: str, num_tokens: int, transports: tuple[NixlTransport, NixlTransport],
                   keys: tuple[str, str], views: tuple[torch.Tensor, torch.Tensor], reps: int, child_pid: int) -> dict:
    (by_page, by_piece), (page_key, piece_key), (pages, pieces) = transports, keys, views
    num_blocks = math.ceil(num_tokens / shape.block_size)
    generator = torch.Generator().manual_seed(SEED + num_tokens)
    # Scattered ids, as after allocator churn; never the null block 0.
    remote_ids = (torch.randperm(shape.num_pool_blocks - 1, generator=generator)[:num_blocks] + 1).tolist()
    local_ids = (torch.randperm(shape.num_pool_blocks - 1, generator=generator)[:num_blocks] + 1).tolist()
    local_rows, remote_rows = piece_rows(shape, local_ids), piece_rows(shape, remote_ids)
    num_bytes = num_blocks * by_page.page_bytes
    (page_s, piece_s), memcpy_s, foreign = medians_with_memcpy(
        [lambda: time_read(by_page, page_key, local_ids, remote_ids)[0],
         lambda: time_read(by_piece, piece_key, local_rows, remote_rows)[0]], num_bytes, mode, reps, child_pid, device)
    # The timed reads overwrite each other's rows: verify each layout on a clean pool.
    for transport, key, view, local, remote in ((by_page, page_key, pages, local_ids, remote_ids),
                                                (by_piece, piece_key, pieces, local_rows, remote_rows)):
        pages.zero_()
        synchronize(device)
        time_read(transport, key, local, remote)
        check_bytes(view, local, remote)
    return {"memory": mode, "shape": shape.label,
            **pull_row(shape, num_tokens, num_blocks, num_bytes, page_s, piece_s, memcpy_s),
            "foreign_cpu_fraction": foreign, "huge_page_kib": huge_page_kib()}


def pull_row(shape: PoolShape, num_tokens: int, num_blocks: int, num_bytes: int, page_s: float, piece_s: float,
             memcpy_s: float) -> dict:
    page_gbps, piece_gbps, memcpy_gbps = (num_bytes / seconds / 1e9 for seconds in (page_s, piece_s, memcpy_s))
    return {
        "prompt_tokens": num_tokens, "num_blocks": num_blocks, "num_bytes": num_bytes,
        "page_descriptors": num_blocks, "piece_descriptors": num_blocks * shape.num_pieces,
        "page_pull_s": page_s, "piece_pull_s": piece_s, "memcpy_s": memcpy_s,
        "page_pull_gbps": page_gbps, "piece_pull_gbps": piece_gbps, "memcpy_gbps": memcpy_gbps,
        "page_vs_memcpy": page_gbps / memcpy_gbps, "piece_vs_memcpy": piece_gbps / memcpy_gbps,
    }


# ---- sliding-window clipping (no transfer) -------------------------------------------------


def clipping_rows() -> list[dict]:
    """Bytes a pull moves with and without clipping sliding groups to the live window, for each
    model of `CLIPPING_SHAPES` (all layers full is the unclipped row)."""
    return [row for model, shape in CLIPPING_SHAPES.items() for row in _clipping_rows(model, shape)]


def _clipping_rows(model: str, g: dict) -> list[dict]:
    specs = [FullAttentionSpec() if (i + 1) % g["full_every"] == 0 else SlidingWindowSpec(g["window_tokens"])
             for i in range(g["num_layers"])]
    plan = plan_groups(specs)
    page_bytes = plan.group_size * 2 * g["block_size"] * g["num_kv_heads"] * g["head_dim"] * g["element_bytes"]
    live_blocks = math.ceil(g["window_tokens"] / g["block_size"]) + 1
    rows = []
    for num_tokens in GEMMA_PROMPT_TOKENS:
        num_blocks = math.ceil(num_tokens / g["block_size"])
        per_group = [num_blocks if isinstance(group.spec, FullAttentionSpec) else min(num_blocks, live_blocks)
                     for group in plan.groups]
        clipped, unclipped = sum(per_group), num_blocks * len(plan.groups)
        rows.append({
            "model": model, "prompt_tokens": num_tokens, "num_groups": len(plan.groups), "group_size": plan.group_size,
            "page_bytes": page_bytes, "blocks_clipped": clipped, "blocks_unclipped": unclipped,
            "bytes_clipped": clipped * page_bytes, "bytes_unclipped": unclipped * page_bytes,
            "saved_fraction": 1 - clipped / unclipped,
        })
    return rows


# ---- report --------------------------------------------------------------------------------


def format_tables(shape: PoolShape, pulls: list[dict], clipping: list[dict]) -> str:
    pull_table = markdown_table(
        ["memory", "tokens", "blocks", "MB", "page GB/s", "descs", "layer GB/s", "descs", "memcpy GB/s",
         "page/memcpy", "layer/memcpy"],
        [(r["memory"], r["prompt_tokens"], r["num_blocks"], f"{r['num_bytes'] / 1e6:.1f}", f"{r['page_pull_gbps']:.2f}",
          r["page_descriptors"], f"{r['piece_pull_gbps']:.2f}", r["piece_descriptors"], f"{r['memcpy_gbps']:.2f}",
          f"{r['page_vs_memcpy']:.2f}", f"{r['piece_vs_memcpy']:.2f}") for r in pulls])
    clipping_table = markdown_table(
        ["model", "tokens", "groups", "blocks clipped", "MB clipped", "blocks unclipped", "MB unclipped", "saved"],
        [(r["model"], r["prompt_tokens"], r["num_groups"], r["blocks_clipped"], f"{r['bytes_clipped'] / 1e6:.1f}",
          r["blocks_unclipped"], f"{r['bytes_unclipped'] / 1e6:.1f}", f"{r['saved_fraction']:.1%}") for r in clipping])
    return (f"{shape.label} pool (page {shape.layout().page_bytes:,} B), scattered block ids, median of reps\n"
            f"{pull_table}\n\nSliding-window clipping (bytes D pulls; unclipped = every layer full)\n{clipping_table}")


def run(args, parser) -> tuple[PoolShape, dict]:  # noqa: ANN001 - kv_pull's namespace and parser
    """`--mode layout`: page and per-piece descriptors, in every memory mode asked for."""
    shape = SHAPES[args.shape]
    if max(args.prompt_tokens) > (shape.num_pool_blocks - 1) * shape.block_size:
        parser.error(f"--prompt-tokens must fit the bench pool: at most {(shape.num_pool_blocks - 1) * shape.block_size}")
    pulls = [row for mode in memory_modes(args)
             for row in measure_pulls(args.shape, mode, args.device, args.prompt_tokens, args.reps)]
    clipping = clipping_rows()
    print(format_tables(shape, pulls, clipping))
    return shape, {"pulls": pulls, "clipping": clipping}
