"""Peer pulls on the wire: the hint that aims a worker at a peer holding a prompt's prefix, and the
peer's pin of that prefix (`POST /internal/kv/peer_pin`).

Invariant: a hint says only where to ask (host, internal port) and how much the proxy expects there;
what is read comes from the holder's own record (`PeerPinTicket`): its block ids, matched by the
holder's block-hash chain of the tokens it was sent, never ids the puller or a client named. The
puller reads only blocks whose hash chain equals its own prompt's. A hint is internal: a worker takes
it only from a caller showing the internal token when one is configured (pdserve/server/peer_hint.py).
Torch-free; the proxy imports it.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from pdserve.api.errors import PdserveError
from pdserve.api.kv_transfer import PIN_NONCE_PATTERN, bare_host

PEER_HINT_HEADER = "X-Pdserve-Peer-Hint"
PEER_PIN_PATH = "/internal/kv/peer_pin"
MAX_PEER_PIN_TOKENS = 1 << 20  # a pin request names at most this many prompt tokens (its body is bounded too)
# A hint: `host:port;tokens=N;medium=device` (host may be a bracketed IPv6 literal).
_HINT = re.compile(r"^\s*(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})\s*;\s*tokens=(\d{1,9})"
                   r"(?:\s*;\s*medium=(device|offload))?\s*$")

Medium = Literal["device", "offload"]


class PeerPinRefused(PdserveError):
    """This worker does not lend prefixes of its KV: peer pulls off, or a model whose KV does not move
    between peers yet (the message names which)."""

    status_code = 409
    error_type = "peer_pin_refused"


class PeerHint(BaseModel):
    """Which peer holds how much of a prompt's prefix, and on which medium (the proxy's prediction)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: StrictStr = Field(min_length=1, max_length=255)
    port: StrictInt = Field(ge=1, le=65535)  # the peer's internal listener
    num_tokens: StrictInt = Field(ge=1)
    medium: Medium = "device"

    @field_validator("host")
    @classmethod
    def _bare_host(cls, host: str) -> str:
        return bare_host(host)

    def to_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port};tokens={self.num_tokens};medium={self.medium}"


def parse_peer_hint(text: str) -> Optional[PeerHint]:
    """The hint in a header's value; None when it is malformed (a malformed hint is ignored, never an error:
    the request is served, computed here)."""
    match = _HINT.match(text)
    if match is None:
        return None
    host, port, tokens, medium = match.groups()
    try:
        return PeerHint(host=host.strip("[]"), port=int(port), num_tokens=int(tokens), medium=medium or "device")
    except ValueError:  # pydantic's ValidationError included
        return None


class PeerPinRequest(BaseModel):
    """The puller asks a peer to pin the longest prefix of these tokens it holds (in its pool or its offload tier)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    token_ids: list[StrictInt] = Field(min_length=1, max_length=MAX_PEER_PIN_TOKENS)


class PeerPinTicket(BaseModel):
    """The holder's record of a prefix it pinned for a puller: where the blocks are (per group), the
    hash chain they were matched by (hex, one per block), and the pin's nonce and remaining lease.
    The puller reads these blocks, then sends "done" with the nonce (the lease frees them otherwise)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    pin_id: StrictStr = Field(min_length=1, max_length=256)
    engine_id: StrictStr = Field(min_length=1, max_length=128)
    epoch: StrictStr = Field(min_length=1, max_length=64)
    nonce: StrictStr = Field(pattern=f"^{PIN_NONCE_PATTERN}$")
    num_tokens: StrictInt = Field(ge=1)
    block_size: StrictInt = Field(ge=1)
    block_ids: list[list[StrictInt]]
    block_hashes: list[StrictStr]
    lease_left_s: float = Field(ge=0)
