"""Load bandwidth of the offload tier's page stores against a raw copy of the same bytes
(`--loads-only`). Each round loads one request's prefix in every mode, modes interleaved:

    raw memcpy / memory tier              numpy.copyto from a host buffer / HostPageStore.read
    raw preadv / file tier, XXH3 / CRC32  pages as written (page cache); the tier with each checksum
    raw preadv, re-read / file tier, re-read   pages dropped once and read back from the device
    raw preadv, disk / file tier, disk    pages dropped before every load (fdatasync + FADV_DONTNEED)

Invariant: each file state has files of its own, so dropping one state's pages never changes
another's; everything runs on the calling thread, as the tier's I/O thread runs it.
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from typing import Callable

import numpy
import torch
import xxhash

from bench.lib.report import cell, markdown_table
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_host import HostPageStore

MODES = ("raw memcpy", "memory tier", "raw preadv", "file tier, XXH3", "file tier, CRC32", "raw preadv, re-read",
         "file tier, re-read", "raw preadv, disk", "file tier, disk")
BASELINE = {"memory tier": "raw memcpy", "file tier, XXH3": "raw preadv", "file tier, CRC32": "raw preadv",
            "file tier, re-read": "raw preadv, re-read", "file tier, disk": "raw preadv, disk"}
# tier store: (directory, checksum); raw file per page-cache state
STORES = {"file tier, XXH3": ("XXH3", xxhash.xxh3_64_intdigest), "file tier, CRC32": ("CRC32", zlib.crc32),
          "file tier, re-read": ("XXH3-re-read", xxhash.xxh3_64_intdigest),
          "file tier, disk": ("XXH3-disk", xxhash.xxh3_64_intdigest)}
RAW_FILES = {"raw preadv": "raw.bin", "raw preadv, re-read": "raw-re-read.bin", "raw preadv, disk": "raw-disk.bin"}


def _drop_cached_pages(path: str) -> None:
    """Make the next read of `path` come from the device: write back, then drop its page-cache pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_bandwidth(page_bytes: int, directory: str, rounds: int, pages_per_load: int) -> dict:
    """Per mode: GB/s of one load (p50 over rounds, and of the total), and each tier's share of its raw copy."""
    num_pages = pages_per_load
    pool = torch.zeros((2 * num_pages + 1, page_bytes), dtype=torch.int8)
    source = torch.randint(-128, 127, (num_pages, page_bytes), dtype=torch.int8)
    slots, targets = list(range(num_pages)), [1 + 2 * page for page in range(num_pages)]  # distinct, spread rows
    pool_rows, source_rows = pool.numpy(), source.numpy()

    host = HostPageStore(pool, num_pages * page_bytes)
    files = {mode: FilePageStore(pool, num_pages * page_bytes, os.path.join(directory, name), checksum=checksum)
             for mode, (name, checksum) in STORES.items()}
    for slot in slots:  # fill every store with the source pages
        numpy.copyto(pool_rows[targets[slot]], source_rows[slot])
        host.write(slot, targets[slot])
        for store in files.values():
            store.write(slot, targets[slot])
    raw_fds = {}
    for mode, name in RAW_FILES.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(source_rows.tobytes())
        raw_fds[mode] = os.open(os.path.join(directory, name), os.O_RDONLY)

    def raw_memcpy() -> None:
        for slot in slots:
            numpy.copyto(pool_rows[targets[slot]], source_rows[slot])

    def raw_preadv(fd: int) -> None:
        for slot in slots:
            os.preadv(fd, [pool_rows[targets[slot]]], slot * page_bytes)

    runs: dict[str, Callable[[], None]] = {
        "raw memcpy": raw_memcpy, "memory tier": lambda: host.read(slots, targets),
        **{mode: (lambda fd=fd: raw_preadv(fd)) for mode, fd in raw_fds.items()},
        **{mode: (lambda store=store: store.read(slots, targets)) for mode, store in files.items()}}
    paths = {**{mode: os.path.join(directory, name) for mode, name in RAW_FILES.items()},
             **{mode: store.path for mode, store in files.items()}}
    for mode in ("raw preadv, re-read", "file tier, re-read"):
        _drop_cached_pages(paths[mode])  # once: round 0 (untimed) reads them back from the device
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds + 1):  # round 0 warms up, untimed
        for mode in MODES:
            if mode.endswith(", disk"):
                _drop_cached_pages(paths[mode])  # untimed
            started = time.perf_counter()
            runs[mode]()
            if round_:
                seconds[mode].append(time.perf_counter() - started)
            if not numpy.array_equal(pool_rows[targets], source_rows):
                raise RuntimeError(f"{mode} did not load the pages it was given")
            pool_rows[targets] = 0  # each mode loads into rows it must fill itself
    for mode, fd in raw_fds.items():
        os.close(fd)
        os.unlink(paths[mode])
    for store in files.values():
        store.close()
    load_bytes = num_pages * page_bytes
    result: dict = {"page_bytes": page_bytes, "pages_per_load": num_pages, "rounds": rounds, "modes": {}}
    for mode in MODES:
        result["modes"][mode] = {"gb_per_s_p50": load_bytes / statistics.median(seconds[mode]) / 1e9,
                                 "gb_per_s_total": load_bytes * rounds / sum(seconds[mode]) / 1e9}
    for mode, baseline in BASELINE.items():
        ours, raw = result["modes"][mode], result["modes"][baseline]
        ours["share_of_raw_p50"] = ours["gb_per_s_p50"] / raw["gb_per_s_p50"]
        ours["share_of_raw_total"] = ours["gb_per_s_total"] / raw["gb_per_s_total"]
    return result


def print_load_table(bandwidth: dict) -> None:
    print(f"\ntier loads, {bandwidth['pages_per_load']} pages of {bandwidth['page_bytes']:,} bytes per load, "
          f"{bandwidth['rounds']} rounds per mode, interleaved")
    print(markdown_table(["mode", "GB/s p50", "GB/s all", "of raw p50", "of raw all"], [
        (mode, f"{row['gb_per_s_p50']:.2f}", f"{row['gb_per_s_total']:.2f}", cell(row.get("share_of_raw_p50"), ".0%"),
         cell(row.get("share_of_raw_total"), ".0%")) for mode, row in bandwidth["modes"].items()]))
