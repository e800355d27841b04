"""What every KV-pull mode shares: pool shapes, host or GPU memory (4 KiB or huge pages), one timed
NIXL read, interleaved medians, the memcpy baseline, `P:D` pairs and the JSON report.

Invariant: a timed read runs from `start_read` to DONE and fails loudly (a read that did not finish
or failed is an error, never a time); runs taking turns rep by rep see the same background load.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from bench.lib.machine import CpuMeter, machine_info
from bench.lib.report import write_document
from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.transport import TransferState

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PoolShape:
    """One full-attention group's page geometry, and how many blocks each side's pool holds."""

    label: str
    group_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_pool_blocks: int  # > the largest prompt's blocks: room to scatter block ids
    block_size: int = 16

    @property
    def num_pieces(self) -> int:
        """Per-layer split-K/V layout: one piece per (layer, K|V)."""
        return self.group_size * 2

    def layout(self) -> KVPoolLayout:
        return KVPoolLayout(num_blocks=self.num_pool_blocks, group_size=self.group_size, block_size=self.block_size,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)


SHAPES = {
    # SmolLM2-135M: 30 layers, 3 KV heads x 64, fp32 (page 737,280 B).
    "smollm2": PoolShape("SmolLM2-135M", group_size=30, num_kv_heads=3, head_dim=64, dtype=torch.float32,
                         num_pool_blocks=600),
    # Llama-3-8B: 32 layers, 8 KV heads x 128, bf16 (page 2 MiB); 32k tokens = 2,048 blocks = 4 GiB.
    "llama3-8b": PoolShape("Llama-3-8B", group_size=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                           num_pool_blocks=2100),
}
MEMORY_MODES = ("4k-pages", "huge-pages")  # how host pools (and memcpy buffers) are backed
GPU_MODE = "vram"  # the one memory mode on CUDA
MADV_HUGEPAGE = 14  # <sys/mman.h>
TIMEOUT_S = 60.0
NOISY_FOREIGN_FRACTION = 0.15  # warn when others take more of the CPUs while measuring
# ---- memory ----------------------------------------------------------------------------------


def allocate_bytes(num_bytes: int, mode: str, device: str = "cpu") -> torch.Tensor:
    """A zeroed int8 buffer: GPU memory in mode "vram"; host memory otherwise, advised to
    transparent huge pages before its first touch in mode "huge-pages" (what
    THP_MEM_ALLOC_ENABLE=1 does for every big tensor)."""
    if mode == GPU_MODE:
        return torch.zeros(num_bytes, dtype=torch.int8, device=device)
    buffer = torch.empty(num_bytes, dtype=torch.int8)  # large: fresh mmap, not touched yet
    if mode == "huge-pages":
        page_size = os.sysconf("SC_PAGE_SIZE")
        start = -(-buffer.data_ptr() // page_size) * page_size
        length = (buffer.data_ptr() + num_bytes - start) // page_size * page_size
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE) != 0:
            logger.warning("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    buffer.zero_()
    return buffer


def huge_page_kib() -> int:
    """AnonHugePages of this process: proof the advice took effect."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_read(transport: NixlTransport, key: str, local_ids: Sequence[int], remote_ids: Sequence[int],
              timeout_s: float = TIMEOUT_S) -> tuple[float, int]:
    """(seconds from start_read to DONE, descriptor selection and any staged copy included;
    descriptors the read took)."""
    started_s = time.perf_counter()
    handle = transport.start_read(key, local_ids, remote_ids, b"")
    while transport.poll(handle) is TransferState.PENDING:
        if time.perf_counter() - started_s > timeout_s:
            raise RuntimeError("read did not finish in time")
    elapsed_s = time.perf_counter() - started_s
    if handle.state is not TransferState.DONE:
        raise RuntimeError(f"read failed: {handle.error}")
    while not transport.release(handle):
        pass
    return elapsed_s, handle.num_blocks


def interleaved_medians(runs: Sequence[Callable[[], float]], reps: int) -> list[float]:
    """Median seconds of each run, taking turns rep by rep so that every run sees
    the same background load (this machine is shared)."""
    for run in runs:
        run()  # warm-up: first touch of destination pages, UCX registration caches
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, times in zip(runs, samples):
            times.append(run())
    return [statistics.median(times) for times in samples]


