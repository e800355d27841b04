"""Host memory that the engine's process and its NIXL agent process map at one address.

The agent process (pdserve/transfer/agent_process.py) registers the pool with NIXL and serves
the peers' READs of it; the engine writes the KV. Both map the same memfd at the same virtual
address, so every address the engine computes (pool base + page offsets, staging buffers, the
base it advertises to peers) is valid in the agent unchanged:

    engine process                                agent process
    +------------------------------+              +------------------------------+
    | pool    @ 0x7f3a00000000     |    memfd     | pool    @ 0x7f3a00000000     |  registered
    | (torch.frombuffer of it)     | <----------> | (MAP_FIXED_NOREPLACE)        |  with NIXL
    +------------------------------+  same pages  +------------------------------+
    | staging @ 0x7f3b10000000     | <----------> | staging @ 0x7f3b10000000     |
    +------------------------------+              +------------------------------+

The engine finds the memfd behind an address from /proc/self/maps (inode) and /proc/self/fd,
and sends it to the agent over their socket (SCM_RIGHTS). The agent maps it with
MAP_FIXED_NOREPLACE: it never replaces a mapping of its own (the memfd is sealed at its size,
F_SEAL_SHRINK|F_SEAL_GROW, so neither side can pull pages from under the other); if the address is taken there the
map fails and the engine starts another agent process (a new random layout). Linux only;
torch-free and nixl-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
from dataclasses import dataclass

MEMFD_NAME = "pdserve-shared"
_MAP_FIXED_NOREPLACE = 0x100000  # Linux >= 4.17; older kernels take the address as a hint (checked below)
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """One memfd mapping of this process: [start, start + length), its file descriptor here."""

    start: int
    length: int
    fd: int


def shared_zeros(num_bytes: int) -> mmap.mmap:
    """A zeroed MAP_SHARED mapping of a fresh memfd, sealed against shrinking and growing, advised for transparent huge pages (they apply
    only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it). The memfd stays open
    through the mmap object's own descriptor, which is how `region_of` finds it."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        # Its size is fixed from here on, for every process it reaches: a shrunk memfd would turn the
        # other side's accesses past the new end into SIGBUS, and nothing here expects one to grow.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        backing = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            backing.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return backing


def region_of(address: int, length: int) -> SharedRegion:
    """The memfd mapping of this process holding [address, address + length); ValueError if none does."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address and address + length <= end:
                path = fields[5].strip() if len(fields) > 5 else ""
                if not path.startswith(f"/memfd:{MEMFD_NAME}") or "s" not in fields[1]:
                    break
                inode, offset = int(fields[4]), int(fields[2], 16)
                fd = _fd_of_inode(inode)
                return SharedRegion(start - offset, os.fstat(fd).st_size, fd)
    raise ValueError(f"memory at {address:#x} (+{length}) is not shared memory of pdserve "
                     "(allocate it with pdserve.kv.shared_memory.shared_zeros)")


def _fd_of_inode(inode: int) -> int:
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{MEMFD_NAME}") and \
                    os.fstat(int(name)).st_ino == inode:
                return int(name)
        except OSError:  # the descriptor listing itself, or one closed meanwhile
            continue
    raise ValueError(f"no open descriptor of memfd inode {inode}")


def map_at(fd: int, address: int, length: int) -> None:
    """Map memfd `fd` at exactly `address` in this process (the agent's side); OSError if taken."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    got = libc.mmap(ctypes.c_void_p(address), length, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE, fd, 0)
    if got is None or got == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot map shared memory at {address:#x}: {os.strerror(error)}")
    if got != address:  # a kernel without MAP_FIXED_NOREPLACE placed it elsewhere
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(ctypes.c_void_p(got), length)
        raise OSError(17, f"cannot map shared memory at {address:#x}: the kernel placed it at {got:#x}")


def unmap_at(address: int, length: int) -> None:
    """Undo `map_at` (the agent's side, once nothing registered there is left); OSError if refused."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if libc.munmap(ctypes.c_void_p(address), length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot unmap shared memory at {address:#x}: {os.strerror(error)}")
