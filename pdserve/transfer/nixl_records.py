"""The records NixlTransport keeps about its agent, its peers and its reads in flight.

Invariant: a record holds NIXL objects (opaque here) and plain values only, never the transport
itself (a reference cycle would leave NIXL objects to the cyclic garbage collector, whose
finalization order aborts inside NIXL). Torch-free and nixl-free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from pdserve.transfer.transport import PeerInfo, TransferHandle, TransferState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ConnectedPeer:
    info: PeerInfo
    remote_name: str
    dlist: Any  # nixl_prepped_dlist_handle over the peer's chunks; None for fine chunks (described per read)
    chunk_bytes: int  # the unit of reads from this peer: a page, a head range of one, or a (unit, row) piece
    warm_up: Any = None  # the warm-up read while connecting, None once connected


@dataclass(frozen=True, slots=True)
class AgentRegistration:
    """What an agent was given: the pool's and the scratch buffer's registrations, the page list."""

    pool: Any
    scratch: Any
    pages: Any  # the local descriptor list of whole pages
    metadata: bytes


@dataclass(slots=True)
class ReadInFlight:
    xfer: Any  # a read_steps.Read
    peer_key: str
    scatter: Optional[Any] = None  # a staged_copy.Scatter, for a staged read
    lost: Optional[str] = None  # why, once the agent that ran it died (the read failed, nothing to release)


def fail_read(handle: TransferHandle, error: str) -> TransferHandle:
    """Mark `handle` FAILED with `error` (logged once, when it was still pending)."""
    if handle.state is TransferState.PENDING:
        logger.warning("read %d from peer %s failed: %s", handle.handle_id, handle.peer_key, error)
    handle.state = TransferState.FAILED
    handle.error = error
    return handle
