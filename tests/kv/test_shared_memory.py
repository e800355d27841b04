"""The memfd behind the engine's shared pool is sealed at its size (issue 36, item 9): neither the
engine nor the agent process, nor anyone handed the descriptor, can shrink it (which would turn every
access past the new end into SIGBUS) or grow it."""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys

import pytest

from pdserve.kv.shared_memory import region_of, shared_zeros

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd is Linux only")


def test_the_shared_memfd_can_neither_shrink_nor_grow():
    backing = shared_zeros(1 << 16)
    address = ctypes.addressof(ctypes.c_char.from_buffer(backing))
    region = region_of(address, 1 << 16)
    seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(region.fd, 4096)
    with pytest.raises(PermissionError):
        os.ftruncate(region.fd, 1 << 20)
    assert os.fstat(region.fd).st_size == 1 << 16
    backing[100] = 7  # still writable: only its size is sealed
    assert backing[100] == 7
