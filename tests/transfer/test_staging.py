"""StagingBuffers: power-of-two buffers lent to one read at a time, reused, fenced while a copy out of
them runs, idle ones bounded, everything deregistered on close."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.transfer.staging import StagingBuffers, capacity_for

MIB = 1 << 20


class Memory:
    """Records what the cache allocates, registers and deregisters."""

    def __init__(self, fail_register: bool = False):
        self.allocated: list[int] = []
        self.registered: list[int] = []
        self.deregistered: list[int] = []
        self.fail_register = fail_register
        self._next_address = 1 << 30

    def allocate(self, num_bytes: int) -> np.ndarray:
        """An array like the tensors the transport allocates (== compares them element-wise): one
        entry per MiB, each holding the buffer's address."""
        self.allocated.append(num_bytes)
        self._next_address += num_bytes
        return np.full(num_bytes // MIB, self._next_address, dtype=np.int64)

    def register(self, memory: np.ndarray) -> int:
        if self.fail_register:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.registered.append(len(memory) * MIB)
        return int(memory[0])

    def deregister(self, registration: int) -> None:
        self.deregistered.append(registration)

    def cache(self, max_idle_bytes: int = 64 * MIB) -> StagingBuffers:
        return StagingBuffers(self.allocate, lambda m: int(m[0]), self.register, self.deregister,
                              max_idle_bytes=max_idle_bytes, min_bytes=MIB)


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_capacities_are_powers_of_two_of_at_least_the_minimum():
    assert capacity_for(1, MIB) == MIB
    assert capacity_for(MIB + 1, MIB) == 2 * MIB
    assert capacity_for(3 * MIB, MIB) == 4 * MIB
    assert capacity_for(4 * MIB, MIB) == 4 * MIB


def test_a_buffer_given_back_is_reused_without_a_new_allocation():
    memory = Memory()
    cache = memory.cache()
    buffer = cache.acquire(3 * MIB)
    assert buffer.capacity == 4 * MIB and buffer.address == int(buffer.memory[0])
    cache.give_back(buffer)
    for _ in range(5):
        again = cache.acquire(2 * MIB + 7)
        assert again is buffer
        cache.give_back(again)
    assert memory.allocated == [4 * MIB] and cache.total_bytes == 4 * MIB


def test_concurrent_reads_get_their_own_buffers_and_a_larger_read_grows_the_cache():
    memory = Memory()
    cache = memory.cache()
    first, second = cache.acquire(MIB), cache.acquire(MIB)
    assert first is not second
    cache.give_back(first)
    cache.give_back(second)
    big = cache.acquire(5 * MIB)
    assert big.capacity == 8 * MIB and memory.allocated == [MIB, MIB, 8 * MIB]
    cache.give_back(big)
    small = cache.acquire(MIB)
    assert any(small is b for b in (first, second))  # the smallest that fits
    cache.give_back(small)
    assert cache.acquire(6 * MIB) is big  # found past buffers of the same size (compared by identity)


def test_a_fenced_buffer_is_not_lent_before_its_copy_completed():
    memory = Memory()
    cache = memory.cache()
    buffer = cache.acquire(MIB)
    event = Event()
    cache.give_back(buffer, event)
    other = cache.acquire(MIB)
    assert other is not buffer
    cache.give_back(other)
    event.done = True
    taken = [cache.acquire(MIB), cache.acquire(MIB)]
    assert {id(b) for b in taken} == {id(buffer), id(other)}
    assert len(memory.allocated) == 2


def test_idle_buffers_are_bounded_smallest_dropped_first_and_an_oversized_one_at_once():
    memory = Memory()
    cache = memory.cache(max_idle_bytes=8 * MIB)
    small, large = cache.acquire(MIB), cache.acquire(8 * MIB)
    cache.give_back(small)
    cache.give_back(large)  # 9 MiB idle > 8: the 1 MiB buffer goes
    assert cache.idle_bytes == 8 * MIB and memory.deregistered == [small.registration]
    huge = cache.acquire(16 * MIB)
    cache.give_back(huge)  # larger than the bound on its own
    assert cache.idle_bytes == 8 * MIB and memory.deregistered[-1] == huge.registration


def test_close_deregisters_every_buffer_lent_or_idle():
    memory = Memory()
    cache = memory.cache()
    lent, idle = cache.acquire(MIB), cache.acquire(2 * MIB)
    cache.give_back(idle)
    cache.close()
    assert sorted(memory.deregistered) == sorted([lent.registration, idle.registration])
    assert cache.total_bytes == 0
    cache.close()  # idempotent
    cache.give_back(lent)  # no longer known: ignored
    assert cache.total_bytes == 0


def test_a_registration_failure_reaches_the_caller_and_leaves_nothing_lent():
    memory = Memory(fail_register=True)
    cache = memory.cache()
    with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND"):
        cache.acquire(MIB)
    assert cache.total_bytes == 0


def test_bad_bounds_are_refused():
    memory = Memory()
    with pytest.raises(ValueError):
        StagingBuffers(memory.allocate, lambda m: 0, memory.register, memory.deregister, max_idle_bytes=-1)
