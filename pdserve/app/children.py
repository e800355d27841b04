"""What the child processes a composition root starts share: a free local port and dying with the parent
(their command line and environment: pdserve/api/child_process.py).

`pdserve up` starts prefill, decode and proxy; a tensor-parallel worker starts its other
ranks. Either way a child must not outlive the process that started it.
"""

from __future__ import annotations

import ctypes
import random
import socket
import sys
from typing import Collection, Optional

_PR_SET_PDEATHSIG = 1


_DEFAULT_EPHEMERAL_PORTS = (32768, 60999)  # Linux's default ip_local_port_range
_PORTS_BELOW_EPHEMERAL = 12000  # how far below the ephemeral range a port is drawn


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out as source ports of outgoing connections (and for bind to 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_PORTS


def free_port(host: str = "127.0.0.1", attempts: int = 64, taken: Collection[int] = ()) -> int:
    """A port free on `host` now, for a child to bind a moment later, and not in `taken` (ports
    already handed to other children, not bound yet: two independent draws once gave two workers of
    one `up` the same port). Drawn below the ephemeral range where there is room: a port from that
    range (what binding port 0 gives) can meanwhile become the source port of any outgoing
    connection on the host (a CI run once lost a worker so, "Address already in use"); one below it
    only to another listener. Port 0's answer when none is free."""
    low, _ = ephemeral_port_range()
    first = max(1024, low - _PORTS_BELOW_EPHEMERAL)
    draw = random.SystemRandom()  # never a seeded sequence that two processes would share
    for port in (draw.randrange(first, low) for _ in range(attempts if low - first >= 1000 else 0)):
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
                return port
            except OSError:
                continue
    for _ in range(max(attempts, 1)):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in taken:
            return port
    raise OSError(f"no free port on {host} outside the {len(taken)} already taken")


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
