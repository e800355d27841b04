"""How a worker's ranks authenticate the control records they exchange: an HMAC keyed by the internal token.

Invariant: a rank unpickles a control record only after its tag checks out, and the tag covers the
record's place in the sequence of collectives and its sender's rank, so a record forged, altered,
replayed or moved to another rank's slot by anyone who reached the rendezvous port is refused
(`ControlRecordRejected`) before a byte of it is unpickled:

    sealed record = tag (32 bytes) | payload (pickle)
    tag = HMAC-SHA256(key, sequence number (8 bytes) | sender rank (4 bytes) | payload)
    key = HMAC-SHA256(internal token, "pdserve tensor-parallel control records v1")

Without an internal token there is no key: then every rank must meet on a loopback address (one
host: `pdserve prefill -tp N` binds 127.0.0.1), and `control_key` refuses anything else.
Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import pickle
import socket
import struct
from typing import Any, Optional

from pdserve.parallel.errors import RanksLost

TAG_BYTES = 32
_KEY_LABEL = b"pdserve tensor-parallel control records v1"


class ControlRecordRejected(RanksLost):
    """A control record whose tag does not check out: forged, altered, replayed, or keyed by another
    token (the ranks were started with different --internal-token values)."""


def control_key(internal_token: Optional[str], master_addr: str) -> Optional[bytes]:
    """The key of the ranks' control records, None without a token; ValueError when ranks would meet on
    an address other hosts can reach with no token to key the records by."""
    if internal_token is not None:
        return hmac.new(internal_token.encode(), _KEY_LABEL, hashlib.sha256).digest()
    if not is_loopback(master_addr):
        raise ValueError(f"tensor-parallel ranks meeting at --tp-master-addr {master_addr} (not loopback) need "
                         "--internal-token (or PDSERVE_INTERNAL_TOKEN), the same on every rank: it keys the HMAC "
                         "on their control records, which anyone reaching the rendezvous port could forge")
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` (a literal address or a name) names only loopback addresses."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def seal(key: Optional[bytes], record: Any, sequence: int, sender: int) -> bytes:
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return _tag(key, payload, sequence, sender) + payload


def unseal(key: Optional[bytes], sealed: bytes, sequence: int, sender: int) -> Any:
    """The record inside `sealed`, after checking its tag; ControlRecordRejected if it does not match."""
    tag, payload = sealed[:TAG_BYTES], sealed[TAG_BYTES:]
    if len(sealed) < TAG_BYTES or not hmac.compare_digest(tag, _tag(key, payload, sequence, sender)):
        raise ControlRecordRejected(f"control record {sequence} from rank {sender} failed its authentication "
                                    "(forged, replayed, or the ranks were given different internal tokens)")
    return pickle.loads(payload)  # noqa: S301 - authenticated above: only a rank holding the key made it


def _tag(key: Optional[bytes], payload: bytes, sequence: int, sender: int) -> bytes:
    if key is None:  # loopback only (see control_key): integrity against accidents, not an attacker
        return hashlib.sha256(struct.pack(">QI", sequence, sender) + payload).digest()
    return hmac.new(key, struct.pack(">QI", sequence, sender) + payload, hashlib.sha256).digest()
