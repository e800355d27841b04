"""The engine's end of the socket to its NIXL agent process: whole messages within a deadline, or an error.

Invariant: `receive_within` returns only a whole, unpickled message, and never waits past its
deadline: a reply cut off halfway, a closed socket, an impossible length or bytes that do not
unpickle all raise `AgentWireError` (the caller then counts the agent as dead). `send_within`
likewise never blocks past its deadline on an agent that stopped reading.

Frames are those of multiprocessing.connection.Connection, which the agent process uses as is:

    +------------------------+-----------------------------+
    | length: int32 big-end. | pickle of the message       |   length < 2**31 - 1
    +------------------------+-----------------------------+
    | -1: int32 | length: uint64 big-endian | pickle ...   |   larger messages

Torch-free and nixl-free.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from typing import Any, Callable

MAX_MESSAGE_BYTES = 1 << 30  # the agent's answers are names, states, metadata and notifications


class AgentWireError(Exception):
    """The message could not be moved whole, in time and well formed."""


def send_within(fd: int, message: Any, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Send one framed message on a non-blocking socket `fd` before `deadline_s` (on `clock`)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = struct.pack("!i", len(payload)) if len(payload) < 0x7FFFFFFF else struct.pack("!iQ", -1, len(payload))
    data = memoryview(header + payload)
    while data:
        _wait_for(fd, select.POLLOUT, deadline_s, clock, f"sending: {len(data)} bytes left")
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue
        except OSError as exc:
            raise AgentWireError(f"sending failed: {exc!r}") from None


def receive_within(fd: int, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> Any:
    """One whole message from socket `fd`, received before `deadline_s` (on `clock`)."""
    (length,) = struct.unpack("!i", _read_exactly(fd, 4, deadline_s, clock))
    if length == -1:
        (length,) = struct.unpack("!Q", _read_exactly(fd, 8, deadline_s, clock))
    if not 0 <= length <= MAX_MESSAGE_BYTES:
        raise AgentWireError(f"malformed reply: a length of {length} bytes")
    payload = _read_exactly(fd, length, deadline_s, clock)
    try:
        return pickle.loads(payload)
    except Exception as exc:  # unpickling raises many kinds
        raise AgentWireError(f"malformed reply: {exc!r}") from None


def _read_exactly(fd: int, num_bytes: int, deadline_s: float, clock: Callable[[], float]) -> bytes:
    chunks, missing = [], num_bytes
    while missing:
        _wait_for(fd, select.POLLIN, deadline_s, clock, f"reply cut off: {num_bytes - missing} of {num_bytes} bytes")
        try:
            chunk = os.read(fd, missing)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise AgentWireError(f"receiving failed: {exc!r}") from None
        if not chunk:
            raise AgentWireError(f"connection closed: {num_bytes - missing} of {num_bytes} bytes came")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _wait_for(fd: int, event: int, deadline_s: float, clock: Callable[[], float], what: str) -> None:
    poller = select.poll()
    poller.register(fd, event)
    left_s = deadline_s - clock()
    if left_s <= 0 or not poller.poll(left_s * 1000):
        raise AgentWireError(f"deadline passed ({what})")
