"""Host-memory page store of the offload tier: pool pages copied into a host buffer and back.

Invariant: slot s is one contiguous row of `page_bytes` bytes, the same shape
as a row of the pool's canonical int8 view, so a page moves as one copy:

    pool canonical view [num_blocks, page_bytes]      host buffer [num_slots, page_bytes]
    row block_id  ------------- write(slot, block_id) -------------> row slot
    row block_id  <------------ read([slot], [block_id]) ----------- row slot

On the CPU a page moves as one `numpy.copyto` on the calling thread: torch's
`copy_`/`index_copy_` would gather into a temporary and hand a 720 KiB copy to
its intra-op threads, which share the engine's cores (docs/benchmarks.md,
"KV offload tier: loads"). On CUDA the buffer is pinned and a page moves as one
DMA between its pinned row and its pool row, queued on the store's own stream
(never a gather through pageable memory), and each call waits for the stream:
the engine thread calls these between steps, when no kernel touches the pool
(the loop synchronizes after every step). Both directions stay
synchronous on purpose: a store is one page memcpy (tens of microseconds), the
same copy the file store makes into a staging row before its I/O thread takes
over, so an I/O thread would add a hand-off and save nothing.
"""

from __future__ import annotations

from typing import Sequence

import numpy
import torch

from pdserve.kv.offload import OffloadIOError, store_geometry


class HostPageStore:
    medium = "cpu"

    def __init__(self, pool_view: torch.Tensor, capacity_bytes: int):
        self.page_bytes, self.num_slots = store_geometry(pool_view.shape, pool_view.dtype == torch.int8,
                                                         capacity_bytes)
        self._pool = pool_view
        on_cuda = pool_view.device.type == "cuda"
        self._buffer = torch.empty((self.num_slots, self.page_bytes), dtype=torch.int8, pin_memory=on_cuda)
        self._stream = torch.cuda.Stream(pool_view.device) if on_cuda else None
        self._cpu_rows = None if on_cuda else (pool_view.numpy(), self._buffer.numpy())  # (pool, buffer)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    def close(self) -> None:
        """Host memory is released with the store itself: nothing to close."""

    def write(self, slot: int, block_id: int) -> None:
        if self._cpu_rows is not None:
            pool, buffer = self._cpu_rows
            self._copy(lambda: numpy.copyto(buffer[slot], pool[block_id]))
            return
        self._copy(lambda: self._buffer[slot].copy_(self._pool[block_id], non_blocking=True))

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if len(slots) != len(block_ids):
            raise OffloadIOError("one slot per block")
        if self._cpu_rows is not None:
            pool, buffer = self._cpu_rows

            def copy_each() -> None:
                for slot, block_id in zip(slots, block_ids):
                    numpy.copyto(pool[block_id], buffer[slot])
        else:
            def copy_each() -> None:
                for slot, block_id in zip(slots, block_ids):  # pinned row -> pool row: one DMA each
                    self._pool[block_id].copy_(self._buffer[slot], non_blocking=True)

        if slots:
            self._copy(copy_each)

    def _copy(self, copy) -> None:  # type: ignore[no-untyped-def]
        try:
            if self._stream is None:
                copy()
                return
            self._stream.wait_stream(torch.cuda.current_stream(self._pool.device))
            try:
                with torch.cuda.stream(self._stream):
                    copy()
            finally:
                self._stream.synchronize()  # a fault too: no DMA outlives the call into a block reused next
        except (RuntimeError, IndexError, ValueError) as error:
            raise OffloadIOError(str(error)) from error
