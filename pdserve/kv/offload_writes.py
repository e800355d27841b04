"""Stores of the offload tier that finish on its I/O thread: the engine thread only stages the page.

Invariant: a store's outcome concerns its slot only while it is the slot's
latest write (a slot reused before an older write ran gets the newer page:
the one I/O thread runs writes and reads in submission order, so the newer
write lands last and a read queued after a write sees its bytes). Torch-free.

    engine thread (offer)                         I/O thread (one, FIFO)
    pool row b --stage(b): copy--> staging row r  ...  write_staged(s, r): pwrite, sum[s]; r free again
    submit(write s, r) ---------------------------> [write s][read s'][write s]...
    finished(): outcomes appended by the I/O thread, drained here, oldest first
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, runtime_checkable


@runtime_checkable
class StagingPageStore(Protocol):
    """A page store whose writes run on the I/O thread from a few staging rows (pdserve/kv/offload_file.py)."""

    num_free_staging_rows: int

    def stage(self, block_id: int) -> int:
        """Engine thread: copy pool page `block_id` into a free staging row and return the row
        (the block may be reused at once); raise OffloadIOError when no row is free or the copy fails."""

    def write_staged(self, slot: int, row: int) -> None:
        """I/O thread: write staging row `row` into `slot`, then free the row, whatever happened;
        raise OffloadIOError when the medium refuses (the slot then holds no page)."""

    def release_row(self, row: int) -> None:
        """Free a staged row whose write will never run."""


@dataclass(slots=True)
class FinishedWrite:
    slot: int
    is_latest: bool  # no later write of the slot was submitted: the outcome is the slot's
    error: Optional[BaseException]
    duration_s: float  # the write itself, on the I/O thread


@runtime_checkable
class OrderedExecutor(Protocol):
    """An executor that says it runs its jobs one at a time, in submission order (the I/O thread's contract)."""

    runs_one_at_a_time: bool

    def submit(self, fn: Callable, /, *args, **kwargs): ...


class SerialExecutor(ThreadPoolExecutor):
    """A thread pool of exactly one thread: the offload tier's I/O executor."""

    runs_one_at_a_time = True

    def __init__(self, thread_name_prefix: str = "pdserve-kv-offload"):
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)


def require_serial(executor: Executor) -> None:
    """ValueError unless `executor` is an OrderedExecutor (a SerialExecutor): a read must run after the
    writes queued before it, and two writes of one slot must not interleave."""
    if not (isinstance(executor, OrderedExecutor) and executor.runs_one_at_a_time):
        raise ValueError(f"the offload tier's I/O executor must run one worker in order "
                         f"(a SerialExecutor), not {type(executor).__name__}")


class WriteQueue:
    """The staged writes one tier has in flight on its I/O executor."""

    def __init__(self, store: StagingPageStore, executor: Executor, clock: Callable[[], float] = time.perf_counter):
        require_serial(executor)
        self._store = store
        self._executor = executor
        self._clock = clock
        self._num_submitted = 0
        self._latest: dict[int, int] = {}  # slot -> number of its latest write still unreported
        # Appended by the I/O thread, drained by the engine thread (deque operations are atomic).
        self._finished: deque[tuple[int, int, Optional[BaseException], float]] = deque()

    def has_room(self) -> bool:
        """Whether a staging row is free (only the engine thread takes rows, so `submit` will get one)."""
        return self._store.num_free_staging_rows > 0

    @property
    def num_queued(self) -> int:
        return len(self._latest)

    def submit(self, slot: int, block_id: int) -> None:
        """Stage the page now, write it on the I/O thread; raises OffloadIOError when staging fails."""
        row = self._store.stage(block_id)
        try:
            self._executor.submit(self._write, slot, row, self._num_submitted + 1)
        except RuntimeError:  # the executor was shut down: this store does not happen
            self._store.release_row(row)
            raise
        self._num_submitted += 1
        self._latest[slot] = self._num_submitted

    def _write(self, slot: int, row: int, number: int) -> None:
        started = self._clock()
        error: Optional[BaseException] = None
        try:
            self._store.write_staged(slot, row)
        except Exception as failure:  # noqa: BLE001 - reported to the engine thread, never lost
            error = failure
        self._finished.append((slot, number, error, self._clock() - started))

    def finished(self) -> list[FinishedWrite]:
        """Writes that ended since the last call, in the order they ran."""
        outcomes = []
        while self._finished:
            slot, number, error, duration_s = self._finished.popleft()
            is_latest = self._latest.get(slot) == number
            if is_latest:
                del self._latest[slot]
            outcomes.append(FinishedWrite(slot, is_latest, error, duration_s))
        return outcomes
