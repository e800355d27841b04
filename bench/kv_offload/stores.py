"""Engine-thread cost of one file-tier store (`--stores-only`): the write on the calling thread
("sync pwrite", before issue 21) against the staged store (a copy into a staging row, the write on
the I/O thread), and "staged, 2x burst", which outruns the disk so stores are skipped, not waited
for. Each round evicts one step's burst of pages in every mode, modes interleaved.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch

from bench.lib.stats import percentile
from pdserve.kv.offload import OffloadTier
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_writes import SerialExecutor

MODES = ("sync pwrite", "staged", "staged, 2x burst")


def _tier(pool: torch.Tensor, directory: str, num_slots: int, staging_rows: Optional[int]) -> OffloadTier:
    os.makedirs(directory, exist_ok=True)
    page_bytes = pool.shape[1]
    if staging_rows is None:
        return OffloadTier(FilePageStore(pool, num_slots * page_bytes, directory), [0])
    store = FilePageStore(pool, num_slots * page_bytes, directory, staging_rows)
    return OffloadTier(store, [0], executor=SerialExecutor())


def _drain(tier: OffloadTier) -> None:
    """Wait (untimed) until the I/O thread has written every staged page, and count them."""
    store = tier.store
    while store.num_free_staging_rows < store.num_staging_rows:  # type: ignore[attr-defined]
        time.sleep(0.0005)
    tier.poll()


def store_costs(page_bytes: int, directory: str, rounds: int, burst: int) -> dict:
    """Per mode: engine-thread microseconds per `offer` (p50, p99, mean), stores kept and skipped,
    and the write's own time (where it ran)."""
    pool = torch.randint(-128, 127, (2 * burst + 1, page_bytes), dtype=torch.int8)
    num_slots = 4 * burst  # the tier recycles its slots (LRU) after a few rounds, as a full tier would
    tiers = {"sync pwrite": _tier(pool, os.path.join(directory, "sync"), num_slots, None),
             "staged": _tier(pool, os.path.join(directory, "staged"), num_slots, burst),
             "staged, 2x burst": _tier(pool, os.path.join(directory, "burst"), num_slots, burst)}
    offer_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    write_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    counted: dict[str, tuple[int, int]] = {}  # stores, skips of round 0 (untimed)
    number = 0
    for round_ in range(rounds + 1):  # round 0 warms the files and the page cache up, untimed
        for mode in MODES:
            tier = tiers[mode]
            for block_id in range(1, (2 if mode == "staged, 2x burst" else 1) * burst + 1):
                number += 1
                started = time.perf_counter()
                tier.offer(block_id, (number.to_bytes(16, "big"), 0), None)
                if round_:
                    offer_us[mode].append((time.perf_counter() - started) * 1e6)
            if mode != "sync pwrite":
                _drain(tier)
            if round_:
                write_us[mode] += [s * 1e6 for s in tier.stats.store_seconds]
            else:
                counted[mode] = (tier.stats.num_stores, tier.stats.num_skipped_stores)
            tier.stats.store_seconds = []
    result: dict = {"page_bytes": page_bytes, "burst": burst, "rounds": rounds, "modes": {}}
    for mode in MODES:
        stats = tiers[mode].stats
        times = offer_us[mode]
        result["modes"][mode] = {
            "offer_us_p50": statistics.median(times), "offer_us_p99": percentile(times, 99),
            "offer_us_mean": statistics.fmean(times),
            "write_us_p50": statistics.median(write_us[mode]) if write_us[mode] else None,
            "write_thread": "engine" if mode == "sync pwrite" else "I/O",
            "num_offers": len(times), "num_stores": stats.num_stores - counted[mode][0],
            "num_skipped": stats.num_skipped_stores - counted[mode][1],
            "num_failed": stats.num_failed_stores,
        }
        tiers[mode].store.close()  # type: ignore[attr-defined]
    sync, staged = result["modes"]["sync pwrite"], result["modes"]["staged"]
    result["sync_over_staged_p50"] = sync["offer_us_p50"] / staged["offer_us_p50"]
    result["sync_over_staged_mean"] = sync["offer_us_mean"] / staged["offer_us_mean"]
    return result


def print_store_table(costs: dict) -> None:
    print(f"\nfile-tier stores, {costs['page_bytes']:,}-byte pages, {costs['rounds']} bursts of {costs['burst']} "
          "evictions per mode (2x burst: twice that), engine-thread time of OffloadTier.offer")
    print(f"{'mode':22} {'p50 us':>8} {'p99 us':>8} {'mean us':>8} {'write us p50':>13} {'on':>7} "
          f"{'stored':>7} {'skipped':>8}")
    for mode, row in costs["modes"].items():
        write = f"{row['write_us_p50']:.0f}" if row["write_us_p50"] is not None else "-"
        print(f"{mode:22} {row['offer_us_p50']:8.0f} {row['offer_us_p99']:8.0f} {row['offer_us_mean']:8.0f} "
              f"{write:>13} {row['write_thread']:>7} {row['num_stores']:7d} {row['num_skipped']:8d}")
    print(f"engine-thread time per store, sync / staged: {costs['sync_over_staged_p50']:.1f}x (p50), "
          f"{costs['sync_over_staged_mean']:.1f}x (mean)")
