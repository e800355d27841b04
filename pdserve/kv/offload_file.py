"""File page store of the offload tier: pages in one file under --kv-offload-dir, written and read on an I/O thread.

Invariant: slot s is bytes [s * page_bytes, (s + 1) * page_bytes) of `pages.bin`,
and a read hands a page to the pool only if its checksum (64-bit XXH3, seeded
with a secret drawn when the store opens) equals the one recorded after its write completed, so a torn or corrupt page, or one
whose write never ran, is a failed load (the request recomputes), never wrong
tokens; a write that fails (a full disk) is a store that did not happen.

    pool canonical view         staging rows                      <dir>/pages.bin
    [num_blocks, page_bytes]    [num_staging_rows, page_bytes]    [slot 0][slot 1]...[slot s]...
    row b  --stage(b)---------> row r --write_staged(s, r)------> slot s: sum[s] = None, pwrite,
           engine thread: a copy        I/O thread; r free again          sum[s] = xxh3(page)
    row b' <--read([s], [b']): preadv, check sum[s], on the I/O thread--- slot s

On CUDA a read lands in one of two pinned rows and goes on to its pool row as one DMA on the
store's own stream, so the next page's preadv overlaps it; `stage` copies into a pinned row on
another stream of the store's.

The checksum is XXH3 (the `xxhash` package), not CRC32: a load verifies every
byte it reads, and at 4 GB/s `zlib.crc32` was most of a load's time, against
25-30 GB/s for XXH3 (docs/benchmarks.md, "KV offload tier: loads").

The engine thread never touches the file: `stage` copies the page before the
pool reuses its block, and a store that finds every staging row busy (the disk
lags the evictions) is skipped rather than waited for. `write` does the whole
store on the calling thread (tests, and the benchmark's baseline).

Start-up: the directory is made 0700 and must belong to this process's user
(opened once, everything below it opened relative to that descriptor, never
through a link); it is locked (`flock` on `<dir>/lock`), so two workers never
share it, and `pages.bin` is unlinked and created anew (`O_CREAT|O_EXCL|O_NOFOLLOW`):
the index lives in memory, so no page survives a restart. That is the safe
choice: nothing on disk can be mistaken for another model's, dtype's, layout's
or rank's KV, and a link planted at `pages.bin` is replaced, never written through.

The checksum's seed is a per-store secret (64 random bits): a page crafted to
pass a plain XXH3 fails here. XXH3 is not a MAC; the directory's owner and mode
keep others out, and a keyed BLAKE2b would cost 90x per load (0.5 against
45 GB/s measured here), which is why the seed keys a fast hash instead.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections import deque
from typing import Callable, Optional, Sequence

import numpy
import torch
import xxhash

from pdserve.kv.offload import OffloadIOError, store_geometry


def keyed_xxh3() -> Callable[[numpy.ndarray], int]:
    """XXH3-64 of a page, seeded with a secret drawn now (one per store, never written anywhere)."""
    seed = int.from_bytes(os.urandom(8), "little")
    return lambda page: xxhash.xxh3_64_intdigest(page, seed=seed)


def open_private_directory(directory: str) -> int:
    """A descriptor of `directory` (created if missing), which belongs to this user and is 0700 from now on;
    ValueError when another user owns it."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise ValueError(f"--kv-offload-dir {directory} is owned by uid {info.st_uid}, not this user "
                             f"({os.geteuid()}): another user could read or plant pages there")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(directory_fd: int, directory: str) -> int:
    try:
        return os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=directory_fd)
    except OSError as error:  # ELOOP: a link planted at the lock
        raise ValueError(f"--kv-offload-dir {directory}: cannot open its lock file: {error}") from error


