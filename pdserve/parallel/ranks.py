"""The ranks of one tensor-parallel worker: a torch.distributed process group with bounded collectives.

    rank 0 (leader)                       rank r > 0 (follower)
    HTTP, scheduler, KV manager           model shard, pool slice, NIXL agent
    ---------------------------           -----------------------------------
    broadcast(message) ---- control ----> broadcast() -> message
    gather(report)     <--- control ----- gather(report)
    all_reduce(partial sums) <-- tensors --> all_reduce(partial sums)

Control records are pickled and sealed with an HMAC keyed by the internal token
(`pdserve.parallel.control`: a rank unpickles nothing whose tag fails). Where every rank proved at
start-up that it maps rank 0's shared-memory segment (`share_host_memory`: the CPU, one host),
records and tensors both go through it (pdserve.parallel.host_collectives; a step's record is on
the hot path too: a gloo broadcast costs milliseconds); else records go over gloo and tensors over
gloo on the CPU and NCCL on CUDA. Rank 0's store listens on --tp-master-addr only (a socket bound
before the store takes it over), never on every interface. Every
collective is bounded by the group's timeout: a rank that dies or hangs makes
the others' next collective raise `RanksLost` instead of blocking forever.
"""

from __future__ import annotations

import logging
from datetime import timedelta
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pdserve.parallel.control import ControlRecordRejected, control_key, seal, unseal
from pdserve.parallel.errors import RanksLost
from pdserve.parallel.host_collectives import DEFAULT_SLOT_BYTES, HostCollectives, shared_memory_check
from pdserve.parallel.host_segment import SegmentInvite, SegmentUnavailable, create_segment, open_segment, unlink_segment
from pdserve.parallel.rendezvous import listen_on

logger = logging.getLogger(__name__)

MAX_CONTROL_RECORD_BYTES = 1 << 30  # a size past this is no record of ours: the group is broken
CHECKED_IN_KEY = "pdserve/ranks_checked_in"  # the followers in the store so far, counted by the store
CHECK_IN_POLL_S = 0.1


