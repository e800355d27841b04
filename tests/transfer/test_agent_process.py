"""The agent process's mappings (pdserve/transfer/agent_process.py), in this process with a fake
NIXL agent: a mapping is known by start address and memfd inode, another memfd at a mapped start
is refused until the old one is unmapped (issue 36 item 4: reads landed in freed memory)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from pdserve.kv.shared_memory import MEMFD_NAME
from pdserve.transfer.agent_process import AgentServer

LENGTH = 1 << 16


def memfd_holding(byte: int) -> int:
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(fd, LENGTH)
    os.pwrite(fd, bytes([byte]) * 16, 0)
    return fd


def free_address() -> int:
    """An address nothing maps now (the agent's mappings go there)."""
    probe = mmap.mmap(-1, LENGTH)
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    probe.close()
    return address


def test_another_memfd_at_a_mapped_start_is_refused_until_unmapped():
    fds = []
    server = AgentServer(agent=None, receive_fd=lambda: os.dup(fds.pop(0)))
    old, new = memfd_holding(1), memfd_holding(2)
    start = free_address()
    try:
        fds.append(old)
        server.op_map(start, LENGTH)
        assert ctypes.string_at(start, 4) == b"\x01" * 4
        fds.append(old)
        server.op_map(start, LENGTH)  # the same memfd again: nothing to do
        fds.append(new)
        with pytest.raises(ValueError, match="unmap it first"):
            server.op_map(start, LENGTH)
        server.op_unmap(start)
        fds.append(new)
        server.op_map(start, LENGTH)
        assert ctypes.string_at(start, 4) == b"\x02" * 4  # the new memory, not the old
    finally:
        server.op_unmap(start)
        os.close(old)
        os.close(new)