def _create_pages_file(directory_fd: int) -> int:
    """`pages.bin` anew: whatever sits at that name (an old file, a planted link) is unlinked first."""
    try:
        os.unlink("pages.bin", dir_fd=directory_fd)
    except FileNotFoundError:
        pass
    return os.open("pages.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory_fd)


class FilePageStore:
    medium = "disk"

    def __init__(self, pool_view: torch.Tensor, capacity_bytes: int, directory: str, num_staging_rows: int = 8,
                 checksum: Optional[Callable[[numpy.ndarray], int]] = None):
        """`checksum`: of one page's bytes (a benchmark compares others; the default, `keyed_xxh3()`,
        is the fast one)."""
        self.page_bytes, self.num_slots = store_geometry(pool_view.shape, pool_view.dtype == torch.int8,
                                                         capacity_bytes)
        directory_fd = open_private_directory(directory)
        try:
            lock_fd = _open_lock(directory_fd, directory)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = _create_pages_file(directory_fd)
            except BlockingIOError:
                os.close(lock_fd)
                raise ValueError(f"--kv-offload-dir {directory} is in use by another worker") from None
            except BaseException:
                os.close(lock_fd)  # closing drops the lock
                raise
        finally:
            os.close(directory_fd)
        self._lock_fd = lock_fd
        self.path = os.path.join(directory, "pages.bin")
        self._checksum = checksum if checksum is not None else keyed_xxh3()
        self._sums: list[int | None] = [None] * self.num_slots
        self._pool = pool_view
        self._on_cpu = pool_view.device.type == "cpu"
        # On the CPU the pool's rows as numpy views: indexing torch and converting costs 3.5 us a page.
        self._pool_rows = pool_view.numpy() if self._on_cpu else None
        # Pinned off the CPU, so the device-to-host copy of a page is one DMA.
        num_staging_rows = max(1, num_staging_rows)
        self._staging = torch.empty((num_staging_rows, self.page_bytes), dtype=torch.int8, pin_memory=not self._on_cpu)
        self._staging_arrays = self._staging.numpy()
        self._free_rows: deque[int] = deque(range(num_staging_rows))  # taken by the engine, freed by the I/O thread
        # Pinned rows off the CPU for `write` (its caller's thread) and reads (the I/O thread: two, so
        # the next page's preadv overlaps this one's DMA to the device, on the store's own stream).
        self._write_row = torch.empty(self.page_bytes, dtype=torch.int8, pin_memory=not self._on_cpu)
        self._read_rows = torch.empty((2, self.page_bytes), dtype=torch.int8, pin_memory=not self._on_cpu)
        self._load_stream = None if self._on_cpu else torch.cuda.Stream(pool_view.device)
        self._store_stream = None if self._on_cpu else torch.cuda.Stream(pool_view.device)  # `stage`'s

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    @property
    def num_staging_rows(self) -> int:
        return self._staging.shape[0]

    @property
    def num_free_staging_rows(self) -> int:
        return len(self._free_rows)

    def write(self, slot: int, block_id: int) -> None:
        """The whole store on the calling thread (no staging row: on the CPU it writes the pool row)."""
        row = self._pool[block_id]
        if not self._on_cpu:
            row = self._write_row.copy_(row)
        self._write_page(slot, row.numpy())

    def stage(self, block_id: int) -> int:
        """Copy pool page `block_id` into a free staging row (the engine thread, before the block is reused)."""
        try:
            row = self._free_rows.popleft()
        except IndexError:
            raise OffloadIOError("every staging row waits for its write") from None
        try:
            if self._on_cpu:
                # One memcpy on this thread: torch's copy fans a page out to its intra-op threads,
                # which then queue behind the I/O thread for a core (p99 12-26 ms, docs/benchmarks.md).
                numpy.copyto(self._staging_arrays[row], self._pool_rows[block_id])
            else:  # one DMA into the pinned row, on the store's own stream, after the engine's last step
                self._store_stream.wait_stream(torch.cuda.current_stream(self._pool.device))
                with torch.cuda.stream(self._store_stream):
                    self._staging[row].copy_(self._pool[block_id], non_blocking=True)
                self._store_stream.synchronize()
        except (RuntimeError, IndexError, ValueError) as error:
            self._free_rows.append(row)
            raise OffloadIOError(f"staging block {block_id}: {error}") from error
        return row

    def write_staged(self, slot: int, row: int) -> None:
        """Write staging row `row` into `slot` (the I/O thread); the row is free again afterwards."""
        try:
            self._write_page(slot, self._staging[row].numpy())
        finally:
            self._free_rows.append(row)

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def forget(self, slot: int) -> None:
        """The slot holds no page any more (the I/O thread, in order with writes: a write queued
        earlier cannot make it readable again): a tensor-parallel rank that could not stage a page
        rank 0 stored makes its later loads fail rather than read an older page."""
        self._sums[slot] = None

    def _write_page(self, slot: int, data) -> None:  # type: ignore[no-untyped-def] - a numpy int8 row
        self._sums[slot] = None  # until the write completes no read can pass the check
        try:
            written = os.pwrite(self._fd, data, slot * self.page_bytes)
        except OSError as error:
            raise OffloadIOError(f"writing slot {slot}: {error}") from error
        if written != self.page_bytes:
            raise OffloadIOError(f"short write of slot {slot}: {written} of {self.page_bytes} bytes")
        self._sums[slot] = self._checksum(data)

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if len(slots) != len(block_ids):
            raise OffloadIOError("one slot per block")
        if self._pool_rows is not None:
            for slot, block_id in zip(slots, block_ids):
                # Straight into the pool row: a page that fails its check lands in a block that is
                # never cached, and the request's recompute starts over on fresh blocks.
                self._read_checked(slot, self._pool_rows[block_id])
            return
        copied: list = [None, None]  # per read row: the event of the DMA that still reads it
        try:
            for index, (slot, block_id) in enumerate(zip(slots, block_ids)):
                row = self._read_rows[index % 2]
                if copied[index % 2] is not None:
                    copied[index % 2].synchronize()  # its previous page has left for the device
                self._read_checked(slot, row.numpy())
                copied[index % 2] = self._to_device(row, block_id)
        finally:
            self._load_stream.synchronize()  # a fault too: no DMA outlives the read into a block reused next

    def _to_device(self, row: torch.Tensor, block_id: int) -> "torch.cuda.Event":
        try:
            with torch.cuda.stream(self._load_stream):
                self._pool[block_id].copy_(row, non_blocking=True)
                return self._load_stream.record_event()
        except RuntimeError as error:
            raise OffloadIOError(f"copying a page to block {block_id}: {error}") from error

    def _read_checked(self, slot: int, data) -> None:  # type: ignore[no-untyped-def] - a numpy int8 row
        try:
            num_read = os.preadv(self._fd, [data], slot * self.page_bytes)
        except OSError as error:
            raise OffloadIOError(f"reading slot {slot}: {error}") from error
        expected = self._sums[slot]
        if num_read != self.page_bytes or expected is None or self._checksum(data) != expected:
            raise OffloadIOError(f"slot {slot} is torn or corrupt")

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._lock_fd)
