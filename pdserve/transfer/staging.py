"""Staging buffers for staged reads: registered scratch memory a READ lands in before its chunks
are copied into the pool, kept for reuse because allocating and registering memory per read would
cost more than the descriptors staging saves.

Invariants:
* a buffer is either lent (to one read) or idle, never both; only idle buffers are lent;
* an idle buffer whose fence has not completed (a GPU copy out of it still running) is not lent;
* capacities are powers of two (at least `min_bytes`), so a few sizes serve every read;
* idle buffers total at most `max_idle_bytes`: giving one back frees the smallest idle ones until
  they fit; one larger than the bound on its own is freed at once, the others kept;
* `close` deregisters and drops every buffer, lent ones included (their reads must be over).

Memory comes from the callbacks the transport passes (how to allocate, register, deregister), so
this module imports neither torch nor nixl.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

logger = logging.getLogger(__name__)


class Fence(Protocol):
    """Something still running on a buffer (a CUDA event): `query()` is True once it completed."""

    def query(self) -> bool: ...


@dataclass(slots=True, eq=False)  # by identity: comparing fields would compare the memory (tensors) element-wise
class StagingBuffer:
    memory: Any  # what `allocate` returned (a tensor); keeps the memory alive
    address: int
    capacity: int  # bytes
    registration: Any  # what `register` returned
    fence: Optional[Fence] = None

    def idle_ready(self) -> bool:
        return self.fence is None or self.fence.query()


def capacity_for(num_bytes: int, min_bytes: int) -> int:
    """The smallest power of two >= max(num_bytes, min_bytes)."""
    return 1 << (max(num_bytes, min_bytes, 1) - 1).bit_length()


class StagingBuffers:
    """A free list of registered buffers. `allocate(n)` returns memory of n bytes, `address_of`
    its address, `register(memory)` a registration `deregister` undoes. Every callback may raise;
    `acquire` lets the error through (the caller turns it into a failed or direct read)."""

    def __init__(self, allocate: Callable[[int], Any], address_of: Callable[[Any], int],
                 register: Callable[[Any], Any], deregister: Callable[[Any], None], *, max_idle_bytes: int,
                 min_bytes: int = 1 << 20):
        if max_idle_bytes < 0 or min_bytes < 1:
            raise ValueError(f"max_idle_bytes must be >= 0 and min_bytes >= 1, got {max_idle_bytes}, {min_bytes}")
        self._allocate, self._address_of = allocate, address_of
        self._register, self._deregister = register, deregister
        self._max_idle_bytes = max_idle_bytes
        self._min_bytes = min_bytes
        self._idle: list[StagingBuffer] = []
        self._lent: dict[int, StagingBuffer] = {}  # id(buffer) -> buffer

    @property
    def total_bytes(self) -> int:
        """Bytes of every buffer held, idle or lent."""
        return sum(b.capacity for b in self._idle) + sum(b.capacity for b in self._lent.values())

    @property
    def idle_bytes(self) -> int:
        return sum(b.capacity for b in self._idle)

    def acquire(self, num_bytes: int) -> StagingBuffer:
        """An idle buffer of at least `num_bytes` (the smallest that is ready), or a new one."""
        fitting = [b for b in self._idle if b.capacity >= num_bytes and b.idle_ready()]
        if fitting:
            buffer = min(fitting, key=lambda b: b.capacity)
            self._idle.remove(buffer)
            buffer.fence = None
        else:
            buffer = self._new(capacity_for(num_bytes, self._min_bytes))
        self._lent[id(buffer)] = buffer
        return buffer

    def _new(self, capacity: int) -> StagingBuffer:
        memory = self._allocate(capacity)
        registration = self._register(memory)
        logger.info("staging buffer of %d bytes registered", capacity)
        return StagingBuffer(memory, self._address_of(memory), capacity, registration)

    def give_back(self, buffer: StagingBuffer, fence: Optional[Fence] = None) -> None:
        """Return a lent buffer; `fence`: work still reading it (it is not lent again before that completed)."""
        if self._lent.pop(id(buffer), None) is None:
            return
        buffer.fence = fence
        if buffer.capacity > self._max_idle_bytes and buffer.idle_ready():
            self._free(buffer)  # never kept: the idle ones stay as they are
            return
        self._idle.append(buffer)
        self._idle.sort(key=lambda b: b.capacity)
        while self._idle and self.idle_bytes > self._max_idle_bytes:
            victim = next((b for b in self._idle if b.idle_ready()), None)
            if victim is None:  # everything still fenced: trim at a later give_back
                break
            self._idle.remove(victim)
            self._free(victim)

    def _free(self, buffer: StagingBuffer) -> None:
        try:
            self._deregister(buffer.registration)
        except Exception as exc:  # NIXL binding errors share no base class
            logger.warning("deregistering a staging buffer of %d bytes failed: %r", buffer.capacity, exc)

    def close(self) -> None:
        """Deregister and drop every buffer. Idempotent."""
        for buffer in [*self._idle, *self._lent.values()]:
            self._free(buffer)
        self._idle.clear()
        self._lent.clear()
