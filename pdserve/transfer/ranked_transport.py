"""KV transfer for a tensor-parallel worker: rank r of a decode worker reads from rank r of a prefill worker.

Each rank's pool slice holds its own heads of the same block ids, and each rank registers its
slice with its own agent. Rank 0 is the only rank the P/D code sees: `RankedTransport` is a
`KVTransport` that does to rank 0's slice what it is asked and sends the same command to the
other ranks (`FollowerTransport`), then reports the worst state of all:

    decode rank 0                                        prefill rank 0
      start_read(blocks) -- own slice --- NIXL READ ---->  slice 0   (its agent)
        |  StartRead (next rank message)
        v
    decode rank r        -- own slice --- NIXL READ ---->  slice r   (rank r's agent)

    poll: DONE only when every rank's read is DONE; then rank 0 alone sends the read's
          notification to prefill rank 0, so P releases its pin once, after every slice landed
    release: True only when no rank may still write the pages

What a peer advertises in the handshake is rank 0's `PeerInfo` whose opaque `agent_metadata`
lists every rank's agent (JSON, metadata in base64): the compatibility hash covers the TP size,
so two workers that connect always have as many ranks. Torch-free and nixl-free.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from pdserve.transfer.transport import KVTransport, PeerInfo, TransferError, TransferHandle, TransferState, wait_connected

logger = logging.getLogger(__name__)

_RANKS_KEY = "pdserve_ranks"
_RANK_FIELDS = ("agent_name", "agent_metadata", "mem_type", "device_id", "base_address")
_SYNC_INTERVAL_S = 0.001  # reports younger than this are reused (many handles are polled per turn)
_PROGRESS_INTERVAL_S = 0.005  # how often idle followers are asked to move their agents' messages


class FollowerLink(Protocol):
    """Rank 0's channel to the other ranks (pdserve.parallel.channel.LeaderChannel)."""

    def queue(self, command: Any) -> None: ...

    @property
    def has_queued(self) -> bool: ...

    def send(self, step: Any = None, decode_step: bool = False, logit_rows: tuple = (),
             want_report: bool = False) -> list[Any]: ...


# ---- commands rank 0 sends, and what the other ranks report --------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    peers: tuple[dict, ...]  # PeerInfo.to_dict() of every rank of the peer; rank r connects to peers[r]


@dataclass(frozen=True, slots=True)
class Disconnect:
    peer_key: str


@dataclass(frozen=True, slots=True)
class StartRead:
    handle_id: int
    peer_key: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Release:
    handle_id: int


@dataclass(frozen=True, slots=True)
class FollowerReport:
    connects: dict[str, tuple[str, Optional[str]]]  # peer key -> (state name, why it failed)
    reads: dict[int, tuple[str, Optional[str]]]  # handle id -> (state name, error)
    held: frozenset[int]  # handles whose pages this rank may still write


def encode_ranks(ranks: Sequence[dict]) -> bytes:
    return json.dumps({_RANKS_KEY: list(ranks)}).encode()


def decode_ranks(peer: PeerInfo, expected: int) -> list[PeerInfo]:
    """Every rank's PeerInfo from rank 0's; TransferError when it does not describe `expected` ranks."""
    try:
        ranks = json.loads(peer.agent_metadata.decode())[_RANKS_KEY]
        if not isinstance(ranks, list):
            raise TypeError("not a list")
        parsed = [dataclasses.replace(peer, agent_name=str(rank["agent_name"]),
                                      agent_metadata=base64.b64decode(rank["agent_metadata"], validate=True),
                                      mem_type=str(rank["mem_type"]), device_id=int(rank["device_id"]),
                                      base_address=int(rank["base_address"])) for rank in ranks]
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as error:
        raise TransferError(f"peer {peer.key} does not describe its tensor-parallel ranks: {error}") from None
    if len(parsed) != expected:
        raise TransferError(f"peer {peer.key} has {len(parsed)} tensor-parallel ranks, this worker {expected}")
    return parsed


def rank_descriptor(info: PeerInfo) -> dict:
    """The per-rank part of a PeerInfo (what differs between ranks)."""
    data = info.to_dict()
    return {name: data[name] for name in _RANK_FIELDS}


# ---- rank 0 -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _RankedRead:
    local: TransferHandle
    peer_key: str
    notification: bytes
    notified: bool = False


