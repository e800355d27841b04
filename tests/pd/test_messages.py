"""D's notes to P over the transport: `kind:nonce:request id`, parsed strictly."""

from __future__ import annotations

import pytest

from pdserve.pd.messages import MAX_MESSAGE_BYTES, KVMessage, MessageKind, parse_message

NONCE = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("kind", list(MessageKind))
def test_a_message_survives_its_round_trip_even_with_colons_in_the_request_id(kind):
    message = KVMessage(kind, "chat:42#1", NONCE)
    assert parse_message(message.encode()) == message


@pytest.mark.parametrize("payload", [
    b"done:r1",  # version 1's form: no nonce
    b"done:" + NONCE.encode() + b":",  # no request id
    b"done:NOT-HEX-NONCE-0123456789:r1",
    b"done:abc:r1",  # too short to be a pin's nonce
    b"steal:" + NONCE.encode() + b":r1",
    b"\xff\xfe",
    b"free:" + NONCE.encode() + b":" + b"r" * MAX_MESSAGE_BYTES,
])
def test_anything_else_parses_to_nothing(payload):
    assert parse_message(payload) is None