def memcpy_run(num_bytes: int, mode: str, device: str) -> Callable[[], float]:
    source, target = allocate_bytes(num_bytes, mode, device), allocate_bytes(num_bytes, mode, device)
    source.fill_(1)
    synchronize(device)

    def run() -> float:
        started_s = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        return time.perf_counter() - started_s

    return run


def medians_with_memcpy(runs: Sequence[Callable[[], float]], num_bytes: int, mode: str, reps: int,
                        child_pid: int, device: str = "cpu") -> tuple[list[float], float, Optional[float]]:
    """(median seconds of each run, of a memcpy of `num_bytes` taking turns with them, the share of
    the CPUs other processes than this one and the child used meanwhile)."""
    meter = CpuMeter([child_pid])
    meter.start()
    medians = interleaved_medians([*runs, memcpy_run(num_bytes, mode, device)], reps)
    foreign = meter.foreign_fraction()
    if (foreign or 0.0) > NOISY_FOREIGN_FRACTION:
        logger.warning("%s: other processes used %.0f%% of the CPUs while measuring", mode, foreign * 100)
    return medians[:-1], medians[-1], foreign


def memory_modes(args) -> tuple[str, ...]:  # noqa: ANN001 - kv_pull's namespace
    """GPU memory on CUDA; else `--memory` (both: 4 KiB pages, then huge pages)."""
    if args.device.startswith("cuda"):
        return (GPU_MODE,)
    return MEMORY_MODES if args.memory == "both" else (args.memory,)


def add_ratios(rows: list[dict], name: str, key: Callable[[dict], tuple],
               is_reference: Callable[[dict], bool]) -> list[dict]:
    """Adds `name` (GB/s over the reference row of the same `key`, None without one) and vs_memcpy to
    every row, in place; returns the rows."""
    reference = {key(r): r["pull_gbps"] for r in rows if is_reference(r)}
    for r in rows:
        base = reference.get(key(r))
        r[name] = r["pull_gbps"] / base if base else None
        r["vs_memcpy"] = r["pull_gbps"] / r["memcpy_gbps"] if r.get("memcpy_gbps") else None
    return rows


def write_report(args, argv: Optional[Sequence[str]], started_s: float, shape: PoolShape,  # noqa: ANN001
                 **fields: object) -> None:
    """Write a mode's report as JSON: the command that made it, the machine, `fields`, the wall time."""
    command = ["python", "-m", "bench.transfer.kv_pull", *(argv if argv is not None else sys.argv[1:])]
    device = args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    machine = machine_info() | {"torch": torch.__version__, "memcpy_threads": args.memcpy_threads, "device": device}
    report = {"command": " ".join(command), "machine": machine, "reps": args.reps,
              "shape": dataclasses.asdict(shape) | {"dtype": str(shape.dtype)}, **fields,
              "wall_s": time.perf_counter() - started_s}
    write_document(args.out, report, indent=2)
    print(f"\nwrote {args.out} in {report['wall_s']:.1f} s")


@contextlib.contextmanager
def prefill_child(target: Callable, *args: object, timeout_s: float = 300.0) -> Iterator[tuple[object, int]]:
    """A spawned child running `target(*args, out, stop)`: it puts its pools' peer infos on `out` (one
    JSON text), then serves them until `stop`. Yields (what it published, its pid); stops it on exit."""
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    child = context.Process(target=target, args=(*args, out, stop), daemon=True)
    child.start()
    try:
        yield json.loads(out.get(timeout=timeout_s)), child.pid
    finally:
        stop.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def serve_until_stopped(transports: Sequence[NixlTransport], stop: multiprocessing.Event) -> None:
    """A prefill child's loop: call into NIXL as an engine loop does (without a progress thread, a
    reader's connection set-up needs this side to make progress too) until `stop`; then close."""
    while not stop.wait(0.002):
        for transport in transports:
            transport.poll_notifications()
    for transport in transports:
        transport.close()


def parse_pair(text: str) -> tuple[int, int]:
    """"P:D" (or "P->D") -> (P, D), both >= 1."""
    parts = text.replace("->", ":").split(":")
    if len(parts) != 2:
        raise ValueError(f"pair {text!r} is not P:D")
    prefill, decode = (int(part) for part in parts)
    if prefill < 1 or decode < 1:
        raise ValueError(f"pair {text!r}: sizes must be >= 1")
    return prefill, decode
