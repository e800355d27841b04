"""What the child processes a composition root starts share: a free local port and dying with the parent
(their command line and environment: pdserve/api/child_process.py).

`pdserve up` starts prefill, decode and proxy; a tensor-parallel worker starts its other
ranks. Either way a child must not outlive the process that started it.
"""

from __future__ import annotations

import ctypes
import socket
import sys
from typing import Optional

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def linux_libc() -> Optional[ctypes.CDLL]:
    """The C library on Linux (for prctl), else None. Load it before forking: a child set-up may
    only call it."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent(libc: ctypes.CDLL, signal_number: int) -> None:
    """In a child between fork and exec: have Linux send it `signal_number` when its parent ends,
    however the parent ends."""
    libc.prctl(_PR_SET_PDEATHSIG, signal_number)