class RankedTransport:
    """Rank 0's KVTransport over every rank's slice (see the module docstring)."""

    def __init__(self, local: KVTransport, link: FollowerLink, follower_descriptors: Sequence[dict],
                 clock: Callable[[], float] = time.monotonic):
        self.local = local
        self.link = link
        self.num_ranks = 1 + len(follower_descriptors)
        self._followers = list(follower_descriptors)
        self._clock = clock
        self._reports: list[FollowerReport] = []
        self._reported_s = float("-inf")
        self._progressed_s = float("-inf")
        self._reads: dict[int, _RankedRead] = {}
        self._ids = itertools.count(1)

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def page_bytes(self) -> int:
        return self.local.page_bytes

    def local_peer_info(self, engine_id: str, epoch: str) -> PeerInfo:
        info = self.local.local_peer_info(engine_id, epoch)
        return dataclasses.replace(info, agent_metadata=encode_ranks([rank_descriptor(info), *self._followers]))

    # ---- followers' state ------------------------------------------------------------------

    def _followers_now(self) -> list[FollowerReport]:
        """The other ranks' latest reports (asks again unless the last answer is fresh and nothing is queued)."""
        now = self._clock()
        if now - self._reported_s >= _SYNC_INTERVAL_S or self.link.has_queued:
            self._reports = [report for report in self.link.send(want_report=True) if report is not None]
            self._reported_s = self._progressed_s = self._clock()
        return self._reports

    # ---- peers -----------------------------------------------------------------------------

    def begin_connect(self, peer: PeerInfo) -> str:
        ranks = decode_ranks(peer, self.num_ranks)
        key = self.local.begin_connect(ranks[0])
        self.link.queue(Connect(tuple(rank.to_dict() for rank in ranks)))
        self._reported_s = float("-inf")  # the next poll must see the followers' answer to this
        return key

    def poll_connect(self, peer_key: str) -> TransferState:
        state = self.local.poll_connect(peer_key)
        if state is TransferState.FAILED:
            return state
        states = [report.connects.get(peer_key, ("FAILED", "not connecting"))[0] for report in self._followers_now()]
        if "FAILED" in states:
            return TransferState.FAILED
        if state is TransferState.DONE and all(name == "DONE" for name in states):
            return TransferState.DONE
        return TransferState.PENDING

    def connect_failure(self, peer_key: str) -> Optional[str]:
        failure = self.local.connect_failure(peer_key)
        if failure is not None:
            return failure
        for rank, report in enumerate(self._reports, start=1):
            state, error = report.connects.get(peer_key, ("FAILED", None))
            if state == "FAILED":
                return f"rank {rank}: {error or 'cannot reach the peer'}"
        return None

    def connect(self, peer: PeerInfo) -> str:
        return wait_connected(self, peer, 30.0)

    def disconnect(self, peer_key: str) -> None:
        self.local.disconnect(peer_key)
        self.link.queue(Disconnect(peer_key))

    # ---- reads -----------------------------------------------------------------------------

    def start_read(self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notification: bytes) -> TransferHandle:
        local = self.local.start_read(peer_key, local_block_ids, remote_block_ids, b"")
        handle_id = next(self._ids)
        if local_block_ids:
            self.link.queue(StartRead(handle_id, peer_key, tuple(local_block_ids), tuple(remote_block_ids)))
        read = _RankedRead(local, peer_key, notification)
        self._reads[handle_id] = read
        handle = TransferHandle(handle_id, peer_key, local.num_blocks, local.num_bytes * self.num_ranks,
                                local.started_at_s)
        if not local_block_ids:
            self._notify(read)
            handle.state = TransferState.DONE
        return handle

    def _notify(self, read: _RankedRead) -> None:
        if read.notification and not read.notified:
            read.notified = True
            try:
                self.local.send_message(read.peer_key, read.notification)
            except TransferError as error:  # the peer's lease frees the pages instead
                logger.warning("could not tell %s a read landed: %s", read.peer_key, error)

    def poll(self, handle: TransferHandle) -> TransferState:
        read = self._reads.get(handle.handle_id)
        if read is None or handle.state is not TransferState.PENDING:
            return handle.state if read is not None else TransferState.FAILED
        state = self.local.poll(read.local)
        if state is TransferState.FAILED:
            return self._fail(handle, f"rank 0: {read.local.error}")
        follower_states = []
        for rank, report in enumerate(self._followers_now(), start=1):
            name, error = report.reads.get(handle.handle_id, ("PENDING", None))
            if name == "FAILED":
                return self._fail(handle, f"rank {rank}: {error}")
            follower_states.append(name)
        if state is TransferState.DONE and all(name == "DONE" for name in follower_states):
            self._notify(read)
            handle.state = TransferState.DONE
        return handle.state

    def _fail(self, handle: TransferHandle, error: str) -> TransferState:
        handle.state, handle.error = TransferState.FAILED, error
        return handle.state

    def release(self, handle: TransferHandle) -> bool:
        read = self._reads.get(handle.handle_id)
        if read is None:
            return True
        if not self.local.release(read.local):
            return False
        self.link.queue(Release(handle.handle_id))
        if any(handle.handle_id in report.held for report in self._followers_now()):
            return False
        del self._reads[handle.handle_id]
        return True

    # ---- messages --------------------------------------------------------------------------

    def poll_notifications(self) -> list[bytes]:
        if self._clock() - self._progressed_s >= _PROGRESS_INTERVAL_S:
            self.link.send()  # the other ranks move their agents' traffic too
            self._progressed_s = self._clock()
        return self.local.poll_notifications()

    def send_message(self, peer_key: str, payload: bytes) -> None:
        self.local.send_message(peer_key, payload)

    def close(self) -> None:
        self.local.close()


