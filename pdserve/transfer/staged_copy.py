"""Staged reads of pdserve/transfer/nixl_transport.py: staging memory and the copy into the pool.

Staged reads: between pages of different block sizes a read is one small chunk per (unit, row),
so a direct read takes hundreds of descriptors per block. A staged read instead fetches runs
consecutive on the remote side (typically whole remote pages) into a registered staging buffer,
then copies the chunks into the pool with one vectorized index_copy_:

    remote pool   | P page 7 (rows r0 r1 r2 ..) | P page 8 (rows r0 r1 r2 ..) |     1 descriptor per run
                          |  NIXL READ (+ notification: P's pages are free now)
                          v
    staging       [ 7.r0 | 7.r1 | 7.r2 | .. | 8.r0 | 8.r1 | .. ]   chunk i, ordered by remote id
                          |  poll() sees DONE: pool_chunks.index_copy_(0, local_ids_by_remote, staging)
                          v
    local pool    | D page 3: [r0: 7.r0 8.r0][r1: 7.r1 8.r1][r2: ..] |   then the handle is DONE

Also where staging memory comes from: beside the pool, huge-page backed on the CPU, and in
shared memory when the NIXL agent runs in its own process (it must map what it registers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv.layout import huge_page_zeros
from pdserve.kv.shared_memory import shared_zeros
from pdserve.transfer.staging import StagingBuffer


@dataclass(slots=True)
class Scatter:
    """What is left of a staged read once NIXL is done: staging chunk i -> local chunk local_ids[i]."""

    buffer: StagingBuffer
    local_ids: torch.Tensor  # int64, on the pool's device
    chunk_bytes: int
    copied: bool = False
    fence: Any = None  # CUDA event recorded after the copy (None on CPU: the copy is synchronous)


def copy_out_of_staging(pool_view: torch.Tensor, scatter: Scatter) -> None:
    """Pool chunk local_ids[i] <- staging chunk i, for every i (over int8 rows the same copy ran about
    5x slower on the CPU than over int64 rows)."""
    chunk, num = scatter.chunk_bytes, len(scatter.local_ids)
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.int8) if chunk % w.itemsize == 0)
    pool_chunks = pool_view.view(-1).view(word).view(-1, chunk // word.itemsize)
    staged = scatter.buffer.memory[:num * chunk].view(word).view(num, chunk // word.itemsize)
    pool_chunks.index_copy_(0, scatter.local_ids, staged)
    scatter.copied = True
    if pool_view.is_cuda:
        scatter.fence = torch.cuda.Event()
        scatter.fence.record(torch.cuda.current_stream(pool_view.device))


def allocate_host_or_device(device: torch.device, num_bytes: int, shared: bool) -> torch.Tensor:
    """Transfer memory beside the pool: huge-page backed on the CPU (UCX pins host memory page by
    page), in shared memory when `shared` (an agent process registers it)."""
    if device.type == "cuda":
        return torch.empty(num_bytes, dtype=torch.int8, device=device)
    if shared:
        return torch.frombuffer(shared_zeros(num_bytes), dtype=torch.int8)
    return huge_page_zeros(num_bytes, torch.int8)
