"""The small messages a decode worker sends a prefill worker over the transport.

`done:<id>` rides on the READ itself (NIXL delivers it once the data landed),
`free:<id>` releases blocks D will not read, `renew:<id>` extends a lease while
the request waits in D's queue. Torch-free; unknown or malformed messages parse
to None and are ignored by the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

MessageKind = Literal["done", "free", "renew"]
_KINDS = ("done", "free", "renew")
MAX_MESSAGE_BYTES = 512


@dataclass(frozen=True, slots=True)
class KVMessage:
    kind: MessageKind
    request_id: str

    def encode(self) -> bytes:
        return f"{self.kind}:{self.request_id}".encode()


def parse_message(payload: bytes) -> Optional[KVMessage]:
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    kind, sep, request_id = text.partition(":")
    if not sep or kind not in _KINDS or not request_id:
        return None
    return KVMessage(kind, request_id)  # type: ignore[arg-type]
