"""RankedTransport: rank 0 of a tensor-parallel worker drives every rank's slice; a read is DONE,
and its notification reaches the prefill worker, only once every rank's slice has landed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.ranked_transport import (
    FollowerTransport, RankedTransport, decode_ranks, encode_ranks, rank_descriptor)
from pdserve.transfer.transport import PeerInfo, TransferError, TransferState

NUM_RANKS = 2
NUM_BLOCKS, PAGE_BYTES = 8, 16


class InProcessLink:
    """The rank channel with the followers in this process: commands applied, reports returned at once."""

    def __init__(self, followers: list[FollowerTransport]):
        self.followers = followers
        self.queued: list[Any] = []
        self.messages = 0

    def queue(self, command: Any) -> None:
        self.queued.append(command)

    @property
    def has_queued(self) -> bool:
        return bool(self.queued)

    def send(self, step: Any = None, decode_step: bool = False, logit_rows: tuple = (),
             want_report: bool = False) -> list[Any]:
        commands, self.queued = tuple(self.queued), []
        self.messages += 1
        for follower in self.followers:
            follower.apply(commands)
        return [follower.report() for follower in self.followers] if want_report else []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading is a new moment: reports are never reused
        return self.now


def ranked_worker(fabric: FakeFabric, name: str, fill: bool) -> tuple[RankedTransport, list[FakeTransport], list]:
    """A worker of NUM_RANKS ranks: (rank 0's transport, every rank's fake transport, every rank's pool view)."""
    views = []
    for rank in range(NUM_RANKS):
        view = torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.int8)
        if fill:
            view.copy_((torch.arange(NUM_BLOCKS * PAGE_BYTES).view(NUM_BLOCKS, PAGE_BYTES) + 7 * rank) % 100)
        views.append(view)
    locals_ = [FakeTransport(view, f"{name}-rank{rank}", fabric) for rank, view in enumerate(views)]
    followers = [FollowerTransport(transport, rank) for rank, transport in enumerate(locals_) if rank]
    ranked = RankedTransport(locals_[0], InProcessLink(followers), [f.descriptor() for f in followers], clock=Clock())
    return ranked, locals_, views


@pytest.fixture
def pair():
    fabric = FakeFabric()
    prefill, prefill_locals, prefill_views = ranked_worker(fabric, "prefill", fill=True)
    decode, decode_locals, decode_views = ranked_worker(fabric, "decode", fill=False)
    peer = PeerInfo.from_dict(prefill.local_peer_info("engine-p", "epoch-1").to_dict())  # as the handshake carries it
    key = decode.begin_connect(peer)
    assert decode.poll_connect(key) is TransferState.DONE
    return decode, decode_locals, decode_views, prefill, prefill_views, key


def test_each_rank_reads_its_own_slice_from_the_same_rank_of_the_peer(pair):
    decode, _, decode_views, _, prefill_views, key = pair
    handle = decode.start_read(key, [3, 5], [6, 1], b"")
    assert decode.poll(handle) is TransferState.DONE
    for rank in range(NUM_RANKS):
        assert torch.equal(decode_views[rank][3], prefill_views[rank][6])
        assert torch.equal(decode_views[rank][5], prefill_views[rank][1])
    assert not torch.equal(decode_views[0][3], decode_views[1][3])  # the slices differ: no rank read another's
    assert handle.num_bytes == 2 * PAGE_BYTES * NUM_RANKS


def test_the_notification_is_sent_once_and_only_after_every_rank_landed(pair):
    decode, decode_locals, _, prefill, _, key = pair
    decode_locals[1].hold_reads = True  # rank 1's slice is still on its way
    handle = decode.start_read(key, [2], [4], b"req-1:done")
    assert decode.poll(handle) is TransferState.PENDING
    assert prefill.poll_notifications() == []  # rank 0 landed, but P must not release yet
    decode_locals[1].hold_reads = False
    assert decode.poll(handle) is TransferState.DONE
    assert decode.poll(handle) is TransferState.DONE
    assert prefill.poll_notifications() == [b"req-1:done"]
    assert decode.release(handle)
    assert all(transport.num_unreleased_handles == 0 for transport in decode_locals)


def test_one_rank_failing_fails_the_read_and_its_pages_are_kept_until_every_rank_let_go(pair):
    decode, decode_locals, _, prefill, _, key = pair
    decode_locals[1].fail_reads = True
    decode_locals[0].hold_reads = True
    decode_locals[0].cancellable = False
    handle = decode.start_read(key, [2], [4], b"req-2:done")
    assert decode.poll(handle) is TransferState.FAILED
    assert "rank 1" in handle.error
    assert not decode.release(handle)  # rank 0's read is still in flight: its pages may still be written
    decode_locals[0].hold_reads = False
    decode_locals[0].cancellable = True
    assert decode.release(handle)
    assert prefill.poll_notifications() == []  # a failed read never tells P it landed
    assert all(transport.num_unreleased_handles == 0 for transport in decode_locals)


def test_a_follower_that_cannot_reach_its_peer_fails_the_connection_and_says_which_rank(pair):
    decode, _, _, prefill, _, _ = pair
    fabric = FakeFabric()
    lonely, _, _ = ranked_worker(fabric, "other-decode", fill=False)
    other_prefill, other_locals, _ = ranked_worker(fabric, "other-prefill", fill=True)
    fabric.kill(other_locals[1].agent_name)  # rank 1 of the peer is gone
    key = lonely.begin_connect(other_prefill.local_peer_info("engine-q", "epoch-9"))
    assert lonely.poll_connect(key) is TransferState.FAILED
    assert "rank 1" in lonely.connect_failure(key)


def test_a_peer_with_another_rank_count_or_no_rank_list_is_refused():
    info = PeerInfo("e", "x", "agent", b"not json", "DRAM", 0, 0, NUM_BLOCKS, PAGE_BYTES)
    with pytest.raises(TransferError, match="does not describe its tensor-parallel ranks"):
        decode_ranks(info, 2)
    one_rank = dataclasses.replace(info, agent_metadata=encode_ranks([rank_descriptor(info)]))
    with pytest.raises(TransferError, match="has 1 tensor-parallel ranks, this worker 2"):
        decode_ranks(one_rank, 2)
    forged = dataclasses.replace(info, agent_metadata=encode_ranks([{"agent_name": "a"}, {"agent_name": "b"}]))
    with pytest.raises(TransferError):
        decode_ranks(forged, 2)
    assert [peer.agent_name for peer in decode_ranks(dataclasses.replace(
        info, agent_metadata=encode_ranks([rank_descriptor(info)] * 2)), 2)] == ["agent", "agent"]
