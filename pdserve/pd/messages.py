"""The small messages a decode worker sends a prefill worker over the transport.

`done:<nonce>:<id>` rides on the READ itself (NIXL delivers it once the data
landed), `free:<nonce>:<id>` releases blocks D will not read, `renew:<nonce>:<id>`
extends a lease while the request waits in D's queue. The nonce is the pin's
(`remote_pin_nonce` in kv_transfer_params): P honours a message only when it
matches the live pin of that id. Torch-free; unknown or malformed messages
parse to None and are ignored by the receiver.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional

from pdserve.api.kv_transfer import PIN_NONCE_PATTERN


class MessageKind(enum.Enum):
    """What a message tells P about a pin; the value is its word on the wire."""

    DONE = "done"  # the READ landed: release the pin
    FREE = "free"  # D will not read (aborted, recomputed): release the pin
    RENEW = "renew"  # D still means to read: extend the lease


_WORDS = {kind.value: kind for kind in MessageKind}
MAX_MESSAGE_BYTES = 512
_NONCE = re.compile(PIN_NONCE_PATTERN)


@dataclass(frozen=True, slots=True)
class KVMessage:
    kind: MessageKind
    request_id: str
    nonce: str  # the pin's, from kv_transfer_params

    def encode(self) -> bytes:
        return f"{self.kind.value}:{self.nonce}:{self.request_id}".encode()


def parse_message(payload: bytes) -> Optional[KVMessage]:
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    kind, sep, rest = text.partition(":")
    nonce, sep_2, request_id = rest.partition(":")
    if not sep or not sep_2 or kind not in _WORDS or not request_id or _NONCE.fullmatch(nonce) is None:
        return None
    return KVMessage(_WORDS[kind], request_id, nonce)