class RankGroup:
    """This process's membership of its worker's ranks (one per process)."""

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout_s: float,
                 device: torch.device, join_timeout_s: Optional[float] = None, listen_fd: Optional[int] = None,
                 internal_token: Optional[str] = None, ranks_lost: Optional[Callable[[], Optional[str]]] = None):
        """Blocks until all `size` ranks joined (at most `join_timeout_s`, default `timeout_s`);
        every later collective is bounded by `timeout_s`. Rank 0's store listens on `listen_fd`
        (taking it over) when given: a socket already bound to `master_port`; else on a socket it
        binds to `master_addr`:`master_port` itself. `internal_token` keys the control records'
        HMAC; without one the ranks must meet on a loopback address (ValueError otherwise).
        `ranks_lost` (rank 0 of ranks it started itself) says why a rank is gone, or None: the
        wait for the others ends at once when one is."""
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._key = control_key(internal_token, master_addr)
        self._num_records = 0  # control collectives so far: the same count on every rank
        self._host: Optional[HostCollectives] = None  # tensors' path once share_host_memory found one
        if rank == 0 and listen_fd is None:
            listen_fd = listen_on(master_addr, master_port).detach()
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        join_timeout = timedelta(seconds=join_timeout_s or timeout_s)
        logger.info("rank %d/%d: meeting the other ranks at %s:%d (%s)", rank, size, master_addr, master_port, backend)
        try:
            # Rank 0 hosts the rendezvous store; the others retry connecting until the join timeout.
            store = dist.TCPStore(master_addr, master_port, size, is_master=rank == 0, timeout=join_timeout,
                                  wait_for_workers=False, master_listen_fd=listen_fd if rank == 0 else None)
            # Every rank is in the store before any enters the process group, whose meeting is bounded by
            # the (shorter) collective timeout: a rank still starting (importing torch on a busy host,
            # opening a GPU) is not a lost one.
            _check_in(store, rank, size, join_timeout.total_seconds(), ranks_lost)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
            self._control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        except RanksLost:
            raise
        except Exception as error:  # noqa: BLE001 - torch raises several kinds; all mean the same here
            raise RanksLost(f"rank {rank}/{size} could not meet the other ranks at {master_addr}:{master_port} "
                            f"within {join_timeout.total_seconds():g} s: {error}") from error
        logger.info("rank %d/%d: all %d ranks met", rank, size, size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def host_collectives(self) -> Optional[HostCollectives]:
        """The shared-memory path, when tensors take it (a decoder stack sums its layers through its
        native exchange: pdserve.runner.fused_layer)."""
        return self._host

    @property
    def tensor_path(self) -> str:
        """Where tensors go: "shared memory" or the process group's backend."""
        return "shared memory" if self._host is not None else dist.get_backend()

    def share_host_memory(self, enabled: bool, device: torch.device,
                          slot_bytes: int = DEFAULT_SLOT_BYTES, native: bool = True) -> bool:
        """Every rank calls this once, right after joining: rank 0 offers a shared-memory segment and
        tensors take it if every rank could map it (checked by a nonce, not guessed from addresses);
        otherwise they stay on the process group. True when they took it. `native`: its all-reduces
        run in native code where the kernels load (`--tp-native-all-reduce`)."""
        reason = None if enabled else "--no-tp-shared-memory"
        reason = reason or shared_memory_check(device)
        segment, invite = None, None
        if self.is_leader:
            if reason is None:
                try:
                    segment, invite = create_segment(self.size, slot_bytes)
                except SegmentUnavailable as error:
                    reason = str(error)
            try:
                self.broadcast(invite)
                reasons = [reason] + (self.gather(None) or [])[1:]
            finally:
                unlink_segment(invite.path if invite is not None else None)
            verdict = next((f"rank {rank}: {why}" for rank, why in enumerate(reasons) if why), None)
            self.broadcast(verdict)
        else:
            invite = self.broadcast()
            if not isinstance(invite, SegmentInvite):
                reason = reason or "rank 0 offered no segment"
            elif reason is None:
                try:
                    segment = open_segment(invite, self.rank)
                except SegmentUnavailable as error:
                    reason = str(error)
            self.gather(reason)
            verdict = self.broadcast()
        if verdict is None and segment is not None:
            segment.watch_peers()  # every rank wrote its pid before the verdict
            self._host = HostCollectives(segment, self.timeout_s)
            native = native and self._host.use_native()  # a rank may mix: the protocol is one
            logger.info("rank %d/%d: control records and tensors go through shared memory (all-reduces in %s)",
                        self.rank, self.size, "native code" if native else "Python")
            return True
        if segment is not None:
            segment.close()
        logger.info("rank %d/%d: control records and tensors go over %s (no shared memory: %s)", self.rank, self.size,
                    dist.get_backend(), verdict)
        return False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self._host is not None:
            return self._host.all_reduce(tensor)
        try:
            dist.all_reduce(tensor)
        except Exception as error:  # noqa: BLE001
            raise RanksLost(f"rank {self.rank}: an all-reduce failed: {error}") from error
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` [..., k] side by side along the last dimension, in rank order."""
        if self._host is not None:
            return self._host.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            dist.all_gather(parts, tensor)
        except Exception as error:  # noqa: BLE001
            raise RanksLost(f"rank {self.rank}: an all-gather failed: {error}") from error
        return torch.cat(parts, dim=-1)

    def broadcast(self, record: Any = None) -> Any:
        """Rank 0 sends `record`; every rank returns it (the followers once its tag checked out)."""
        sequence = self._next_sequence()
        sealed = seal(self._key, record, sequence, 0) if self.is_leader else b""
        if self._host is not None:
            received = self._host.exchange_bytes(sealed, MAX_CONTROL_RECORD_BYTES, "a broadcast")[0]
            return record if self.is_leader else unseal(self._key, received, sequence, 0)
        try:
            size = torch.tensor([len(sealed)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self._control)
            data = _bytes_tensor(sealed) if self.is_leader else torch.empty(_checked_size(size), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self._control)
        except ControlRecordRejected:
            raise
        except Exception as error:  # noqa: BLE001
            raise RanksLost(f"rank {self.rank}: no word from the other ranks within {self.timeout_s:g} s "
                            f"({error})") from error
        return record if self.is_leader else unseal(self._key, data.numpy().tobytes(), sequence, 0)

    def gather(self, record: Any) -> Optional[list[Any]]:
        """Every rank sends `record`; rank 0 gets them all in rank order (each checked), the others None."""
        sequence = self._next_sequence()
        sealed = seal(self._key, record, sequence, self.rank)
        if self._host is not None:
            received = self._host.exchange_bytes(sealed, MAX_CONTROL_RECORD_BYTES, "a gather")
            if not self.is_leader:
                return None
            return [record if sender == 0 else unseal(self._key, received[sender], sequence, sender)
                    for sender in range(self.size)]
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(sizes, torch.tensor([len(sealed)], dtype=torch.int64), group=self._control)
            longest = max(_checked_size(size) for size in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[:len(sealed)] = _bytes_tensor(sealed)
            parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)] if self.is_leader else None
            dist.gather(padded, parts, dst=0, group=self._control)
        except ControlRecordRejected:
            raise
        except Exception as error:  # noqa: BLE001
            raise RanksLost(f"rank {self.rank}: gathering the ranks' reports failed: {error}") from error
        if parts is None:
            return None
        return [record if sender == 0 else
                unseal(self._key, parts[sender][:int(sizes[sender])].numpy().tobytes(), sequence, sender)
                for sender in range(self.size)]

    def _next_sequence(self) -> int:
        self._num_records += 1
        return self._num_records

    def close(self) -> None:
        """Leave the group (best effort: the others may be gone already)."""
        if self._host is not None:
            self._host.close()
            self._host = None
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            logger.debug("leaving the process group failed", exc_info=True)


def _check_in(store: Any, rank: int, size: int, join_timeout_s: float,
              ranks_lost: Optional[Callable[[], Optional[str]]]) -> None:
    """A follower counts itself in; rank 0 waits until all `size - 1` have (RanksLost past
    `join_timeout_s`, or as soon as `ranks_lost` names a gone rank)."""
    if rank != 0:
        store.add(CHECKED_IN_KEY, 1)
        return
    deadline = time.monotonic() + join_timeout_s
    while (num_checked_in := store.add(CHECKED_IN_KEY, 0)) < size - 1:
        lost = ranks_lost() if ranks_lost is not None else None
        if lost is not None:
            raise RanksLost(f"rank 0/{size}: {lost} before the ranks met")
        if time.monotonic() >= deadline:
            raise RanksLost(f"rank 0/{size}: {num_checked_in} of the other {size - 1} ranks joined "
                            f"within {join_timeout_s:g} s")
        time.sleep(CHECK_IN_POLL_S)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _checked_size(size: torch.Tensor) -> int:
    value = int(size.item())
    if not 0 <= value <= MAX_CONTROL_RECORD_BYTES:
        raise ControlRecordRejected(f"a control record of {value} bytes: no rank of this worker sent it")
    return value
