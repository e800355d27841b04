"""Cores that follow the work: a prefill and a decode worker on one machine lend each other their cores.

`pdserve up` starts both workers unpinned, each with its share of the cores as its thread count
(`--num-threads`), and gives them one small shared file, the core ledger (`--core-ledger`):

    ledger file: [ prefill busy | decode busy | ... ]   one byte per role, 0 idle, 1 busy
                   written by P    written by D

Every step, a worker writes whether it has work (requests waiting, loading or running) into its
own byte and reads its peer's. While the peer is idle it runs with every core of the machine
(`wide` threads: a lone long prefill gets the whole machine); as soon as the peer has work it runs
with its own share (`narrow`), so two busy workers never oversubscribe the cores. A worker
narrows at its next step, so an overlap lasts at most one step of the wider worker: bound the
prefill worker's steps (--max-step-ms, --max-num-batched-tokens) to bound it.

Why not oversubscription (both workers always at `wide`): measured in docs/benchmarks.md
("Goodput"), two busy workers' spinning intra-op threads slow each other down far more than a
lone worker gains. Why not static pinning: a lone worker then idles half the machine.
The ledger is created O_EXCL|O_NOFOLLOW (0600) and opened O_NOFOLLOW, checked to be this user's
regular file of exactly LEDGER_BYTES, so a planted link or a short file is a start-up error, not a
write elsewhere or a SIGBUS. Torch-free: the thread count is set through the callable the engine gives.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from typing import Callable

logger = logging.getLogger(__name__)

ROLE_SLOTS = {"prefill": 0, "decode": 1}
PEER = {"prefill": "decode", "decode": "prefill"}
LEDGER_BYTES = 64


def create_ledger(path: str) -> None:
    """A fresh ledger: both roles idle (`pdserve up` makes it, in a directory of its own, before starting
    the workers). Never through a link, never over an existing file: ValueError then."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        raise ValueError(f"cannot create the core ledger {path}: {error}") from error
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(LEDGER_BYTES))


def _open_checked_ledger(path: str) -> int:
    """A read-write descriptor of the ledger at `path`: not a link, a regular file of this user,
    exactly LEDGER_BYTES long (a shorter one would fault when mapped); ValueError otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as error:  # ELOOP: a link at the path
        raise ValueError(f"cannot open the core ledger {path}: {error}") from error
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
    elif info.st_size != LEDGER_BYTES:
        problem = f"holds {info.st_size} bytes, not {LEDGER_BYTES}"
    if problem is not None:
        os.close(fd)
        raise ValueError(f"the core ledger {path} {problem}")
    return fd


class CoreShare:
    """One worker's side of the ledger (engine thread only)."""

    def __init__(self, ledger: "bytearray | mmap.mmap", role: str, narrow: int, wide: int,
                 set_threads: Callable[[int], None]):
        if role not in ROLE_SLOTS:
            raise ValueError(f"--core-ledger is for prefill and decode workers, not {role}")
        if not 1 <= narrow <= wide:
            raise ValueError(f"threads: need 1 <= own share ({narrow}) <= all cores ({wide})")
        self._ledger = ledger
        self._own = ROLE_SLOTS[role]
        self._peer = ROLE_SLOTS[PEER[role]]
        self.narrow = narrow
        self.wide = wide
        self._set_threads = set_threads
        self._published = None  # what this worker last wrote
        self.threads = narrow
        self.num_changes = 0

    def before_step(self, busy: bool) -> int:
        """Publish this worker's state and pick its threads for the step; returns them."""
        self.publish(busy)
        wanted = self.narrow if self._ledger[self._peer] else self.wide
        if wanted != self.threads:
            self._set_threads(wanted)
            self.threads = wanted
            self.num_changes += 1
        return wanted

    def publish(self, busy: bool) -> None:
        """Write this worker's state (after a step too: the one that ended its work must say so)."""
        if busy != self._published:
            self._ledger[self._own] = 1 if busy else 0
            self._published = busy


def open_core_share(path: str, role: str, narrow: int, wide: int,
                    set_threads: Callable[[int], None]) -> CoreShare:
    """The worker's side of the ledger file at `path` (made by `create_ledger`); starts narrow."""
    fd = _open_checked_ledger(path)
    try:
        ledger = mmap.mmap(fd, LEDGER_BYTES)
    finally:
        os.close(fd)  # the mapping stays valid
    share = CoreShare(ledger, role, narrow, wide, set_threads)  # checks the role and thread counts first
    set_threads(narrow)
    logger.info("core ledger %s: %s worker runs %d threads while the %s worker has work, %d otherwise",
                path, role, narrow, PEER[role], wide)
    return share
