"""KV transfer between tensor-parallel workers of any TP sizes: each decode rank reads its KV heads
from the prefill ranks that hold them, one descriptor per (block, source rank).

Each rank's pool slice holds its own heads of the same block ids, registered with its own agent,
and pages hold heads outermost, so what a decode rank needs from one prefill rank is one
contiguous range of both pages (pdserve/kv/head_split.py: which rank holds which head). Rank 0
is the only rank the P/D code sees: `RankedTransport` is a `KVTransport` that does its own
rank's share (`RankReader`) and sends the same command to the other ranks (`FollowerTransport`),
then reports the worst state of all:

    decode rank 0  --- its heads of each block: one READ per source rank --->  prefill rank(s)
        |  StartRead (next rank message)
        v
    decode rank r  --- its heads of each block: one READ per source rank --->  prefill rank(s)

    poll: DONE only when every rank's reads are DONE; then rank 0 alone sends the read's
          notification to prefill rank 0, so P releases its pin once, after every slice landed
    release: True only when no rank may still write the pages

What a worker advertises in the handshake is rank 0's `PeerInfo` whose opaque `agent_metadata`
lists every rank's agent (JSON, metadata in base64); every P/D worker advertises it so, TP=1
included. Each source rank is a peer of its own to the transport below (engine id
`<engine>/rank<r>`), connected with reads in units of the heads one descriptor moves.
Torch-free and nixl-free.
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

import numpy as np

from pdserve.kv.head_split import HeadSource, chunk_heads, head_sources, rank_kv_heads
from pdserve.transfer.state_ranges import StateMove, StateSlotMove, StateSplit, rank_state_moves
from pdserve.transfer.token_units import (UnitGeometry, byte_chunk_ids, padded_unit_geometry, unit_chunk_ids,
                                          unit_geometry)
from pdserve.transfer.transport import (
    KVTransport, PeerInfo, TransferError, TransferHandle, TransferState, wait_connected)

logger = logging.getLogger(__name__)

_RANKS_KEY = "pdserve_ranks"
_RANK_FIELDS = ("agent_name", "agent_metadata", "mem_type", "device_id", "base_address")
MAX_RANKS = 64
_SYNC_INTERVAL_S = 0.001  # reports younger than this are reused (many handles are polled per turn)
_PROGRESS_INTERVAL_S = 0.005  # how often idle followers are asked to move their agents' messages
_STATE_ORDER = {TransferState.FAILED: 0, TransferState.PENDING: 1, TransferState.DONE: 2}  # worst first


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
    peer_key: str  # the peer as the P/D code names it (rank 0's key)
    peers: tuple[dict, ...]  # PeerInfo.to_dict() of every rank of the peer


@dataclass(frozen=True, slots=True)
class Disconnect:
    peer_key: str


@dataclass(frozen=True, slots=True)
class StartRead:
    handle_id: int
    peer_key: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    state_moves: tuple[StateSlotMove, ...] = ()  # each rank cuts its heads' byte ranges from them


@dataclass(frozen=True, slots=True)
class Release:
    handle_id: int


@dataclass(frozen=True, slots=True)
class FollowerReport:
    connects: dict[str, tuple[TransferState, Optional[str]]]  # peer key -> (state, why it failed)
    reads: dict[int, tuple[TransferState, Optional[str]]]  # handle id -> (state, error)
    held: frozenset[int]  # handles whose pages this rank may still write


def encode_ranks(ranks: Sequence[dict]) -> bytes:
    return json.dumps({_RANKS_KEY: list(ranks)}).encode()


def decode_ranks(peer: PeerInfo) -> list[PeerInfo]:
    """Every rank's PeerInfo from rank 0's; TransferError when it does not describe 1..64 ranks."""
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
    if not 1 <= len(parsed) <= MAX_RANKS:
        raise TransferError(f"peer {peer.key} lists {len(parsed)} tensor-parallel ranks (1 to {MAX_RANKS} expected)")
    return parsed


def rank_descriptor(info: PeerInfo) -> dict:
    """The per-rank part of a PeerInfo (what differs between ranks)."""
    data = info.to_dict()
    return {name: data[name] for name in _RANK_FIELDS}


def _worst(states: Sequence[tuple[TransferState, Optional[str]]]) -> tuple[TransferState, Optional[str]]:
    return min(states, key=lambda state: _STATE_ORDER[state[0]], default=(TransferState.DONE, None))


# ---- one rank's share ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Link:
    """This rank's connections to one peer: a sub-peer per source rank."""

    sources: list[HeadSource]
    sub_keys: list[str]  # per source
    local_chunks: int  # chunks (of chunk_heads heads) in a local page
    remote_chunks: int  # ... in a remote rank's page
    chunk_heads: int
    units: Optional[UnitGeometry] = None  # set when the peer's block size differs: reads move row units
    failure: Optional[str] = None  # set when a sub-connection could not even start
    remote_size: int = 1  # the peer's ranks
    state_ranks: list[int] = field(default_factory=list)  # ranks read for state alone (no KV heads), after sources


