"""File page store of the offload tier: pages in one file under --kv-offload-dir, read on an I/O thread.

Invariant: slot s is bytes [s * page_bytes, (s + 1) * page_bytes) of `pages.bin`,
and a read hands a page to the pool only if its CRC32 equals the one recorded
when it was written, so a torn or corrupt page is a failed load (the request
recomputes), never wrong tokens; a write that fails (a full disk) is a store
that did not happen.

    pool canonical view [num_blocks, page_bytes]          <dir>/pages.bin
    row b  --- write(s, b): pwrite at s*page_bytes, crc[s] = crc32(page) ---> [slot 0][slot 1]...[slot s]...
    row b' <-- read([s], [b']): preadv, check crc[s] (on the tier's I/O thread)

Start-up: the directory is locked (`flock` on `<dir>/lock`), so two workers
never share it, and `pages.bin` is truncated: the index lives in memory, so
no page survives a restart. That is the safe choice: nothing on disk can be
mistaken for another model's, dtype's, layout's or rank's KV.
"""

from __future__ import annotations

import fcntl
import os
import zlib
from typing import Sequence

import torch

from pdserve.kv.offload import OffloadIOError, store_geometry


class FilePageStore:
    medium = "disk"

    def __init__(self, pool_view: torch.Tensor, capacity_bytes: int, directory: str):
        self.page_bytes, self.num_slots = store_geometry(pool_view.shape, pool_view.dtype == torch.int8,
                                                         capacity_bytes)
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"--kv-offload-dir {directory} is in use by another worker") from None
        self.path = os.path.join(directory, "pages.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._crcs: list[int | None] = [None] * self.num_slots
        self._pool = pool_view
        self._on_cpu = pool_view.device.type == "cpu"
        # Staging rows off the CPU: one for writes (engine thread), one for reads (the I/O thread).
        self._write_row = torch.empty(self.page_bytes, dtype=torch.int8)
        self._read_row = torch.empty(self.page_bytes, dtype=torch.int8)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    def write(self, slot: int, block_id: int) -> None:
        row = self._pool[block_id]
        if not self._on_cpu:
            row = self._write_row.copy_(row)
        data = row.numpy()
        self._crcs[slot] = None  # a failed write leaves no page that could pass the check
        try:
            written = os.pwrite(self._fd, data, slot * self.page_bytes)
        except OSError as error:
            raise OffloadIOError(f"writing slot {slot}: {error}") from error
        if written != self.page_bytes:
            raise OffloadIOError(f"short write of slot {slot}: {written} of {self.page_bytes} bytes")
        self._crcs[slot] = zlib.crc32(data)

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if len(slots) != len(block_ids):
            raise OffloadIOError("one slot per block")
        for slot, block_id in zip(slots, block_ids):
            # On the CPU straight into the pool row: a page that fails its check lands in a block
            # that is never cached, and the request's recompute starts over on fresh blocks.
            row = self._pool[block_id] if self._on_cpu else self._read_row
            data = row.numpy()
            try:
                num_read = os.preadv(self._fd, [data], slot * self.page_bytes)
            except OSError as error:
                raise OffloadIOError(f"reading slot {slot}: {error}") from error
            expected = self._crcs[slot]
            if num_read != self.page_bytes or expected is None or zlib.crc32(data) != expected:
                raise OffloadIOError(f"slot {slot} is torn or corrupt")
            if not self._on_cpu:
                self._pool[block_id].copy_(row)

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._lock_fd)
