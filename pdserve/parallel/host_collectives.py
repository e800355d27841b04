"""All-reduce, all-gather and control bytes between the ranks of one worker on one host, through a
shared segment.

    rank r, exchange s (buffer s % 2):  write its part into slot r  ->  publish flag r = s
                                        wait until every flag >= s  ->  read every slot, in rank order

A tensor larger than a slot goes through in pieces, one exchange each; so do control records, each
slot then holding [int64 total length | bytes], so every rank learns from the first exchange how
many more follow. Invariant: every rank sums
the slots in the same order (rank 0 first) in float32, so every rank ends with the same bits, as
gloo's all-reduce gives them; every wait is bounded by the group's timeout and a rank that does not
arrive raises `RanksLost`, as the gloo path does.

Once `use_native` succeeded, float32 all-reduces run the same protocol in native code
(pdserve/kernels/host_exchange.cpp: no Python between a rank's flag and its sum), on the same
sequence of exchanges as the Python path's control records; so does a tensor-parallel decoder stack
that sums its layers natively (`run_native`).
"""

from __future__ import annotations

import platform
import struct
from typing import Any, Callable, Optional, TypeVar

import torch

from pdserve.parallel.control import ControlRecordRejected
from pdserve.parallel.errors import RanksLost
from pdserve.parallel.host_segment import HostSegment, PeerSilent, WaitPolicy, slot_offset

_Result = TypeVar("_Result")
_RANKS_LOST = "ranks lost: "  # how the native exchange's failed waits begin (host_exchange.h's kRanksLost)
DEFAULT_SLOT_BYTES = 2 << 20  # per rank and buffer: 512 Ki float32, a decode batch of 64 at hidden 8192
_FLOAT_BYTES = 4
_LENGTH = struct.Struct("<q")  # a control record's total length, at the start of its sender's slot


def shared_memory_check(device: torch.device) -> Optional[str]:
    """Why this process cannot use the shared-memory path (None: it can, if the segment opens). The flag
    protocol relies on x86-64's store order; the CPU path only (CUDA tensors go over NCCL)."""
    if device.type != "cpu":
        return f"the ranks run on {device.type}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the flag protocol assumes x86-64's store order; this is {platform.machine()}"
    return None


