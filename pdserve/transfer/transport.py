"""The KV transport contract: how a decode worker pulls block pages from a peer's pool.

Invariant: a transport moves whole pages (one block id = one page of `page_bytes`),
or chunks of them when a peer was connected with a chunk size, and never reports
DONE before every byte of a read has landed in the local pool.
Torch-free and nixl-free: the engine, the fake and the NIXL agent all meet here.
"""

from __future__ import annotations

import base64
import binascii
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from pdserve.api.errors import PdserveError

MEM_TYPES = ("DRAM", "VRAM")


class TransferError(PdserveError):
    """A transfer could not be set up, started or completed (peer gone, bad
    handshake data, NIXL error). Retryable on another prefill worker, hence 503."""

    status_code = 503
    error_type = "service_unavailable"


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a reader needs to address a peer's pool; travels in the HTTP handshake.

    The pool is one registered region starting at `base_address`, block b is
    the `page_bytes` bytes at base_address + b * page_bytes, b < num_blocks.
    `epoch` is an opaque id fresh at every process start: a restarted peer has
    a new epoch, so cached connections to the old process are never reused.
    `via` is the handshake address ("host:port") the reader learnt this record
    through, set by the reader, never sent: the key includes it, so a record
    obtained through one address never stands in for one obtained through another.
    `block_size` is the peer's tokens per page as its handshake geometry says, set by the reader,
    never sent (0: unknown): a reader of another block size cuts its reads by it.
    """

    engine_id: str
    epoch: str
    agent_name: str
    agent_metadata: bytes  # opaque to everyone but the transport implementation
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    base_address: int
    num_blocks: int
    page_bytes: int
    via: str = ""
    block_size: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form: every value is a str or an int (metadata in base64)."""
        return {
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "base_address": self.base_address,
            "num_blocks": self.num_blocks,
            "page_bytes": self.page_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any, via: str = "") -> "PeerInfo":
        """Parse `to_dict` output received from a peer (through handshake address `via`);
        TransferError on anything malformed."""
        if not isinstance(data, dict):
            raise TransferError(f"peer info must be a JSON object, got {type(data).__name__}")
        strings = {name: _require_str(data, name) for name in ("engine_id", "epoch", "agent_name", "mem_type")}
        ints = {name: _require_int(data, name) for name in ("device_id", "base_address", "num_blocks", "page_bytes")}
        if strings["mem_type"] not in MEM_TYPES:
            raise TransferError(f"peer info mem_type must be one of {MEM_TYPES}, got {strings['mem_type']!r}")
        if ints["num_blocks"] < 1 or ints["page_bytes"] < 1:
            raise TransferError("peer info num_blocks and page_bytes must be >= 1")
        try:
            metadata = base64.b64decode(_require_str(data, "agent_metadata"), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TransferError(f"peer info agent_metadata is not valid base64: {exc}") from exc
        return cls(agent_metadata=metadata, via=via, **strings, **ints)

    @property
    def key(self) -> str:
        """The peer key `connect` returns: one per (engine_id, epoch, via)."""
        return peer_key(self.engine_id, self.epoch, self.via)

    def replaced_by(self, new: "PeerInfo") -> bool:
        """Whether connecting `new` retires this peer: the same engine or agent (a restart) reached
        through the same handshake address. Through another address it never does (issue 36)."""
        return self.via == new.via and (self.engine_id == new.engine_id or self.agent_name == new.agent_name)

    def clashes_with(self, new: "PeerInfo") -> bool:
        """Whether `new`, from another handshake address, announces this peer's agent name: an agent
        knows its remote agents by name, so the second cannot be connected beside the first."""
        return self.via != new.via and self.agent_name == new.agent_name


def handshake_address(host: str, port: int) -> str:
    """The `via` of a peer reached by a handshake with host:port (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_key(engine_id: str, epoch: str, via: str = "") -> str:
    """A connection's key: `<engine>@<epoch>`, then `@<handshake address>` where one is known."""
    return f"{engine_id}@{epoch}@{via}" if via else f"{engine_id}@{epoch}"


def _require_str(data: dict, name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise TransferError(f"peer info field {name!r} must be a non-empty string, got {value!r}")
    return value


def _require_int(data: dict, name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TransferError(f"peer info field {name!r} must be a non-negative integer, got {value!r}")
    return value


@dataclass(slots=True)
class TransferHandle:
    """One READ in flight. `started_at_s` (time.monotonic) lets the caller
    enforce its own deadline; `state` and `error` hold what the last poll saw."""

    handle_id: int
    peer_key: str
    num_blocks: int  # descriptors the read moves (a page or a head range of one each)
    num_bytes: int
    started_at_s: float
    state: TransferState = TransferState.PENDING
    error: str | None = field(default=None)

    def age_s(self, now_s: float) -> float:
        return now_s - self.started_at_s


class KVTransport(Protocol):
    """Pulls pages of a remote pool into pages of the local pool.

    Threading: every method but `local_peer_info` must be called from one
    thread (the engine loop); `local_peer_info` is immutable data.
    Progress: an implementation may move data and messages only inside its
    own calls, so both roles call `poll_notifications` every engine step (and
    every few milliseconds while idle with pages pinned or a peer connecting).
    """

    @property
    def num_blocks(self) -> int:
        """Pages in the local pool."""
        ...

    @property
    def page_bytes(self) -> int:
        """Bytes of one page; a peer is only usable when its page_bytes is equal."""
        ...

    @property
    def generation(self) -> int:
        """How many times this transport's agent was replaced (an isolated NIXL agent that died): 0 for
        one that never was. A new generation knows no peer, and the worker's transfer epoch names it."""
        ...

    def local_peer_info(self, engine_id: str, epoch: str) -> PeerInfo:
        """What a reader needs to pull from this process's pool."""
        ...

    def begin_connect(self, peer: PeerInfo, chunk_bytes: Optional[int] = None) -> str:
        """Start connecting to a peer without waiting; returns the peer key.

        `chunk_bytes` is the unit the reads from this peer move: None, whole
        pages (the peer's pages must then be as large as ours); otherwise a
        size that divides both sides' pages, and the ids `start_read` takes
        for this peer count chunks (chunk i of page b is id
        b * page_bytes // chunk_bytes + i on its side): what moves one KV head
        range of a block when the two workers split their heads differently.

        Loads the peer's metadata and starts a small warm-up read that proves
        its data path works; `poll_connect` reports when it has. Idempotent per
        (engine_id, epoch). A peer with the same engine id or agent name but
        another epoch (a restart) replaces the old connection. Raises
        TransferError when the peer cannot be used (page size mismatch,
        metadata the backend rejects)."""
        ...

    def poll_connect(self, peer_key: str) -> TransferState:
        """PENDING while the warm-up read is in flight, DONE once reads and
        messages to the peer may be used, FAILED (final; the attempt is
        forgotten) when it cannot be reached. Never blocks. Unknown key: FAILED."""
        ...

    def connect_failure(self, peer_key: str) -> str | None:
        """Why the last connection attempt to `peer_key` failed (None if it did not)."""
        ...

    def connect(self, peer: PeerInfo) -> str:
        """`begin_connect`, then wait for it (bounded). Blocks: tools and tests
        only, never the engine thread. Raises TransferError when it fails."""
        ...

    def disconnect(self, peer_key: str) -> None:
        """Forget a peer, connected or connecting (no-op when unknown). Reads still in flight to it fail."""
        ...

    def start_read(self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notification: bytes) -> TransferHandle:
        """Start copying remote page (or chunk, see `begin_connect`) remote_block_ids[i]
        into local page (chunk) local_block_ids[i] for every i (runs adjacent on both sides may move
        as one descriptor; a read of many small chunks may move through a local staging buffer).
        A non-empty `notification` is delivered to the peer's `poll_notifications` only after every
        byte of the read has left the peer's pages (with staging: once in the staging buffer, before
        the local scatter; the handle is DONE only after it) (empty: none is sent); with no blocks, it is sent at once and the handle
        is already DONE. A read that cannot start or whose peer fails reports
        FAILED (possibly already on return), it does not raise. Raises
        TransferError only for an unknown peer key, and ValueError for
        mismatched or out-of-range ids (a caller bug)."""
        ...

    def poll(self, handle: TransferHandle) -> TransferState:
        """Current state (never blocks). DONE and FAILED are final; on FAILED,
        `handle.error` says why. The local pages of a PENDING read may still be
        written: do not free or reuse them before DONE/FAILED and `release`."""
        ...

    def release(self, handle: TransferHandle) -> bool:
        """Free the handle. True when no write into its local pages can happen
        any more; False when a PENDING read could not be cancelled: keep the
        pages and call again later. Idempotent."""
        ...

    def poll_notifications(self) -> list[bytes]:
        """Messages that reached this process since the last call: read-completion
        notifications and `send_message` payloads from readers (peer side)."""
        ...

    def send_message(self, peer_key: str, payload: bytes) -> None:
        """Send a plain notification to a connected peer (e.g. "free now, I
        will not read"). Raises TransferError when it cannot be sent."""
        ...

    def close(self) -> None:
        """Disconnect all peers and unregister the pool. Idempotent."""
        ...


def num_chunks(page_bytes: int, chunk_bytes: int, num_blocks: int) -> int:
    """Chunks of `chunk_bytes` in a pool of `num_blocks` pages; ValueError when a chunk does not divide a page."""
    if chunk_bytes < 1 or page_bytes % chunk_bytes:
        raise ValueError(f"chunks of {chunk_bytes} bytes do not divide pages of {page_bytes}")
    return num_blocks * (page_bytes // chunk_bytes)


def wait_connected(transport: KVTransport, peer: PeerInfo, timeout_s: float, poll_interval_s: float = 0.0005) -> str:
    """Blocking connect for tools and tests: `begin_connect`, then poll until done or `timeout_s`."""
    key = transport.begin_connect(peer)
    deadline_s = time.monotonic() + timeout_s
    while (state := transport.poll_connect(key)) is TransferState.PENDING:
        if time.monotonic() > deadline_s:
            transport.disconnect(key)
            raise TransferError(f"peer {key} is not reachable: no answer within {timeout_s} s")
        time.sleep(poll_interval_s)
    if state is TransferState.FAILED:
        raise TransferError(transport.connect_failure(key) or f"peer {key} is not reachable")
    return key
