"""Waiting for a word of shared memory to change, and waking whoever waits on it: Linux futexes.

A waiter sleeps in the kernel until the word's owner wakes it (or its timeout passes), using no CPU
meanwhile; the kernel compares the word with the value the waiter last saw before sleeping, so a
change between the waiter's check and its sleep is never missed. The word is the low half of a
little-endian int64 flag, which changes at every increment. x86-64 only (the syscall number), as the
shared-memory path is. Torch-free; ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import errno
from typing import Optional

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the word lives in memory other processes map
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """futex(2) wait and wake on addresses of a shared mapping."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, address: int, seen: int, timeout_s: float) -> None:
        """Sleep while the 32-bit word at `address` still holds the low half of `seen`, at most
        `timeout_s`; returns on a wake, a change, the timeout or a signal alike (the caller re-checks)."""
        whole_s = int(timeout_s)
        timeout = _Timespec(whole_s, int((timeout_s - whole_s) * 1e9))
        self._syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
                      ctypes.c_int(seen & 0xFFFFFFFF), ctypes.byref(timeout), None, ctypes.c_int(0))

    def wake(self, address: int) -> None:
        """Wake every process waiting on the word at `address`."""
        self._syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
                      ctypes.c_int(_WAKE_ALL), None, None, ctypes.c_int(0))


def futex_check(address: int) -> Optional[str]:
    """Why futexes cannot be used here (None: they can): a wake on `address` must not fail."""
    try:
        futex = Futex()
    except OSError as error:
        return f"no libc for futex(2): {error}"
    ctypes.set_errno(0)
    result = futex._syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
                            ctypes.c_int(1), None, None, ctypes.c_int(0))
    if result < 0:
        return f"futex(2) wake failed: {errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())}"
    return None