class HostCollectives:
    """One rank's all-reduce, all-gather (floating tensors) and byte exchange over `segment`, each wait
    bounded by `timeout_s`."""

    def __init__(self, segment: HostSegment, timeout_s: float, policy: WaitPolicy = WaitPolicy()):
        self.segment = segment
        self.rank = segment.rank
        self.num_ranks = segment.num_ranks
        self.timeout_s = timeout_s
        self.policy = policy
        self.slot_elems = segment.slot_bytes // _FLOAT_BYTES
        self._sequence = 0  # exchanges so far: the same count on every rank
        # slots[b][r]: rank r's slot in buffer b, as float32 tensors over the mapping
        self._slots = [[torch.frombuffer(segment.backing, dtype=torch.float32, count=self.slot_elems,
                                         offset=slot_offset(self.num_ranks, segment.slot_bytes, buffer, rank))
                        for rank in range(self.num_ranks)] for buffer in (0, 1)]
        self._bytes = [[memoryview(segment.backing)[
            slot_offset(self.num_ranks, segment.slot_bytes, buffer, rank):][:segment.slot_bytes]
            for rank in range(self.num_ranks)] for buffer in (0, 1)]
        self._sum = torch.empty(self.slot_elems, dtype=torch.float32)
        self._native: Any = None  # pdserve_cpu::HostExchange, once use_native made it

    def use_native(self) -> bool:
        """From now on run float32 all-reduces in native code, where the native kernels load (every
        rank calls this at the same point, after `segment.watch_peers`); True when they do."""
        from pdserve.kernels.native import cpu_kernels_available

        if self._native is None and cpu_kernels_available():
            layout = self.segment.native_layout()
            self._native = torch.classes.pdserve_cpu.HostExchange(
                layout.base_address, layout.num_ranks, layout.rank, layout.slot_bytes, layout.data_offset,
                layout.flags_offset, layout.line_bytes, layout.watched_ranks, layout.watched_pidfds,
                self.policy.spin_s, self.policy.check_s, self.timeout_s, layout.use_futex)
        return self._native is not None

    @property
    def native_exchange(self) -> Any:
        """The native all-reduce (pdserve_cpu::HostExchange), or None before `use_native` or without it."""
        return self._native

    def run_native(self, call: Callable[[Any, int], tuple[_Result, int]], what: str) -> _Result:
        """`call(exchange, sequence)`, which runs native exchanges after `sequence` and returns (its
        result, the last exchange it used); a failed wait in it raises RanksLost."""
        if self._native is None:
            raise RuntimeError("HostCollectives.run_native before use_native")
        try:
            result, self._sequence = call(self._native, self._sequence)
        except RuntimeError as error:
            message = str(error)
            if _RANKS_LOST not in message:
                raise
            reason = message.split(_RANKS_LOST, 1)[1].splitlines()[0]
            raise RanksLost(f"rank {self.rank}: {what} failed: {reason}") from None
        return result

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (in float32, whatever its dtype); returns it."""
        if self._native is not None and tensor.dtype == torch.float32 and tensor.is_contiguous():
            return self.run_native(lambda exchange, sequence: (tensor, exchange.all_reduce(tensor, sequence)),
                                   "an all-reduce")
        flat = tensor.contiguous().view(-1)  # the tensor itself when contiguous (the models' case)
        for start in range(0, flat.numel(), self.slot_elems):
            piece = flat[start:start + self.slot_elems]
            slots = self._exchange(piece, "an all-reduce")
            count = piece.numel()
            total = self._sum[:count] if piece.dtype != torch.float32 else piece
            torch.add(slots[0][:count], slots[1][:count], out=total)
            for slot in slots[2:]:
                total.add_(slot[:count])
            if total is not piece:
                piece.copy_(total)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` [..., k] side by side along the last dimension, in rank order."""
        flat = tensor.reshape(-1)
        gathered = torch.empty((self.num_ranks, flat.numel()), dtype=tensor.dtype)
        for start in range(0, flat.numel(), self.slot_elems):
            piece = flat[start:start + self.slot_elems]
            slots = self._exchange(piece, "an all-gather")
            for rank, slot in enumerate(slots):
                gathered[rank, start:start + piece.numel()].copy_(slot[:piece.numel()])
        # [ranks, ..., k] -> [..., ranks, k] -> [..., ranks * k]
        parts = gathered.view(self.num_ranks, *tensor.shape).movedim(0, -2)
        return parts.reshape(*tensor.shape[:-1], self.num_ranks * tensor.shape[-1])

    def exchange_bytes(self, data: bytes, max_bytes: int, what: str) -> list[bytes]:
        """Every rank's `data` (b"": nothing to send), in rank order; a length over `max_bytes` in any
        slot raises ControlRecordRejected (no rank of ours sent it)."""
        chunk_bytes = self.segment.slot_bytes - _LENGTH.size
        slots = self._exchange_bytes(data, 0, chunk_bytes, what)
        lengths = [_LENGTH.unpack_from(slot)[0] for slot in slots]
        if any(not 0 <= length <= max_bytes for length in lengths):
            raise ControlRecordRejected(f"a control record of {max(lengths)} bytes: no rank of this worker sent it")
        received = [bytearray(slot[_LENGTH.size:_LENGTH.size + min(length, chunk_bytes)])
                    for slot, length in zip(slots, lengths)]
        for start in range(chunk_bytes, max(lengths), chunk_bytes):
            slots = self._exchange_bytes(data, start, chunk_bytes, what)
            for rank, slot in enumerate(slots):
                if lengths[rank] > start:
                    received[rank] += slot[_LENGTH.size:_LENGTH.size + min(lengths[rank] - start, chunk_bytes)]
        return [bytes(part) for part in received]

    def _exchange_bytes(self, data: bytes, start: int, chunk_bytes: int, what: str) -> list[memoryview]:
        self._sequence += 1
        slot = self._bytes[self._sequence % 2][self.rank]
        piece = data[start:start + chunk_bytes]
        _LENGTH.pack_into(slot, 0, len(data))
        slot[_LENGTH.size:_LENGTH.size + len(piece)] = piece
        self._arrive(what)
        return self._bytes[self._sequence % 2]

    def _exchange(self, piece: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Put this rank's piece in its slot and wait for every rank's; the slots of this exchange."""
        self._sequence += 1
        slots = self._slots[self._sequence % 2]
        slots[self.rank][:piece.numel()].copy_(piece)
        self._arrive(what)
        return slots

    def _arrive(self, what: str) -> None:
        self.segment.publish(self._sequence)
        try:
            self.segment.wait_for(self._sequence, self.timeout_s, self.policy)
        except PeerSilent as error:
            raise RanksLost(f"rank {self.rank}: {what} failed: {error}") from error

    def close(self) -> None:
        if self._native is not None:
            self._native.forget()  # later calls fail; the mapping stays while anything holds it
        self._slots, self._bytes = [], []
        self.segment.close()

