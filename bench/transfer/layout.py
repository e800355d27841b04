"""KV pull bandwidth between two processes over NIXL against an in-process memcpy of the same bytes
(`--mode layout`): one descriptor per page and one per (layer, K|V) piece side by side.

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
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.transport import PeerInfo

PROMPT_TOKENS = (512, 2048, 4096, 8192)
SEED = 1234

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


# ---- report --------------------------------------------------------------------------------


def format_table(shape: PoolShape, pulls: list[dict]) -> str:
    title = f"{shape.label} pool (page {shape.layout().page_bytes:,} B), scattered block ids, median of reps\n"
    return title + markdown_table(
        ["memory", "tokens", "blocks", "MB", "page GB/s", "descs", "layer GB/s", "descs", "memcpy GB/s",
         "page/memcpy", "layer/memcpy"],
        [(r["memory"], r["prompt_tokens"], r["num_blocks"], f"{r['num_bytes'] / 1e6:.1f}", f"{r['page_pull_gbps']:.2f}",
          r["page_descriptors"], f"{r['piece_pull_gbps']:.2f}", r["piece_descriptors"], f"{r['memcpy_gbps']:.2f}",
          f"{r['page_vs_memcpy']:.2f}", f"{r['piece_vs_memcpy']:.2f}") for r in pulls])


def run(args, parser) -> tuple[PoolShape, dict]:  # noqa: ANN001 - kv_pull's namespace and parser
    """`--mode layout`: page and per-piece descriptors, in every memory mode asked for."""
    shape = SHAPES[args.shape]
    if max(args.prompt_tokens) > (shape.num_pool_blocks - 1) * shape.block_size:
        parser.error(f"--prompt-tokens must fit the bench pool: at most {(shape.num_pool_blocks - 1) * shape.block_size}")
    pulls = [row for mode in memory_modes(args)
             for row in measure_pulls(args.shape, mode, args.device, args.prompt_tokens, args.reps)]
    print(format_table(shape, pulls))
    return shape, {"pulls": pulls}
