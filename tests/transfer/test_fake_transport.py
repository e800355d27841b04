"""FakeTransport keeps the transport contract: rows copied on completion, knobs for failure and hangs."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.transport import TransferError, TransferState

LAYOUT = dict(group_size=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def canonical_pool(num_blocks: int, fill: bool) -> torch.Tensor:
    layout = KVPoolLayout(num_blocks=num_blocks, **LAYOUT)
    pool = layout.allocate("cpu")
    if fill:  # every page distinct: page b holds b * 1000 + element index
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape) % 1000
                   + torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1, 1, 1) * 1000)
    return layout.canonical_view(pool)


@pytest.fixture
def pair():
    """(decode transport, its view, prefill transport, its view, peer key on decode)."""
    fabric = FakeFabric()
    prefill_view, decode_view = canonical_pool(16, fill=True), canonical_pool(12, fill=False)
    prefill = FakeTransport(prefill_view, "prefill-0", fabric)
    decode = FakeTransport(decode_view, "decode-0", fabric)
    key = decode.connect(prefill.local_peer_info("engine-p", "epoch-1"))
    return decode, decode_view, prefill, prefill_view, key


def test_read_copies_remote_rows_into_the_chosen_local_rows_only(pair):
    decode, decode_view, _, prefill_view, key = pair
    handle = decode.start_read(key, [3, 7, 1], [15, 2, 9], b"req-1")
    assert decode.poll(handle) is TransferState.DONE
    for local_id, remote_id in [(3, 15), (7, 2), (1, 9)]:
        assert torch.equal(decode_view[local_id], prefill_view[remote_id])
    untouched = [b for b in range(12) if b not in (1, 3, 7)]
    assert not decode_view[untouched].any()
    assert handle.num_blocks == 3 and handle.num_bytes == 3 * decode.page_bytes


def test_notification_reaches_the_peer_only_when_the_read_completes(pair):
    decode, _, prefill, _, key = pair
    handle = decode.start_read(key, [1], [2], b"req-1:done")
    assert prefill.poll_notifications() == []
    decode.poll(handle)
    assert prefill.poll_notifications() == [b"req-1:done"]
    assert prefill.poll_notifications() == []


def test_held_read_stays_pending_with_local_pages_untouched(pair):
    decode, decode_view, prefill, _, key = pair
    decode.hold_reads = True
    handle = decode.start_read(key, [1], [2], b"n")
    assert decode.poll(handle) is TransferState.PENDING
    assert not decode_view[1].any()
    assert prefill.poll_notifications() == []
    decode.hold_reads = False
    assert decode.poll(handle) is TransferState.DONE


def test_failed_read_copies_nothing_and_sends_no_notification(pair):
    decode, decode_view, prefill, _, key = pair
    decode.fail_reads = True
    handle = decode.start_read(key, [1, 2], [3, 4], b"n")
    assert decode.poll(handle) is TransferState.FAILED
    assert handle.error == "injected failure"
    assert not decode_view.any()
    assert prefill.poll_notifications() == []
    decode.fail_reads = False
    assert decode.poll(handle) is TransferState.FAILED  # final


def test_release_of_an_uncancellable_pending_read_keeps_the_handle(pair):
    decode, _, _, _, key = pair
    decode.hold_reads, decode.cancellable = True, False
    handle = decode.start_read(key, [1], [2], b"n")
    assert decode.release(handle) is False
    assert decode.num_unreleased_handles == 1
    decode.cancellable = True
    assert decode.release(handle) is True
    assert handle.state is TransferState.FAILED and handle.error == "cancelled by release"
    assert decode.num_unreleased_handles == 0
    assert decode.release(handle) is True  # idempotent


def test_read_from_a_killed_peer_fails_and_messages_raise():
    fabric = FakeFabric()
    prefill = FakeTransport(canonical_pool(4, fill=True), "p", fabric)
    decode = FakeTransport(canonical_pool(4, fill=False), "d", fabric)
    key = decode.connect(prefill.local_peer_info("engine-p", "e1"))
    handle = decode.start_read(key, [1], [2], b"n")
    fabric.kill("p")
    assert decode.poll(handle) is TransferState.FAILED
    assert "gone" in handle.error
    with pytest.raises(TransferError, match="gone"):
        decode.send_message(key, b"free")
    with pytest.raises(TransferError, match="not reachable"):
        decode.connect(prefill.local_peer_info("engine-p", "e2"))


def test_send_message_reaches_the_peer_without_a_read(pair):
    decode, _, prefill, _, key = pair
    decode.send_message(key, b"req-9:free")
    assert prefill.poll_notifications() == [b"req-9:free"]


def test_empty_read_is_done_at_once_and_only_notifies(pair):
    decode, _, prefill, _, key = pair
    handle = decode.start_read(key, [], [], b"req-2:prefix-hit")
    assert handle.state is TransferState.DONE
    assert prefill.poll_notifications() == [b"req-2:prefix-hit"]
    assert decode.num_unreleased_handles == 0


def test_connect_is_idempotent_and_a_new_epoch_replaces_the_old_peer():
    fabric = FakeFabric()
    decode = FakeTransport(canonical_pool(4, fill=False), "d", fabric)
    old = FakeTransport(canonical_pool(4, fill=True), "p", fabric)
    first = decode.connect(old.local_peer_info("engine-p", "e1"))
    assert decode.connect(old.local_peer_info("engine-p", "e1")) == first
    old.close()
    restarted = FakeTransport(canonical_pool(4, fill=True), "p", fabric)
    second = decode.connect(restarted.local_peer_info("engine-p", "e2"))
    assert second != first
    with pytest.raises(TransferError, match="unknown peer"):
        decode.start_read(first, [1], [1], b"")


def test_connect_rejects_a_peer_with_another_page_size():
    fabric = FakeFabric()
    decode = FakeTransport(canonical_pool(4, fill=False), "d", fabric)
    other = FakeTransport(torch.zeros(4, 64, dtype=torch.int8), "p", fabric)
    with pytest.raises(TransferError, match="pages of 64 bytes"):
        decode.connect(other.local_peer_info("engine-p", "e1"))


@pytest.mark.parametrize("local_ids, remote_ids", [([12], [1]), ([1], [16]), ([-1], [1]), ([1, 2], [1])])
def test_start_read_rejects_out_of_range_or_mismatched_ids(pair, local_ids, remote_ids):
    decode, _, _, _, key = pair
    with pytest.raises(ValueError):
        decode.start_read(key, local_ids, remote_ids, b"")


def test_a_peer_reached_through_another_address_never_displaces_a_connected_one():
    """Issue 36 item 3: a record naming a connected engine, learnt through another handshake
    address, gets its own connection; the one made through the first address stays."""
    import dataclasses

    fabric = FakeFabric()
    decode = FakeTransport(canonical_pool(4, fill=False), "decode-0", fabric)
    genuine = FakeTransport(canonical_pool(4, fill=True), "prefill-0", fabric)
    impostor = FakeTransport(canonical_pool(4, fill=False), "impostor", fabric)
    first = decode.connect(dataclasses.replace(genuine.local_peer_info("engine-p", "epoch-1"), via="10.0.0.1:8100"))
    other = dataclasses.replace(impostor.local_peer_info("engine-p", "epoch-2"), via="10.0.0.66:8100")
    second = decode.connect(other)
    assert first != second
    assert decode.poll_connect(first) is TransferState.DONE and decode.poll_connect(second) is TransferState.DONE
    # The same agent name through yet another address cannot stand beside the first: refused.
    same_name = dataclasses.replace(genuine.local_peer_info("engine-x", "epoch-9"), via="10.0.0.77:8100")
    with pytest.raises(TransferError, match="which peer engine-p@epoch-1@10.0.0.1:8100 uses"):
        decode.begin_connect(same_name)
    assert decode.poll_connect(first) is TransferState.DONE
    # Through the same address a new epoch is a restart: it replaces the old connection.
    restarted = decode.connect(dataclasses.replace(genuine.local_peer_info("engine-p", "epoch-3"), via="10.0.0.1:8100"))
    assert decode.poll_connect(restarted) is TransferState.DONE and decode.poll_connect(first) is TransferState.FAILED
