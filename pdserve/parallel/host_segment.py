"""The shared-memory segment that the ranks of one worker on one host exchange tensors through.

    offset 0          64        64*(1+r)                 PAGE             PAGE + size*slot_bytes
    +-----------------+---------+--------+-- ... --+------+-------------------------+---------------------+
    | magic | nonce   | rank 0  | rank 1 |         | pad  | buffer 0:               | buffer 1:           |
    | (16 B)| (16 B)  | line    | line   |         |      | slot r0 | slot r1 | ... | slot r0 | slot r1 ..|
    +-----------------+---------+--------+-- ... --+------+-------------------------+---------------------+
    a rank's 64-byte line: [flag int64 | pid int64 | pid namespace inode int64 | unused]; no two ranks
    write the same cache line                                           slots: slot_bytes each

A rank's flag is the number of the last exchange it published (0: none yet). Exchange `s` uses buffer
s % 2. Invariant: a rank writes its slot of exchange s only after every rank published s - 1, and
every rank has finished reading exchange s - 2 (the buffer's previous contents) before it publishes
s - 1; so one flag per rank and two buffers keep writers and readers apart without a second barrier.

Rank 0 creates the segment as a file under /dev/shm (mode 0600, a random name, its pages reserved
up front so a full tmpfs fails here and not as SIGBUS later), writes a random nonce, and sends the
name and nonce over the control channel; a rank that opens that file and reads the same nonce
shares memory with rank 0. Rank 0 unlinks the file once every rank answered; the mappings live on.
A waiting rank spins up to 200 us, then sleeps on the flag it waits for (a futex, woken by the
publisher: pdserve.parallel.futex), so a rank still computing keeps its core. A rank whose process
ends is noticed within a few milliseconds, not only at the timeout: each rank
writes its pid, and the others watch it through a pidfd (where they share its pid namespace).
Torch-free (numpy views of the flags; the collectives build tensors over the slots).
"""

from __future__ import annotations

import mmap
import os
import select
import secrets
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pdserve.parallel.futex import Futex, futex_check

SHM_DIR = "/dev/shm"
_MAGIC = b"pdserve-tp-shm-1"  # 16 bytes: the layout's version
_LINE_BYTES = 64
_PAGE_BYTES = 4096
_NONCE_BYTES = 16


class SegmentUnavailable(Exception):
    """The segment cannot be created or is not the one rank 0 created: these ranks keep gloo."""


class PeerSilent(Exception):
    """A rank did not publish an exchange within the wait's bound, or its process ended."""

    def __init__(self, missing_ranks: list[int], waited_s: float, exited: bool = False):
        super().__init__(f"rank(s) {missing_ranks} exited" if exited else
                         f"no word from rank(s) {missing_ranks} within {waited_s:g} s")
        self.missing_ranks = missing_ranks


@dataclass(frozen=True, slots=True)
class SegmentInvite:
    """What rank 0 tells the other ranks (a control record, HMAC-sealed like every other)."""

    path: str
    nonce: bytes
    num_ranks: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How a rank waits for the others' flags: a busy loop first (on idle cores the other rank is
    usually microseconds behind), then asleep on the peer's flag (a futex: no CPU taken from a rank
    still computing, woken the moment it publishes), looking every `check_s` whether a peer exited."""

    # 200 us: on a 2-core VM at light load, a step of 24 (matmul, all-reduce) pairs took 2.3-3.6 ms
    # spinning 200 us or for ever, 2.8-4.0 with 20 us, 3.5-6.9 asleep at once (compute alone: 1.7 ms);
    # on a heavily loaded one, 27-33 ms with 200 us, 12-18 with 20 us, 21-62 spinning for ever.
    spin_s: float = 200e-6
    check_s: float = 10e-3
    fallback_sleep_s: float = 100e-6  # where futex(2) is unavailable: sleep and look again


@dataclass(frozen=True, slots=True)
class NativeLayout:
    """One rank's segment as the native all-reduce sees it: addresses in this process."""

    base_address: int
    num_ranks: int
    rank: int
    slot_bytes: int
    data_offset: int
    flags_offset: int
    line_bytes: int
    watched_ranks: list[int]
    watched_pidfds: list[int]
    use_futex: bool


