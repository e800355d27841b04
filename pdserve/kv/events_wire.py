"""Wire format of the KV event stream (`GET /internal/kv/events`): one JSON object per line.

    {"type": "snapshot",  "epoch": E, "seq": S, "block_size": 16,
     "blocks": [[hash, parent | null, group], ...]}              the whole cache as of event S
    {"type": "events",    "epoch": E,
     "events": [[seq, "stored", hash, parent | null, group, num_tokens],
                [seq, "removed", hash, null, group, 0],
                [seq, "cleared", null, null, 0, 0]]}              consecutive seqs, oldest first
    {"type": "heartbeat", "epoch": E, "seq": S}                  nothing new up to S

A block held by an offload tier rather than the device pool carries one more
element, its medium ("cpu" or "disk"), at the end of its snapshot entry or event row;
device blocks carry none, so readers that predate tiers read every line as
before (they take a tier block for a device one: a routing estimate, never a
correctness matter).

Hashes are hex. A snapshot replaces whatever the reader knew of the worker
(it starts every stream and follows any resync); after it, each event's seq
is exactly one more than the last one read, or the reader lost events and
must reconnect. Encoder and decoder live side by side so they cannot drift.
Torch-free: the proxy imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pdserve.kv.events import CachedBlock, KVEvent, KVEventKind, KVSnapshot

SNAPSHOT = "snapshot"
EVENTS = "events"
HEARTBEAT = "heartbeat"


class KVWireError(ValueError):
    """A line of the event stream that does not follow the format."""


@dataclass(slots=True)
class StreamMessage:
    type: str
    epoch: str
    seq: int  # snapshot: its seq; events: the last event's; heartbeat: the last event sent
    block_size: int = 0  # snapshots only
    blocks: list[CachedBlock] = field(default_factory=list)  # snapshots only
    events: list[KVEvent] = field(default_factory=list)  # events only


def _hex(value: Optional[bytes]) -> Optional[str]:
    return None if value is None else value.hex()


def _medium(medium: Optional[str]) -> list[str]:
    return [] if medium is None else [medium]


def _line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


def encode_snapshot(epoch: str, snapshot: KVSnapshot, block_size: int) -> bytes:
    blocks = [[b.block_hash.hex(), _hex(b.parent_hash), b.group_id] + _medium(b.medium) for b in snapshot.blocks]
    return _line({"type": SNAPSHOT, "epoch": epoch, "seq": snapshot.seq, "block_size": block_size, "blocks": blocks})


def encode_events(epoch: str, events: Sequence[KVEvent], block_size: int) -> bytes:
    rows = [[e.seq, e.kind.value, _hex(e.block_hash), _hex(e.parent_hash), e.group_id,
             block_size if e.kind is KVEventKind.STORED else 0] + _medium(e.medium) for e in events]
    return _line({"type": EVENTS, "epoch": epoch, "events": rows})


def encode_heartbeat(epoch: str, seq: int) -> bytes:
    return _line({"type": HEARTBEAT, "epoch": epoch, "seq": seq})


def decode_line(line: bytes) -> StreamMessage:
    """One line -> a message; `KVWireError` when it is not one."""
    try:
        document = json.loads(line)
        kind, epoch = document["type"], str(document["epoch"])
        if kind == SNAPSHOT:
            blocks = [CachedBlock(bytes.fromhex(entry[0]), bytes.fromhex(entry[1]) if entry[1] else None,
                                  int(entry[2]), _decode_medium(entry, 3)) for entry in document["blocks"]]
            return StreamMessage(SNAPSHOT, epoch, int(document["seq"]), int(document["block_size"]), blocks)
        if kind == EVENTS:
            events = [_decode_event(row) for row in document["events"]]
            if not events:
                raise KVWireError("an events line without events")
            return StreamMessage(EVENTS, epoch, events[-1].seq, events=events)
        if kind == HEARTBEAT:
            return StreamMessage(HEARTBEAT, epoch, int(document["seq"]))
    except KVWireError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise KVWireError(f"malformed KV event line: {exc}") from None
    raise KVWireError(f"unknown KV event line type {kind!r}")


def _decode_event(row: list[Any]) -> KVEvent:
    seq, kind, block_hash, parent, group = row[:5]
    return KVEvent(int(seq), KVEventKind(kind), bytes.fromhex(block_hash) if block_hash else None,
                   bytes.fromhex(parent) if parent else None, int(group), _decode_medium(row, 6))


def _decode_medium(entry: list[Any], index: int) -> Optional[str]:
    return str(entry[index]) if len(entry) > index and entry[index] is not None else None