# ---- ranks > 0 ----------------------------------------------------------------------------------


@dataclass(slots=True)
class FollowerTransport:
    """Rank r's agent, doing what rank 0 commands on rank r's slice."""

    local: KVTransport
    rank: int
    _peer_keys: set[str] = field(default_factory=set)
    _connect_errors: dict[str, str] = field(default_factory=dict)
    _reads: dict[int, TransferHandle] = field(default_factory=dict)
    _read_errors: dict[int, str] = field(default_factory=dict)
    _releasing: set[int] = field(default_factory=set)

    def descriptor(self) -> dict:
        return rank_descriptor(self.local.local_peer_info("", ""))

    def apply(self, commands: Sequence[Any]) -> None:
        for command in commands:
            if isinstance(command, Connect):
                self._connect(command)
            elif isinstance(command, Disconnect):
                self._peer_keys.discard(command.peer_key)
                self._connect_errors.pop(command.peer_key, None)
                self.local.disconnect(command.peer_key)
            elif isinstance(command, StartRead):
                self._start_read(command)
            elif isinstance(command, Release):
                self._releasing.add(command.handle_id)
        self.local.poll_notifications()  # progress; messages go to rank 0 only, so none arrive here
        for handle_id in list(self._releasing):
            handle = self._reads.get(handle_id)
            if handle is None or (self.local.poll(handle) is not TransferState.PENDING and self.local.release(handle)):
                self._reads.pop(handle_id, None)
                self._read_errors.pop(handle_id, None)
                self._releasing.discard(handle_id)

    def _connect(self, command: Connect) -> None:
        try:
            peer = PeerInfo.from_dict(command.peers[self.rank])
            key = peer.key
            self._peer_keys.add(key)
            self._connect_errors.pop(key, None)
            self.local.begin_connect(peer)
        except (TransferError, IndexError) as error:
            key = PeerInfo.from_dict(command.peers[0]).key if command.peers else "?"
            self._peer_keys.add(key)
            self._connect_errors[key] = str(error)

    def _start_read(self, command: StartRead) -> None:
        try:
            self._reads[command.handle_id] = self.local.start_read(
                command.peer_key, command.local_block_ids, command.remote_block_ids, b"")
        except (TransferError, ValueError) as error:
            self._read_errors[command.handle_id] = str(error)

    def report(self) -> FollowerReport:
        connects: dict[str, tuple[str, Optional[str]]] = {}
        for key in self._peer_keys:
            if key in self._connect_errors:
                connects[key] = ("FAILED", self._connect_errors[key])
            else:
                state = self.local.poll_connect(key)
                connects[key] = (state.name, self.local.connect_failure(key) if state is TransferState.FAILED else None)
        reads: dict[int, tuple[str, Optional[str]]] = {
            handle_id: ("FAILED", error) for handle_id, error in self._read_errors.items()}
        for handle_id, handle in self._reads.items():
            state = self.local.poll(handle)
            reads[handle_id] = (state.name, handle.error)
        return FollowerReport(connects, reads, frozenset(self._reads))

    def close(self) -> None:
        self.local.close()