class RankReader:
    """One rank's reads: which source ranks hold its heads, a connection to each, one READ each.

    With a peer of the same block size a read names blocks and moves one head range per (block,
    source). With a peer of another block size it names units (pdserve/transfer/token_units.py)
    and moves one row of one unit per descriptor: the rows of a head slab, (layer slot, K|V) each,
    are `2 * num_layer_slots` to a head on both sides.

    Knowing its `block_size`, attention page (`kv_page_bytes`) and how its state layers split
    (`state_splits`), it reads a peer whose `PeerInfo.block_size` is known, or (with state) one of
    another TP size, in chunks that also cut padded pages and every state byte range
    (token_units.padded_unit_geometry): recurrent state then moves as byte ranges beside the units,
    each rank its heads' share of every slot from the peer ranks holding it (transfer/state_ranges.py),
    connecting to a peer rank for state alone where its KV heads come from elsewhere."""

    def __init__(self, local: KVTransport, rank: int, size: int, num_kv_heads: int, num_layer_slots: int,
                 block_size: int = 0, kv_page_bytes: int = 0, state_splits: Sequence[StateSplit] = ()):
        self.local = local
        self.rank = rank
        self.size = size
        self.num_kv_heads = num_kv_heads
        self.rows_per_head = 2 * num_layer_slots
        self.block_size = block_size
        self.kv_page_bytes = kv_page_bytes or local.page_bytes
        self.state_splits = tuple(state_splits)
        self.num_local_heads = rank_kv_heads(num_kv_heads, size, rank)[1]
        if local.page_bytes % self.num_local_heads:
            raise ValueError(f"pages of {local.page_bytes} bytes do not hold {self.num_local_heads} equal head slabs")
        self.slab_bytes = local.page_bytes // self.num_local_heads
        self._links: dict[str, _Link] = {}
        self._reads: dict[int, list[TransferHandle]] = {}
        self._read_errors: dict[int, str] = {}
        self._generation = local.generation

    def connect(self, peer_key: str, ranks: Sequence[PeerInfo]) -> None:
        generation = self.local.generation
        if generation != self._generation:  # a replaced agent (its process died) knows none of the links
            self._generation = generation
            self._links.clear()
        if peer_key in self._links:
            return
        remote_size = len(ranks)
        heads = chunk_heads(self.num_kv_heads, self.size, remote_size)
        remote_heads = rank_kv_heads(self.num_kv_heads, remote_size, 0)[1]
        link = _Link(head_sources(self.num_kv_heads, self.size, self.rank, remote_size), [],
                     self.num_local_heads // heads, remote_heads // heads, heads, remote_size=remote_size)
        self._links[peer_key] = link
        chunk_bytes = heads * self.slab_bytes
        splits_state = bool(self.state_splits) and remote_size != self.size
        if splits_state or self._block_size_differs(ranks[0], remote_heads):
            try:
                link.units = self._units(ranks[0], remote_heads, remote_size)
            except ValueError as error:
                link.failure = f"rank {self.rank} cannot read pages of {ranks[0].page_bytes} bytes: {error}"
                return
            chunk_bytes = link.units.chunk_bytes
        if splits_state:
            kv_ranks = {source.remote_rank for source in link.sources}
            link.state_ranks = sorted({piece.remote_rank for split in self.state_splits
                                       for piece in split.pieces(self.rank, self.size, remote_size)} - kv_ranks)
        for remote_rank in [source.remote_rank for source in link.sources] + link.state_ranks:
            remote = ranks[remote_rank]
            sub_peer = dataclasses.replace(remote, engine_id=f"{remote.engine_id}/rank{remote_rank}")
            try:
                link.sub_keys.append(self.local.begin_connect(sub_peer, chunk_bytes=chunk_bytes))
            except TransferError as error:
                link.failure = f"rank {self.rank} -> peer rank {remote_rank}: {error.message}"
                return

    def _block_size_differs(self, remote: PeerInfo, remote_heads: int) -> bool:
        if self.block_size and remote.block_size:
            return remote.block_size != self.block_size
        return remote.page_bytes * self.num_local_heads != self.local.page_bytes * remote_heads  # unpadded pages

    def _units(self, remote: PeerInfo, remote_heads: int, remote_size: int) -> UnitGeometry:
        local_rows, remote_rows = self.num_local_heads * self.rows_per_head, remote_heads * self.rows_per_head
        if not (self.block_size and remote.block_size):
            return unit_geometry(self.local.page_bytes, local_rows, remote.page_bytes, remote_rows)
        if self.kv_page_bytes % local_rows:
            raise ValueError(f"attention pages of {self.kv_page_bytes} bytes do not hold {local_rows} equal rows")
        local_row = self.kv_page_bytes // local_rows
        if (local_row * remote.block_size) % self.block_size:
            raise ValueError(f"rows of {local_row} bytes for {self.block_size} tokens do not scale to "
                             f"{remote.block_size} tokens")
        cuts = [size for split in self.state_splits for size in split.boundary_bytes(self.size, remote_size)]
        return padded_unit_geometry(local_row, local_rows, self.local.page_bytes,
                                    local_row * remote.block_size // self.block_size, remote_rows,
                                    remote.page_bytes, cuts)

    def connect_state(self, peer_key: str) -> tuple[TransferState, Optional[str]]:
        link = self._links.get(peer_key)
        if link is None:
            return TransferState.FAILED, "not connecting"
        if link.failure is not None:
            return TransferState.FAILED, link.failure
        states = []
        for sub_key in link.sub_keys:
            state = self.local.poll_connect(sub_key)
            states.append((state, self.local.connect_failure(sub_key) if state is TransferState.FAILED else None))
        return _worst(states)

    def disconnect(self, peer_key: str) -> None:
        link = self._links.pop(peer_key, None)
        for sub_key in link.sub_keys if link is not None else ():
            self.local.disconnect(sub_key)

    def sub_key(self, peer_key: str) -> str:
        """The connection to the peer's rank 0, or the first source (messages go there)."""
        link = self._links.get(peer_key)
        if link is None or not link.sub_keys:
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        return link.sub_keys[0]

    def start_read(self, handle_id: int, peer_key: str, local_block_ids: Sequence[int],
                   remote_block_ids: Sequence[int],
                   state_moves: Sequence[StateSlotMove] = ()) -> list[TransferHandle]:
        link = self._links.get(peer_key)
        if link is None or link.failure is not None or len(link.sub_keys) != len(link.sources) + len(link.state_ranks):
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        handles = []
        try:
            by_rank = rank_state_moves(state_moves, self.rank, self.size, link.remote_size) if state_moves else {}
            kv_keys, state_keys = link.sub_keys[:len(link.sources)], link.sub_keys[len(link.sources):]
            reads = [(sub_key, *self._chunk_ids(link, source, local_block_ids, remote_block_ids), source.remote_rank)
                     for source, sub_key in zip(link.sources, kv_keys)]
            reads += [(sub_key, (), (), rank) for rank, sub_key in zip(link.state_ranks, state_keys)
                      if rank in by_rank]  # a rank read for state alone: only when it holds some of it
            for sub_key, local_ids, remote_ids, remote_rank in reads:
                moves = by_rank.pop(remote_rank, [])
                if moves:
                    local_state, remote_state = self._state_chunk_ids(link, moves)
                    local_ids = np.concatenate([np.asarray(local_ids, dtype=np.int64), local_state])
                    remote_ids = np.concatenate([np.asarray(remote_ids, dtype=np.int64), remote_state])
                handles.append(self.local.start_read(sub_key, local_ids, remote_ids, b""))
            if by_rank:
                raise ValueError(f"state of peer ranks {sorted(by_rank)} but no connection to them")
        except (TransferError, ValueError) as error:
            self._read_errors[handle_id] = str(error)
        self._reads[handle_id] = handles
        return handles

    def _chunk_ids(self, link: _Link, source: HeadSource, local_ids: Sequence[int],
                   remote_ids: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
        """What one source's READ moves: its head range of each block, or each row of it per unit."""
        if link.units is None:
            return ([b * link.local_chunks + source.local_offset // link.chunk_heads for b in local_ids],
                    [b * link.remote_chunks + source.remote_offset // link.chunk_heads for b in remote_ids])
        num_rows = source.num_heads * self.rows_per_head
        return (unit_chunk_ids(link.units.local, local_ids, source.local_offset * self.rows_per_head, num_rows),
                unit_chunk_ids(link.units.remote, remote_ids, source.remote_offset * self.rows_per_head, num_rows))

    def _state_chunk_ids(self, link: _Link, moves: Sequence[StateMove]) -> tuple[np.ndarray, np.ndarray]:
        """The chunks of every state move on both sides, move by move (each a run on both sides)."""
        if link.units is None:
            raise ValueError("state moves as byte ranges only between workers of different block or TP sizes "
                             "(equal ones move whole state pages)")
        chunk = link.units.chunk_bytes
        local = [byte_chunk_ids(link.units.local, chunk, move.local_page, move.local_offset_bytes, move.num_bytes)
                 for move in moves]
        remote = [byte_chunk_ids(link.units.remote, chunk, move.remote_page, move.remote_offset_bytes, move.num_bytes)
                  for move in moves]
        return np.concatenate(local), np.concatenate(remote)

    def read_state(self, handle_id: int) -> tuple[TransferState, Optional[str]]:
        if handle_id in self._read_errors:
            return TransferState.FAILED, self._read_errors[handle_id]
        states = [(self.local.poll(handle), handle.error) for handle in self._reads.get(handle_id, [])]
        return _worst(states)

    def release(self, handle_id: int) -> bool:
        """True once none of the read's pages can still be written here (then it is forgotten)."""
        handles = self._reads.get(handle_id, [])
        kept = [handle for handle in handles if not self.local.release(handle)]
        if kept:
            self._reads[handle_id] = kept
            return False
        self._reads.pop(handle_id, None)
        self._read_errors.pop(handle_id, None)
        return True

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._reads)

    def peer_keys(self) -> list[str]:
        return list(self._links)


# ---- rank 0 -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _RankedRead:
    peer_key: str
    notification: bytes
    notified: bool = False


class RankedTransport:
    """Rank 0's KVTransport over every rank's slice (see the module docstring); with no followers
    (TP=1) it is rank 0's reader alone."""

    def __init__(self, local: KVTransport, link: Optional[FollowerLink], follower_descriptors: Sequence[dict],
                 num_kv_heads: int, num_layer_slots: int, clock: Callable[[], float] = time.monotonic,
                 block_size: int = 0, kv_page_bytes: int = 0, state_splits: Sequence[StateSplit] = ()):
        self.local = local
        self.link = link
        self.num_ranks = 1 + len(follower_descriptors)
        self.reader = RankReader(local, 0, self.num_ranks, num_kv_heads, num_layer_slots, block_size, kv_page_bytes,
                                 state_splits)
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

    @property
    def generation(self) -> int:
        """Times rank 0's agent was replaced (an isolated agent that died); the other ranks' agents run inline."""
        return self.local.generation

    def local_peer_info(self, engine_id: str, epoch: str) -> PeerInfo:
        info = self.local.local_peer_info(engine_id, epoch)
        return dataclasses.replace(info, agent_metadata=encode_ranks([rank_descriptor(info), *self._followers]))

    # ---- followers' state ------------------------------------------------------------------

    def _followers_now(self) -> list[FollowerReport]:
        """The other ranks' latest reports (asks again unless the last answer is fresh and nothing is queued)."""
        if self.link is None:
            return []
        now = self._clock()
        if now - self._reported_s >= _SYNC_INTERVAL_S or self.link.has_queued:
            self._reports = [report for report in self.link.send(want_report=True) if report is not None]
            self._reported_s = self._progressed_s = self._clock()
        return self._reports

    def _queue(self, command: Any) -> None:
        if self.link is not None:
            self.link.queue(command)

    # ---- peers -----------------------------------------------------------------------------

    def begin_connect(self, peer: PeerInfo, chunk_bytes: Optional[int] = None) -> str:
        """Connect every rank to the peer's ranks it reads from (`chunk_bytes` is decided here)."""
        ranks = decode_ranks(peer)
        self.reader.connect(peer.key, ranks)
        # The block size never rides on the wire; the other ranks cut their reads by it too.
        self._queue(Connect(peer.key, tuple({**rank.to_dict(), "via": rank.via, "block_size": rank.block_size}
                                            for rank in ranks)))
        self._reported_s = float("-inf")  # the next poll must see the followers' answer to this
        return peer.key

    def poll_connect(self, peer_key: str) -> TransferState:
        state, _ = self.reader.connect_state(peer_key)
        if state is TransferState.FAILED:
            return TransferState.FAILED
        states = [state] + [report.connects.get(peer_key, (TransferState.FAILED, "not connecting"))[0]
                            for report in self._followers_now()]
        return _worst([(each, None) for each in states])[0]

    def connect_failure(self, peer_key: str) -> Optional[str]:
        state, error = self.reader.connect_state(peer_key)
        if state is TransferState.FAILED:
            return f"rank 0: {error}"
        for rank, report in enumerate(self._reports, start=1):
            state, error = report.connects.get(peer_key, (TransferState.FAILED, None))
            if state is TransferState.FAILED:
                return f"rank {rank}: {error or 'cannot reach the peer'}"
        return None

    def connect(self, peer: PeerInfo) -> str:
        return wait_connected(self, peer, 30.0)

    def disconnect(self, peer_key: str) -> None:
        self.reader.disconnect(peer_key)
        self._queue(Disconnect(peer_key))

    # ---- reads -----------------------------------------------------------------------------

    def start_read(self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notification: bytes, state_moves: Sequence[StateSlotMove] = ()) -> TransferHandle:
        """`state_moves`: state layers' slots besides the units; every rank reads its heads' bytes of them."""
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError(f"{len(local_block_ids)} local block ids for {len(remote_block_ids)} remote ones")
        handle_id = next(self._ids)
        local = self.reader.start_read(handle_id, peer_key, local_block_ids, remote_block_ids, state_moves)
        if len(local_block_ids) or state_moves:
            self._queue(StartRead(handle_id, peer_key, tuple(local_block_ids), tuple(remote_block_ids),
                                  tuple(state_moves)))
        read = _RankedRead(peer_key, notification)
        self._reads[handle_id] = read
        # The ranks of a worker split evenly: each moves rank 0's bytes in as many descriptors.
        num_bytes = sum(handle.num_bytes for handle in local) * self.num_ranks
        num_descriptors = sum(handle.num_blocks for handle in local) * self.num_ranks
        started_s = min((handle.started_at_s for handle in local), default=time.monotonic())
        handle = TransferHandle(handle_id, peer_key, num_descriptors, num_bytes, started_s)
        if not local_block_ids and not state_moves:
            self._notify(read)
            handle.state = TransferState.DONE
        return handle

    def _notify(self, read: _RankedRead) -> None:
        if read.notification and not read.notified:
            read.notified = True
            try:
                self.local.send_message(self.reader.sub_key(read.peer_key), read.notification)
            except TransferError as error:  # the peer's lease frees the pages instead
                logger.warning("could not tell %s a read landed: %s", read.peer_key, error)

    def poll(self, handle: TransferHandle) -> TransferState:
        read = self._reads.get(handle.handle_id)
        if read is None or handle.state is not TransferState.PENDING:
            return handle.state if read is not None else TransferState.FAILED
        state, error = self.reader.read_state(handle.handle_id)
        if state is TransferState.FAILED:
            return self._fail(handle, f"rank 0: {error}")
        follower_states = []
        for rank, report in enumerate(self._followers_now(), start=1):
            follower_state, error = report.reads.get(handle.handle_id, (TransferState.PENDING, None))
            if follower_state is TransferState.FAILED:
                return self._fail(handle, f"rank {rank}: {error}")
            follower_states.append(follower_state)
        if state is TransferState.DONE and all(each is TransferState.DONE for each in follower_states):
            self._notify(read)
            handle.state = TransferState.DONE
        return handle.state

    def _fail(self, handle: TransferHandle, error: str) -> TransferState:
        handle.state, handle.error = TransferState.FAILED, error
        return handle.state

    def release(self, handle: TransferHandle) -> bool:
        if handle.handle_id not in self._reads:
            return True
        if not self.reader.release(handle.handle_id):
            return False
        self._queue(Release(handle.handle_id))
        if any(handle.handle_id in report.held for report in self._followers_now()):
            return False
        del self._reads[handle.handle_id]
        return True

    # ---- messages --------------------------------------------------------------------------

    def poll_notifications(self) -> list[bytes]:
        if self.link is not None and self._clock() - self._progressed_s >= _PROGRESS_INTERVAL_S:
            self.link.send()  # the other ranks move their agents' traffic too
            self._progressed_s = self._clock()
        return self.local.poll_notifications()

    def send_message(self, peer_key: str, payload: bytes) -> None:
        self.local.send_message(self.reader.sub_key(peer_key), payload)

    def close(self) -> None:
        self.local.close()


# ---- ranks > 0 ----------------------------------------------------------------------------------


@dataclass(slots=True)
class FollowerTransport:
    """Rank r's agent, doing what rank 0 commands on rank r's slice."""

    reader: RankReader
    _releasing: set[int] = field(default_factory=set)

    @property
    def local(self) -> KVTransport:
        return self.reader.local

    def descriptor(self) -> dict:
        return rank_descriptor(self.local.local_peer_info("", ""))

    def apply(self, commands: Sequence[Any]) -> None:
        for command in commands:
            if isinstance(command, Connect):
                try:
                    self.reader.connect(command.peer_key, [
                        dataclasses.replace(PeerInfo.from_dict(peer, via=str(peer.get("via", ""))),
                                            block_size=int(peer.get("block_size", 0))) for peer in command.peers])
                except TransferError as error:
                    logger.warning("rank %d: cannot connect to %s: %s", self.reader.rank, command.peer_key, error)
            elif isinstance(command, Disconnect):
                self.reader.disconnect(command.peer_key)
            elif isinstance(command, StartRead):
                self.reader.start_read(command.handle_id, command.peer_key, command.local_block_ids,
                                       command.remote_block_ids, command.state_moves)
            elif isinstance(command, Release):
                self._releasing.add(command.handle_id)
        self.local.poll_notifications()  # progress; messages go to rank 0 only, so none arrive here
        for handle_id in list(self._releasing):
            if self.reader.release(handle_id):
                self._releasing.discard(handle_id)

    def report(self) -> FollowerReport:
        connects = {key: self.reader.connect_state(key) for key in self.reader.peer_keys()}
        reads = {handle_id: self.reader.read_state(handle_id) for handle_id in self.reader.held}
        return FollowerReport(connects, reads, self.reader.held)

    def close(self) -> None:
        self.local.close()