def segment_bytes(num_ranks: int, slot_bytes: int) -> int:
    return data_offset(num_ranks) + 2 * num_ranks * slot_bytes


def data_offset(num_ranks: int) -> int:
    header_bytes = _LINE_BYTES * (1 + num_ranks)
    return -(-header_bytes // _PAGE_BYTES) * _PAGE_BYTES


def slot_offset(num_ranks: int, slot_bytes: int, buffer: int, rank: int) -> int:
    return data_offset(num_ranks) + (buffer * num_ranks + rank) * slot_bytes


class HostSegment:
    """This process's mapping of the segment, and its flags."""

    def __init__(self, backing: mmap.mmap, rank: int, num_ranks: int, slot_bytes: int):
        self.backing = backing
        self.rank = rank
        self.num_ranks = num_ranks
        self.slot_bytes = slot_bytes
        # int64 flags, one per 64-byte line (stride 64): aligned 8-byte stores and loads are atomic.
        self._flags = np.ndarray((num_ranks,), dtype=np.int64, buffer=backing, offset=_LINE_BYTES,
                                 strides=(_LINE_BYTES,))
        lines = np.ndarray((num_ranks, 3), dtype=np.int64, buffer=backing, offset=_LINE_BYTES,
                           strides=(_LINE_BYTES, 8))
        self._identities = lines[:, 1:]  # [pid, pid namespace inode] of each rank
        self._identities[rank] = (os.getpid(), _pid_namespace())
        self._peers = [peer for peer in range(num_ranks) if peer != rank]
        flags_address = self._flags.__array_interface__["data"][0]
        self._flag_addresses = [flags_address + _LINE_BYTES * line for line in range(num_ranks)]
        self._futex: Optional[Futex] = Futex() if futex_check(self._flag_addresses[rank]) is None else None
        self._watch: Optional[select.poll] = None
        self._pidfds: dict[int, int] = {}  # fd -> the rank it watches

    def watch_peers(self) -> list[int]:
        """Watch the other ranks' processes (call once every rank has mapped the segment); the ranks
        watched: those in this pid namespace whose pidfd opened (the others only by the timeout)."""
        self._watch = select.poll()
        for peer in self._peers:
            pid, namespace = (int(value) for value in self._identities[peer])
            if pid <= 0 or namespace != _pid_namespace():
                continue
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError):  # gone already, or a kernel before 5.3
                continue
            self._pidfds[fd] = peer
            self._watch.register(fd, select.POLLIN)
        return sorted(self._pidfds.values())

    def exited_peers(self) -> list[int]:
        """The watched ranks whose process has ended (a pidfd turns readable at exit)."""
        if not self._pidfds:
            return []
        return sorted(self._pidfds[fd] for fd, _ in self._watch.poll(0))

    def publish(self, sequence: int) -> None:
        """Tell the others this rank's part of exchange `sequence` is in its slot (or, for a reader, that
        it is done with every exchange before it). x86-64 keeps stores in order, so the slot's bytes are
        visible before the flag (the only architecture `shared_memory_check` lets through)."""
        self._flags[self.rank] = sequence
        if self._futex is not None:
            self._futex.wake(self._flag_addresses[self.rank])

    def wait_for(self, sequence: int, timeout_s: float, policy: WaitPolicy,
                 clock=time.monotonic) -> None:  # noqa: ANN001 - a monotonic clock in seconds
        """Return once every rank published `sequence`; PeerSilent after `timeout_s`, or as soon as a
        watched peer's process ended."""
        flags, peers = self._flags, self._peers
        started_s = clock()
        spin_until_s = started_s + policy.spin_s
        deadline_s = started_s + timeout_s
        while True:
            behind = next((peer for peer in peers if flags[peer] < sequence), None)
            if behind is None:
                return
            now_s = clock()
            if now_s < spin_until_s:
                continue
            if now_s >= deadline_s:
                raise PeerSilent([p for p in peers if flags[p] < sequence], timeout_s)
            exited = self.exited_peers()
            if exited:
                raise PeerSilent(exited, now_s - started_s, exited=True)
            pause_s = min(policy.check_s, deadline_s - now_s)
            if self._futex is not None:
                self._futex.wait(self._flag_addresses[behind], int(flags[behind]), pause_s)
            else:
                time.sleep(min(policy.fallback_sleep_s, pause_s))

    def native_layout(self) -> "NativeLayout":
        """Where this rank's flags and slots lie in its mapping, and whom it watches, for the native
        all-reduce (pdserve/kernels/host_exchange.h); valid while the mapping is."""
        watched = sorted(self._pidfds.items(), key=lambda item: item[1])
        return NativeLayout(base_address=self._flag_addresses[0] - _LINE_BYTES, num_ranks=self.num_ranks,
                            rank=self.rank, slot_bytes=self.slot_bytes, data_offset=data_offset(self.num_ranks),
                            flags_offset=_LINE_BYTES, line_bytes=_LINE_BYTES,
                            watched_ranks=[rank for _, rank in watched], watched_pidfds=[fd for fd, _ in watched],
                            use_futex=self._futex is not None)

    def close(self) -> None:
        """Stop watching the peers. The mapping itself is not closed here: it goes with the last
        object that views it (this one, the collectives' tensors, a native exchange's owner), so a
        collective still waiting in another thread when the ranks close reads mapped memory, never
        freed memory (an explicit mmap.close does not wait for numpy's views: they would crash)."""
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = {}


