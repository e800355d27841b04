"""Decode side, engine thread: connections to prefill peers, set up without ever waiting.

Invariant: the engine thread only starts a connection and polls it; a peer is
used for reads only once its warm-up read landed, and an attempt that has not
within `connect_timeout_s` is abandoned. Whoever asked is told the outcome
exactly once, through its callback. Torch-free.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.transfer.transport import KVTransport, PeerInfo, TransferError, TransferState

logger = logging.getLogger(__name__)

ConnectCallback = Callable[[Optional[str]], None]  # None: connected; else why not


@dataclass(slots=True)
class _Attempt:
    started_s: float
    waiters: list[ConnectCallback] = field(default_factory=list)


class PeerConnections:
    def __init__(self, transport: KVTransport, connect_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self.clock = clock
        self._ready: set[str] = set()
        self._attempts: dict[str, _Attempt] = {}
        self._generation = transport.generation

    def _follow_agent(self) -> None:
        """A replaced NIXL agent (its process died) knows no peer: every one connects again."""
        generation = self.transport.generation
        if generation != self._generation:
            self._generation = generation
            self._ready.clear()

    def ensure(self, peer: PeerInfo, on_done: ConnectCallback) -> None:
        """Connect to `peer` unless already connected; `on_done` hears the outcome."""
        key = peer.key
        self._follow_agent()
        if key in self._ready:
            _tell(on_done, None)
            return
        attempt = self._attempts.get(key)
        if attempt is None:
            try:
                self.transport.begin_connect(peer)
            except TransferError as error:
                _tell(on_done, f"cannot connect to prefill worker {key}: {error.message}")
                return
            attempt = self._attempts[key] = _Attempt(self.clock())
            # A restart of the same engine replaces the old connection in the transport.
            self._ready = {k for k in self._ready if not _same_engine(k, key)}
        attempt.waiters.append(on_done)

    def key_for(self, peer_key: str) -> Optional[str]:
        self._follow_agent()
        return peer_key if peer_key in self._ready else None

    def forget(self, peer_key: str) -> None:
        """Drop a peer whose reads failed, so the next request reconnects (and proves the path again)."""
        if peer_key in self._ready:
            self._ready.discard(peer_key)
            self.transport.disconnect(peer_key)

    def has_pending(self) -> bool:
        return bool(self._attempts)

    def poll(self) -> None:
        now = self.clock()
        for key, attempt in list(self._attempts.items()):
            state = self.transport.poll_connect(key)
            error = None
            if state is TransferState.PENDING:
                if now - attempt.started_s <= self.connect_timeout_s:
                    continue
                self.transport.disconnect(key)
                error = f"prefill worker {key} did not answer on its data path within {self.connect_timeout_s:g} s"
            elif state is TransferState.FAILED:
                error = self.transport.connect_failure(key) or f"prefill worker {key} is not reachable"
            else:
                self._ready.add(key)
            del self._attempts[key]
            if error is not None:
                logger.warning("%s", error)
            for waiter in attempt.waiters:
                _tell(waiter, error)


def _tell(waiter: ConnectCallback, error: Optional[str]) -> None:
    try:
        waiter(error)
    except Exception:  # a waiter's fault must not reach the engine thread
        logger.exception("a connection waiter failed")


def _same_engine(key_a: str, key_b: str) -> bool:
    """Peer keys are `<engine_id>@<epoch>`: same engine id, any epoch."""
    return key_a.rpartition("@")[0] == key_b.rpartition("@")[0]
