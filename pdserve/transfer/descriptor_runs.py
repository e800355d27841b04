"""How the chunk pairs of one READ become descriptors: runs found over numpy arrays, never per pair
in Python (a read between pages of different block sizes has one pair per (unit, row): tens or
hundreds of thousands of them).

Two ways to cut the same pairs (local_ids[i] <- remote_ids[i]) into runs:

    pairs (local <- remote)    8<-20  2<-21  9<-22  3<-23      (local strided, remote consecutive)
    direct runs                [8<-20] [2<-21] [9<-22] [3<-23]  4 descriptors, each straight into the pool
    staged runs                remote [20 .. 23] -> staging [0 .. 3]           1 descriptor
                               then staging chunk i -> local chunk [8, 2, 9, 3][i] (one local copy)

* direct: consecutive on both sides, in the order given; each run is one descriptor from the remote
  pool into the local pool.
* staged: the pairs ordered by remote id (stable: equal remote ids keep their order), then
  consecutive on the remote side only; each run is one descriptor from the remote pool into a
  staging buffer, where the chunks lie in that order, chunk i bound for local chunk
  `local_ids_by_remote[i]`.

Invariant: both cut every pair exactly once, so the runs' counts sum to the number of pairs.
Torch-free and nixl-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

# "auto" stages a read when that at least halves its descriptors and its direct ones average at most
# 8 KiB: on the CPU staging then gained 1.2-2.9x, and at 16 KiB or more never more than 1.05x, whatever
# the factor (a retired probe: `git checkout 3ac08e1 && python -m bench.transfer.kv_pull --mode block-size
# --sweep 4 16`; docs/benchmarks.md "KV pulls between block sizes").
DEFAULT_STAGED_DESCRIPTOR_FACTOR = 2.0
DEFAULT_STAGED_MAX_DESCRIPTOR_BYTES = 8 << 10

Ids = Union[Sequence[int], np.ndarray]


@dataclass(frozen=True, slots=True)
class DirectRuns:
    """Chunks local_first[j].. <- remote_first[j].., count[j] of them, for every run j (int64 arrays)."""

    local_first: np.ndarray
    remote_first: np.ndarray
    count: np.ndarray

    def __len__(self) -> int:
        return len(self.count)


@dataclass(frozen=True, slots=True)
class StagedRuns:
    """Remote chunks remote_first[j].. (count[j] of them) land at staging chunk staging_first[j]..;
    staging chunk i then belongs in local chunk local_ids_by_remote[i]."""

    remote_first: np.ndarray
    count: np.ndarray
    staging_first: np.ndarray
    local_ids_by_remote: np.ndarray

    def __len__(self) -> int:
        return len(self.count)

    @property
    def num_chunks(self) -> int:
        return len(self.local_ids_by_remote)


def _as_ids(ids: Ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _run_starts(*sides: np.ndarray) -> np.ndarray:
    """Indices where a run begins: 0, and every i where some side does not follow side[i - 1] by one."""
    breaks = np.zeros(len(sides[0]), dtype=bool)
    breaks[0] = True
    for side in sides:
        breaks[1:] |= np.diff(side) != 1
    return np.flatnonzero(breaks)


def _counts(starts: np.ndarray, total: int) -> np.ndarray:
    return np.diff(np.append(starts, total))


def direct_runs(local_ids: Ids, remote_ids: Ids) -> DirectRuns:
    """Runs consecutive on both sides, in order; ValueError when the two lists differ in length.

        local  [ 5, 6, 7, 9, 10 ]      runs: (5 <- 20, 3), (9 <- 30, 1), (10 <- 40, 1)
        remote [20,21,22,30, 40 ]
    """
    local, remote = _as_ids(local_ids), _as_ids(remote_ids)
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local ids for {len(remote)} remote ones")
    if len(local) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return DirectRuns(empty, empty, empty)
    starts = _run_starts(local, remote)
    return DirectRuns(local[starts], remote[starts], _counts(starts, len(local)))


def staged_runs(local_ids: Ids, remote_ids: Ids) -> StagedRuns:
    """Runs consecutive on the remote side once the pairs are ordered by remote id; ValueError when
    the two lists differ in length.

        local  [ 8,  2,  9,  3, 40 ]   by remote: 20 21 22 23 | 50   runs: (20, 4) at staging 0, (50, 1) at 4
        remote [20, 21, 22, 23, 50 ]                                   local_ids_by_remote [8, 2, 9, 3, 40]
    """
    local, remote = _as_ids(local_ids), _as_ids(remote_ids)
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local ids for {len(remote)} remote ones")
    if len(local) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return StagedRuns(empty, empty, empty, empty)
    if not (np.diff(remote) >= 0).all():  # already ordered (a whole-page read): no sort
        order = np.argsort(remote, kind="stable")
        local, remote = local[order], remote[order]
    starts = _run_starts(remote)
    return StagedRuns(remote[starts], _counts(starts, len(remote)), starts, local)


def run_descriptors(base_address: int, first: np.ndarray, count: np.ndarray, chunk_bytes: int,
                    device_id: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device id): run j starts at chunk first[j] of
    the region at `base_address` and spans count[j] chunks of `chunk_bytes`."""
    descs = np.empty((len(count), 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_address) + first.astype(np.uint64) * np.uint64(chunk_bytes)
    descs[:, 1] = count.astype(np.uint64) * np.uint64(chunk_bytes)
    descs[:, 2] = device_id
    return descs


def chunk_descriptors(base_address: int, num_chunks: int, chunk_bytes: int, device_id: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array with one row per chunk: row c is chunk c of the region."""
    return run_descriptors(base_address, np.arange(num_chunks, dtype=np.int64), np.ones(num_chunks, dtype=np.int64),
                           chunk_bytes, device_id)


READ_MODES = ("auto", "direct", "staged")
# A staged read's own fixed work (a staging buffer, an index tensor, one more copy call) cost about
# 25 us on the CPU against about 1.6 us per descriptor saved: "auto" stages only reads it spares at
# least this many descriptors (twice the break-even), so short reads and a tiny model's head-range
# reads keep their one descriptor per (block, source).
MIN_DESCRIPTORS_SAVED = 32


def choose_runs(local_ids: Ids, remote_ids: Ids, chunk_bytes: int, read_mode: str, staged_factor: float,
                staged_max_descriptor_bytes: int) -> tuple[DirectRuns, Optional[StagedRuns]]:
    """(direct runs, staged runs or None): staged runs are returned when the read should go through a
    staging buffer: always in read_mode "staged", never in "direct"; in "auto" when staging pays,
    that is when both hold:

    * the direct runs number at least `staged_factor` times the staged ones, and at least
      MIN_DESCRIPTORS_SAVED more;
    * the direct descriptors average at most `staged_max_descriptor_bytes`: a large descriptor's
      fixed cost is small beside copying its bytes a second time.
    """
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    direct = direct_runs(local_ids, remote_ids)
    if read_mode == "direct":
        return direct, None
    if read_mode == "auto":
        mean_descriptor_bytes = int(direct.count.sum()) * chunk_bytes / max(len(direct), 1)
        too_few = len(direct) < max(staged_factor, MIN_DESCRIPTORS_SAVED + 1)  # (staged: at least one)
        if too_few or mean_descriptor_bytes > staged_max_descriptor_bytes:
            return direct, None
    staged = staged_runs(local_ids, remote_ids)
    if read_mode == "auto" and (len(direct) < staged_factor * len(staged)
                                or len(direct) - len(staged) < MIN_DESCRIPTORS_SAVED):
        return direct, None
    return direct, staged


def check_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"{side} block ids must lie in 0..{num_blocks - 1}")
    return ids


def check_read_mode(read_mode: str, staged_descriptor_factor: float) -> None:
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    if not staged_descriptor_factor >= 1:
        raise ValueError(f"staged_descriptor_factor must be >= 1, got {staged_descriptor_factor}")
