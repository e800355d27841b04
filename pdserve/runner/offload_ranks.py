"""The offload tier of a tensor-parallel worker: rank 0 decides what moves, every rank copies its own slice.

    rank 0 (KV manager, OffloadTier)                         rank r > 0
    evict block b -> store its slice into slot s
                     RankMirror.stored(s, b)
                       queue TierWrite(s, b) -------+
    tier hit -> read slot s into block b'           |  channel: the queued commands ride on the next
                     RankMirror.loading(id, s, b')  |  message, ahead of its step and of the
                       queue TierRead(s, b', id) ---+  transport's commands
                                                    +--> follower.apply(commands), in order:
                                                         the same copies on rank r's slice of b, b'
    file tier, poll: others_read(id)?
      asks for a report <---------- RankReport.tier_reads: (id, error) of reads ended on rank r

Host memory (`HostTierFollower`): every copy is a memcpy, made as the command is applied, before the
message's step; a copy between two of a process's own buffers does not fail on one rank alone, so a
follower whose copy fails cannot stay in step and stops the worker (`RanksLost`), and rank 0 need not
hear back. Files (`FileTierFollower`): each rank keeps its slice's pages in a file of its own
(`rank-<r>/` under --kv-offload-dir) and reads and writes them on its own I/O thread, in rank 0's
order. A read can fail on one rank alone (a torn page, a full disk at its write), so rank 0's tier
lands a load only when every rank reported its read, and fails it (the request recomputes) when any
read failed. A follower that cannot stage a page (its disk lags) forgets the slot instead, so a later
load of it fails there rather than read an older page.

Invariants: a follower applies a message's tier commands before that message's step, in the order rank
0 made them, so a page is copied out of block b before any step or pull overwrites b; a loaded block is
read by no step until its load landed on every rank. Only copies that started on rank 0 are sent. Every
rank's tier has the same number of slots (rank 0's, sent in `RankSetup`), each slot one page of that
rank's slice.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from pdserve.kv.offload import OffloadIOError, OthersRead, PageStore
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_writes import WriteQueue
from pdserve.parallel.ranks import RanksLost

ASK_INTERVAL_S = 0.001  # rank 0 asks the others how their reads ended at most this often

TierReadOutcome = tuple[str, Optional[str]]  # (load id, why the read failed or None)


@dataclass(frozen=True, slots=True)
class TierWrite:
    slot: int
    block_id: int


@dataclass(frozen=True, slots=True)
class TierRead:
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    load_id: str = ""


class CommandLink(Protocol):
    """Rank 0's channel to the others (pdserve.parallel.channel.LeaderChannel)."""

    tier_reads: deque

    def queue(self, command: Any) -> None: ...

    def send(self, step: Any = None, decode_step: bool = False, logit_rows: tuple = (),
             want_report: bool = False) -> list[Any]: ...


class RankMirror:
    """Rank 0's side (an `OffloadTier`'s mirror): queues its copies for the others and, when their
    reads can fail (`others_answer`: file tiers), collects how each load's reads ended."""

    def __init__(self, link: CommandLink, num_others: int, others_answer: bool,
                 clock: Callable[[], float] = time.monotonic):
        self._link = link
        self._num_others = num_others
        self._others_answer = others_answer
        self._clock = clock
        self._asked_s = float("-inf")
        self._answers: dict[str, list[Any]] = {}  # load id -> [ranks still reading, first error]

    def stored(self, slot: int, block_id: int) -> None:
        self._link.queue(TierWrite(slot, block_id))

    def loading(self, load_id: str, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        self._link.queue(TierRead(tuple(slots), tuple(block_ids), load_id))
        if self._others_answer:
            self._answers[load_id] = [self._num_others, None]

    def others_read(self, load_id: str) -> Optional[OthersRead]:
        if not self._others_answer:
            return OthersRead()
        self._take_answers()
        if load_id not in self._answers:  # never started on the others: do not trust its blocks
            return OthersRead(f"no other rank was told to read load {load_id}")
        if self._answers[load_id][0] > 0 and self._clock() - self._asked_s >= ASK_INTERVAL_S:
            self._asked_s = self._clock()
            self._link.send(want_report=True)  # the answers arrive in the link's tier_reads
            self._take_answers()
        num_reading, error = self._answers[load_id]
        if num_reading > 0:
            return None
        del self._answers[load_id]
        return OthersRead(error)

    def _take_answers(self) -> None:
        reads = self._link.tier_reads
        while reads:
            load_id, error = reads.popleft()
            entry = self._answers.get(load_id)
            if entry is None:
                continue
            entry[0] -= 1
            if error is not None and entry[1] is None:
                entry[1] = error


class HostTierFollower:
    """Rank r's host-memory tier: applies rank 0's copies to its own slice as they arrive."""

    def __init__(self, store: PageStore, rank: int):
        self.store = store
        self.rank = rank

    def apply(self, commands: Sequence[Any]) -> None:
        for command in commands:
            try:
                if isinstance(command, TierWrite):
                    self.store.write(command.slot, command.block_id)
                elif isinstance(command, TierRead):
                    self.store.read(command.slots, command.block_ids)
            except OffloadIOError as error:
                raise RanksLost(f"rank {self.rank}: an offload tier copy failed ({error}); "
                                "its slice would differ from rank 0's") from error

    def report(self) -> tuple[TierReadOutcome, ...]:
        return ()  # every copy already ended, and only a lost rank fails one

    def close(self) -> None:
        pass


class FileTierFollower:
    """Rank r's file tier: stages pages as the commands arrive, writes and reads them on its own I/O
    thread in the same order, and reports how each read ended."""

    def __init__(self, store: FilePageStore, rank: int, executor: Executor):
        self.store = store
        self.rank = rank
        self._executor = executor
        self._writes = WriteQueue(store, executor)
        self._ended: deque[TierReadOutcome] = deque()  # appended by the I/O thread

    def apply(self, commands: Sequence[Any]) -> None:
        self._writes.finished()  # a failed write needs no word: the slot's next read fails its check
        for command in commands:
            if isinstance(command, TierWrite):
                self._store(command.slot, command.block_id)
            elif isinstance(command, TierRead):
                self._executor.submit(self._read, command)

    def _store(self, slot: int, block_id: int) -> None:
        if self._writes.has_room():
            try:
                self._writes.submit(slot, block_id)
                return
            except OffloadIOError:
                pass
        self._executor.submit(self.store.forget, slot)  # after any write of the slot queued before

    def _read(self, command: TierRead) -> None:
        error: Optional[str] = None
        try:
            self.store.read(command.slots, command.block_ids)
        except Exception as failure:  # noqa: BLE001 - rank 0 fails the load; the request recomputes
            error = f"rank {self.rank}: {failure}"
        self._ended.append((command.load_id, error))

    def report(self) -> tuple[TierReadOutcome, ...]:
        """Reads that ended since the last report."""
        ended = []
        while self._ended:
            ended.append(self._ended.popleft())
        return tuple(ended)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.store.close()
