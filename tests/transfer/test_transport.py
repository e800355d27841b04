"""PeerInfo travels in the HTTP handshake: JSON-safe both ways, strict on the way in."""

from __future__ import annotations

import json

import pytest

from pdserve.transfer.transport import PeerInfo, TransferError, TransferHandle, TransferState


def peer_info(**overrides) -> PeerInfo:
    fields = dict(engine_id="prefill-a", epoch="3f2c", agent_name="prefill-a-3f2c",
                  agent_metadata=bytes(range(256)) * 3, mem_type="DRAM", device_id=0,
                  base_address=0x7F00_1234_5000, num_blocks=512, page_bytes=737_280)
    fields.update(overrides)
    return PeerInfo(**fields)


def test_peer_info_survives_a_json_round_trip_with_binary_metadata():
    info = peer_info()
    wire = json.dumps(info.to_dict())
    assert PeerInfo.from_dict(json.loads(wire)) == info


def test_peer_key_differs_between_epochs_of_one_engine():
    assert peer_info().key != peer_info(epoch="9a9a").key
    assert peer_info().key == peer_info().key


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("engine_id", "", "'engine_id' must be a non-empty string"),
        ("epoch", 7, "'epoch' must be a non-empty string"),
        ("num_blocks", True, "'num_blocks' must be a non-negative integer"),
        ("base_address", -1, "'base_address' must be a non-negative integer"),
        ("page_bytes", 0, "num_blocks and page_bytes must be >= 1"),
        ("mem_type", "HBM", "mem_type must be one of"),
        ("agent_metadata", "not base64!", "not valid base64"),
    ],
)
def test_peer_info_from_dict_rejects_malformed_fields(field, value, message):
    data = peer_info().to_dict()
    data[field] = value
    with pytest.raises(TransferError, match=message):
        PeerInfo.from_dict(data)


def test_peer_info_from_dict_rejects_missing_fields_and_non_objects():
    data = peer_info().to_dict()
    del data["agent_name"]
    with pytest.raises(TransferError, match="agent_name"):
        PeerInfo.from_dict(data)
    with pytest.raises(TransferError, match="JSON object"):
        PeerInfo.from_dict([1, 2])


def test_transfer_error_is_a_retryable_service_error():
    assert TransferError("peer gone").status_code == 503


def test_handle_age_is_measured_from_its_start():
    handle = TransferHandle(1, "p@e", num_blocks=2, num_bytes=10, started_at_s=100.0)
    assert handle.state is TransferState.PENDING
    assert handle.age_s(now_s=102.5) == 2.5
