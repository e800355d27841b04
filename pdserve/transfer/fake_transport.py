"""In-process KVTransport for unit tests of the P/D logic: copies rows between two
canonical views of one process, with knobs to make reads fail, hang or not cancel.

Invariant: it keeps the NIXL transport's contract (the copy and the peer's
notification happen together, when the read completes; a failed read neither
copies nor notifies), so logic tested on it behaves the same over NIXL.
Torch-free: a view is anything with `.shape` and row get/set (torch or numpy).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from pdserve.transfer.transport import (
    PeerInfo, TransferError, TransferHandle, TransferState, num_chunks, wait_connected)

logger = logging.getLogger(__name__)


class FakeFabric:
    """The 'network': fake transports that can reach each other, by agent name."""

    def __init__(self) -> None:
        self._agents: dict[str, FakeTransport] = {}

    def attach(self, transport: "FakeTransport") -> None:
        if transport.agent_name in self._agents:
            raise ValueError(f"agent name {transport.agent_name!r} already on the fabric")
        self._agents[transport.agent_name] = transport

    def lookup(self, agent_name: str) -> "FakeTransport | None":
        return self._agents.get(agent_name)

    def kill(self, agent_name: str) -> None:
        """Make an agent unreachable, as if its process died."""
        self._agents.pop(agent_name, None)

    def detach(self, transport: "FakeTransport") -> None:
        if self._agents.get(transport.agent_name) is transport:
            del self._agents[transport.agent_name]


@dataclass(slots=True)
class _FakeRead:
    local_ids: list[int]
    remote_ids: list[int]
    remote_name: str
    notification: bytes
    chunk_bytes: int


class FakeTransport:
    """KVTransport over a FakeFabric.

    Knobs (plain attributes, flip them any time):
      fail_reads  -- the next polls of pending reads report FAILED, copying nothing
      hold_reads  -- pending reads stay PENDING (the copy has not happened yet)
      cancellable -- when False, `release` of a PENDING read returns False
      hold_connects -- connections being set up stay PENDING (a data path that never answers)
    """

    def __init__(self, pool_canonical_view: Any, agent_name: str, fabric: FakeFabric):
        if len(pool_canonical_view.shape) != 2:
            raise ValueError("pool_canonical_view must be 2-D [num_blocks, page_bytes]")
        self._view = pool_canonical_view
        self.agent_name = agent_name
        self.generation = 0  # a fake's agent is never replaced
        self._fabric = fabric
        self._peers: dict[str, PeerInfo] = {}
        self._connecting: dict[str, PeerInfo] = {}
        self._chunk_bytes: dict[str, int] = {}  # peer key -> the unit of reads from it
        self._connect_failures: dict[str, str] = {}
        self._reads: dict[int, _FakeRead] = {}
        self._inbox: collections.deque[bytes] = collections.deque()  # appended by readers' threads
        self._handle_ids = itertools.count(1)
        self.fail_reads = False
        self.hold_reads = False
        self.cancellable = True
        self.hold_connects = False
        self.num_connect_attempts = 0  # connections begun (a remembered dead peer begins none)
        fabric.attach(self)

    @property
    def num_blocks(self) -> int:
        return int(self._view.shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self._view.shape[1])

    @property
    def num_pending_connects(self) -> int:
        """Connections begun and not yet answered (held ones stay here)."""
        return len(self._connecting)

    @property
    def num_unreleased_handles(self) -> int:
        """Reads started and not yet released (a leak check for tests)."""
        return len(self._reads)

    def local_peer_info(self, engine_id: str, epoch: str) -> PeerInfo:
        return PeerInfo(engine_id=engine_id, epoch=epoch, agent_name=self.agent_name,
                        agent_metadata=self.agent_name.encode(), mem_type="DRAM", device_id=0,
                        base_address=0, num_blocks=self.num_blocks, page_bytes=self.page_bytes)

    def begin_connect(self, peer: PeerInfo, chunk_bytes: int | None = None) -> str:
        if peer.key in self._peers or peer.key in self._connecting:
            return peer.key
        if chunk_bytes is None and peer.page_bytes != self.page_bytes:
            raise TransferError(f"peer {peer.key} has pages of {peer.page_bytes} bytes, this pool {self.page_bytes}")
        chunk = chunk_bytes or self.page_bytes
        if self.page_bytes % chunk or peer.page_bytes % chunk:
            raise TransferError(f"chunks of {chunk} bytes divide neither pages of {peer.page_bytes} (peer {peer.key}) "
                                f"nor of {self.page_bytes} (here)")
        held = {**self._peers, **self._connecting}
        for clash in [k for k, p in held.items() if p.clashes_with(peer)]:
            raise TransferError(f"peer {peer.key} announces agent {peer.agent_name!r}, which peer {clash} uses")
        for stale_key in [k for k, p in held.items() if p.replaced_by(peer)]:
            self.disconnect(stale_key)
        self._connect_failures.pop(peer.key, None)
        self.num_connect_attempts += 1
        self._connecting[peer.key] = peer
        self._chunk_bytes[peer.key] = chunk
        return peer.key

    def poll_connect(self, peer_key: str) -> TransferState:
        if peer_key in self._peers:
            return TransferState.DONE
        peer = self._connecting.get(peer_key)
        if peer is None:
            return TransferState.FAILED
        if self.hold_connects:
            return TransferState.PENDING
        del self._connecting[peer_key]
        if self._fabric.lookup(peer.agent_name) is None:
            self._connect_failures[peer_key] = f"peer agent {peer.agent_name!r} is not reachable"
            return TransferState.FAILED
        self._peers[peer_key] = peer
        return TransferState.DONE

    def connect_failure(self, peer_key: str) -> str | None:
        return self._connect_failures.get(peer_key)

    def connect(self, peer: PeerInfo) -> str:
        return wait_connected(self, peer, timeout_s=1.0)

    def disconnect(self, peer_key: str) -> None:
        self._peers.pop(peer_key, None)
        self._connecting.pop(peer_key, None)
    def start_read(self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notification: bytes) -> TransferHandle:
        peer = self._peers.get(peer_key)
        if peer is None:
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        local_ids, remote_ids = list(local_block_ids), list(remote_block_ids)
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local block ids for {len(remote_ids)} remote ones")
        chunk = self._chunk_bytes[peer_key]
        _check_range("local", local_ids, num_chunks(self.page_bytes, chunk, self.num_blocks))
        _check_range("remote", remote_ids, num_chunks(peer.page_bytes, chunk, peer.num_blocks))
        handle = TransferHandle(next(self._handle_ids), peer_key, len(local_ids), len(local_ids) * chunk,
                                time.monotonic())
        if not local_ids:
            return self._finish_empty(handle, notification)
        self._reads[handle.handle_id] = _FakeRead(local_ids, remote_ids, peer.agent_name, notification, chunk)
        return handle

    def _finish_empty(self, handle: TransferHandle, notification: bytes) -> TransferHandle:
        try:
            if notification:
                self.send_message(handle.peer_key, notification)
            handle.state = TransferState.DONE
        except TransferError as exc:
            handle.state, handle.error = TransferState.FAILED, exc.message
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        read = self._reads.get(handle.handle_id)
        if handle.state is not TransferState.PENDING or read is None or self.hold_reads:
            return handle.state
        remote = self._fabric.lookup(read.remote_name)
        if self.fail_reads or remote is None:
            handle.state = TransferState.FAILED
            handle.error = "injected failure" if remote is not None else f"peer {read.remote_name} is gone"
            return handle.state
        local_chunks, remote_chunks = self._view.reshape(-1, read.chunk_bytes), remote._view.reshape(-1, read.chunk_bytes)
        for local_id, remote_id in zip(read.local_ids, read.remote_ids):
            local_chunks[local_id] = remote_chunks[remote_id]
        if read.notification:
            remote._inbox.append(read.notification)
        handle.state = TransferState.DONE
        return handle.state

    def release(self, handle: TransferHandle) -> bool:
        if handle.handle_id not in self._reads:
            return True
        if handle.state is TransferState.PENDING:
            if not self.cancellable:
                return False
            handle.state, handle.error = TransferState.FAILED, "cancelled by release"
        del self._reads[handle.handle_id]
        return True

    def poll_notifications(self) -> list[bytes]:
        messages = []
        while self._inbox:
            messages.append(self._inbox.popleft())
        return messages

    def send_message(self, peer_key: str, payload: bytes) -> None:
        peer = self._peers.get(peer_key)
        if peer is None:
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        remote = self._fabric.lookup(peer.agent_name)
        if remote is None:
            raise TransferError(f"cannot notify peer {peer_key}: agent {peer.agent_name!r} is gone")
        remote._inbox.append(payload)

    def close(self) -> None:
        self._peers.clear()
        self._connecting.clear()
        self._reads.clear()
        self._fabric.detach(self)


def _check_range(side: str, block_ids: list[int], num_blocks: int) -> None:
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"{side} block id {block_id} outside 0..{num_blocks - 1}")