def create_segment(num_ranks: int, slot_bytes: int, directory: str = SHM_DIR) -> tuple[HostSegment, SegmentInvite]:
    """Rank 0's side: a fresh segment file, its pages reserved, the nonce written."""
    if slot_bytes % _LINE_BYTES:
        raise ValueError(f"slot_bytes must be a multiple of {_LINE_BYTES}, got {slot_bytes}")
    path = os.path.join(directory, f"pdserve-tp-{os.getpid()}-{secrets.token_hex(8)}")
    length = segment_bytes(num_ranks, slot_bytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise SegmentUnavailable(f"cannot create {path}: {error}") from error
    try:
        os.posix_fallocate(fd, 0, length)  # ENOSPC now rather than SIGBUS on a later write
        backing = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    except OSError as error:
        unlink_segment(path)
        raise SegmentUnavailable(f"cannot reserve {length} bytes in {directory}: {error}") from error
    finally:
        os.close(fd)
    nonce = secrets.token_bytes(_NONCE_BYTES)
    backing[:len(_MAGIC) + _NONCE_BYTES] = _MAGIC + nonce
    return HostSegment(backing, 0, num_ranks, slot_bytes), SegmentInvite(path, nonce, num_ranks, slot_bytes)


def open_segment(invite: SegmentInvite, rank: int) -> HostSegment:
    """A follower's side: the file rank 0 named, checked to hold rank 0's nonce (so it is the same memory,
    not a same-named file on another host)."""
    length = segment_bytes(invite.num_ranks, invite.slot_bytes)
    try:
        fd = os.open(invite.path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        raise SegmentUnavailable(f"cannot open {invite.path}: {error}") from error
    try:
        if os.fstat(fd).st_size != length:
            raise SegmentUnavailable(f"{invite.path} is not {length} bytes long")
        backing = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    except OSError as error:
        raise SegmentUnavailable(f"cannot map {invite.path}: {error}") from error
    finally:
        os.close(fd)
    if backing[:len(_MAGIC) + _NONCE_BYTES] != _MAGIC + invite.nonce:
        backing.close()
        raise SegmentUnavailable(f"{invite.path} holds another nonce: not rank 0's memory")
    return HostSegment(backing, rank, invite.num_ranks, invite.slot_bytes)


def _pid_namespace() -> int:
    """This process's pid namespace (its inode): pids mean the same process only inside one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


def unlink_segment(path: Optional[str]) -> None:
    """Remove the segment's name (the mappings stay); best effort."""
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
