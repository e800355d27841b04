"""The host-memory offload tier of a tensor-parallel worker: rank 0 decides what moves, every rank
copies its own slice.

    rank 0 (KV manager, OffloadTier)                       rank r > 0
    evict block b -> RankedPageStore.write(s, b)
                       copy rank 0's slice of b -> slot s
                       queue TierWrite(s, b) ------+
    tier hit -> RankedPageStore.read([s], [b'])    |  channel: the queued commands ride on the next
                       copy slot s -> b'           |  message, ahead of its step and of the
                       queue TierRead([s], [b']) --+  transport's commands
                                                   +-->  TierFollower.apply(commands), in order:
                                                         the same copies on rank r's slice of b, b'

Invariants: a follower applies a message's tier copies before that message's step, in the order
rank 0 made them, so a page is copied out of block b before any step or pull overwrites b, and a
loaded block holds its page before a step reads it. Only copies that succeeded on rank 0 are sent.
Every rank's tier has the same number of slots (rank 0's, sent in `RankSetup`), each slot one page
of that rank's slice. Host memory only: a copy between two of a process's own buffers does not
fail on one rank alone, so a follower whose copy fails cannot stay in step and stops the worker
(`RanksLost`). The file tier, whose reads can fail on one rank alone, is refused with TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pdserve.kv.offload import OffloadIOError, PageStore
from pdserve.parallel.ranks import RanksLost


@dataclass(frozen=True, slots=True)
class TierWrite:
    slot: int
    block_id: int


@dataclass(frozen=True, slots=True)
class TierRead:
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]


class RankedPageStore:
    """Rank 0's page store: copies its own slice, then tells the other ranks to copy theirs."""

    def __init__(self, own: PageStore, queue: Callable[[Any], None]):
        self.own = own
        self._queue = queue
        self.medium = own.medium
        self.num_slots = own.num_slots
        self.page_bytes = own.page_bytes

    def write(self, slot: int, block_id: int) -> None:
        self.own.write(slot, block_id)
        self._queue(TierWrite(slot, block_id))

    def read(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        self.own.read(slots, block_ids)
        self._queue(TierRead(tuple(slots), tuple(block_ids)))


class TierFollower:
    """Rank r's side: applies rank 0's tier copies to its own slice (other commands are not its own)."""

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
