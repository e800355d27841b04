"""RankedTransport: each decode rank reads its KV heads from the prefill ranks that hold them,
whatever the two TP sizes (one descriptor per block and source rank); a read is DONE, and its
notification reaches the prefill worker, only once every rank's share has landed."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from pdserve.kv.head_split import head_sources, rank_kv_heads
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.planner import HandoffSide, plan_pull
from pdserve.transfer.ranked_transport import (
    FollowerTransport, RankedTransport, RankReader, decode_ranks, encode_ranks, rank_descriptor)
from pdserve.transfer.transport import PeerInfo, TransferError, TransferState

NUM_BLOCKS, SLAB_BYTES = 8, 16  # a head's share of a page


class InProcessLink:
    """The rank channel with the followers in this process: commands applied, reports returned at once."""

    def __init__(self, followers: list[FollowerTransport]):
        self.followers = followers
        self.queued: list[Any] = []

    def queue(self, command: Any) -> None:
        self.queued.append(command)

    @property
    def has_queued(self) -> bool:
        return bool(self.queued)

    def send(self, step: Any = None, decode_step: bool = False, logit_rows: tuple = (),
             want_report: bool = False) -> list[Any]:
        commands, self.queued = tuple(self.queued), []
        for follower in self.followers:
            follower.apply(commands)
        return [follower.report() for follower in self.followers] if want_report else []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading is a new moment: reports are never reused
        return self.now


@dataclasses.dataclass
class Worker:
    transport: RankedTransport
    fakes: list[FakeTransport]
    views: list[torch.Tensor]  # per rank: int8 [blocks, heads * SLAB_BYTES]
    heads: int
    size: int

    def slab(self, head: int, block: int) -> torch.Tensor:
        """Global KV head `head` of `block` on the first rank that holds it."""
        for rank in range(self.size):
            first, count = rank_kv_heads(self.heads, self.size, rank)
            if first <= head < first + count:
                return self.views[rank][block].view(-1, SLAB_BYTES)[head - first]
        raise AssertionError(head)


def worker(fabric: FakeFabric, name: str, heads: int, size: int, fill: bool, slab_bytes: int = SLAB_BYTES) -> Worker:
    """A worker of `size` ranks whose pages hold global head h of block b as bytes 10*b + h (when filled)."""
    views = []
    for rank in range(size):
        first, count = rank_kv_heads(heads, size, rank)
        view = torch.zeros(NUM_BLOCKS, count * slab_bytes, dtype=torch.int8)
        if fill:
            for block in range(NUM_BLOCKS):
                for offset in range(count):
                    view[block].view(-1, slab_bytes)[offset] = 10 * block + first + offset
        views.append(view)
    fakes = [FakeTransport(view, f"{name}-rank{rank}", fabric) for rank, view in enumerate(views)]
    followers = [FollowerTransport(RankReader(fakes[rank], rank, size, heads, 1)) for rank in range(1, size)]
    link = InProcessLink(followers) if followers else None
    ranked = RankedTransport(fakes[0], link, [follower.descriptor() for follower in followers], heads, 1, clock=Clock())
    return Worker(ranked, fakes, views, heads, size)


def connect(decode: Worker, prefill: Worker) -> str:
    peer = PeerInfo.from_dict(prefill.transport.local_peer_info("engine-p", "epoch-1").to_dict())  # as sent
    key = decode.transport.begin_connect(peer)
    assert decode.transport.poll_connect(key) is TransferState.DONE
    return key


@pytest.mark.parametrize("heads, prefill_size, decode_size", [
    (4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 4, 1), (2, 4, 1), (2, 1, 4), (2, 4, 2), (4, 2, 4)])
def test_every_decode_rank_gets_each_of_its_heads_from_a_prefill_rank_that_holds_it(heads, prefill_size, decode_size):
    fabric = FakeFabric()
    prefill = worker(fabric, "prefill", heads, prefill_size, fill=True)
    decode = worker(fabric, "decode", heads, decode_size, fill=False)
    key = connect(decode, prefill)
    handle = decode.transport.start_read(key, [3, 5], [6, 1], b"")
    assert decode.transport.poll(handle) is TransferState.DONE
    for rank in range(decode_size):
        first, count = rank_kv_heads(heads, decode_size, rank)
        for local, remote in ((3, 6), (5, 1)):
            slabs = decode.views[rank][local].view(-1, SLAB_BYTES)
            for offset in range(count):
                assert torch.all(slabs[offset] == 10 * remote + first + offset), (rank, local, offset)
        assert torch.count_nonzero(decode.views[rank][[0, 1, 2, 4, 6, 7]]) == 0  # no other page touched
    # One descriptor per block and source rank: replicas are read once, never from every holder.
    sources = sum(len(head_sources(heads, decode_size, rank, prefill_size)) for rank in range(decode_size))
    assert sources == max(decode_size, min(prefill_size, heads))


def test_the_notification_is_sent_once_and_only_after_every_rank_landed():
    fabric = FakeFabric()
    prefill = worker(fabric, "prefill", 4, 2, fill=True)
    decode = worker(fabric, "decode", 4, 2, fill=False)
    key = connect(decode, prefill)
    decode.fakes[1].hold_reads = True  # rank 1's share is still on its way
    handle = decode.transport.start_read(key, [2], [4], b"req-1:done")
    assert decode.transport.poll(handle) is TransferState.PENDING
    assert prefill.transport.poll_notifications() == []  # rank 0 landed, but P must not release yet
    decode.fakes[1].hold_reads = False
    assert decode.transport.poll(handle) is TransferState.DONE
    assert decode.transport.poll(handle) is TransferState.DONE
    assert prefill.transport.poll_notifications() == [b"req-1:done"]
    assert decode.transport.release(handle)
    assert all(fake.num_unreleased_handles == 0 for fake in decode.fakes)


def test_one_rank_failing_fails_the_read_and_its_pages_are_kept_until_every_rank_let_go():
    fabric = FakeFabric()
    prefill = worker(fabric, "prefill", 4, 2, fill=True)
    decode = worker(fabric, "decode", 4, 2, fill=False)
    key = connect(decode, prefill)
    decode.fakes[1].fail_reads = True
    decode.fakes[0].hold_reads, decode.fakes[0].cancellable = True, False
    handle = decode.transport.start_read(key, [2], [4], b"req-2:done")
    assert decode.transport.poll(handle) is TransferState.FAILED
    assert "rank 1" in handle.error
    assert not decode.transport.release(handle)  # rank 0's read is in flight: its pages may still be written
    decode.fakes[0].cancellable = True
    assert decode.transport.release(handle)
    assert prefill.transport.poll_notifications() == []  # a failed read never tells P it landed
    assert all(fake.num_unreleased_handles == 0 for fake in decode.fakes)


def test_a_follower_that_cannot_reach_its_source_fails_the_connection_and_says_which_rank():
    fabric = FakeFabric()
    prefill = worker(fabric, "prefill", 4, 2, fill=True)
    decode = worker(fabric, "decode", 4, 2, fill=False)
    fabric.kill(prefill.fakes[1].agent_name)  # prefill rank 1 is gone: decode rank 1 reads from it
    peer = prefill.transport.local_peer_info("engine-q", "epoch-9")
    key = decode.transport.begin_connect(peer)
    assert decode.transport.poll_connect(key) is TransferState.FAILED
    assert "rank 1" in decode.transport.connect_failure(key)


def test_a_peer_without_a_rank_list_or_with_too_many_ranks_is_refused():
    info = PeerInfo("e", "x", "agent", b"not json", "DRAM", 0, 0, NUM_BLOCKS, SLAB_BYTES)
    with pytest.raises(TransferError, match="does not describe its tensor-parallel ranks"):
        decode_ranks(info)
    with pytest.raises(TransferError, match="lists 65 tensor-parallel ranks"):
        decode_ranks(dataclasses.replace(info, agent_metadata=encode_ranks([rank_descriptor(info)] * 65)))
    forged = dataclasses.replace(info, agent_metadata=encode_ranks([{"agent_name": "a"}, {"agent_name": "b"}]))
    with pytest.raises(TransferError):
        decode_ranks(forged)
    two = decode_ranks(dataclasses.replace(info, agent_metadata=encode_ranks([rank_descriptor(info)] * 2)))
    assert [peer.agent_name for peer in two] == ["agent", "agent"]


def token_pattern(block: int, head: int, kv: int, token: int) -> int:
    """What a prefill page holds at one (block, global head, K|V, token of the block): one byte per token."""
    return (block * 29 + head * 7 + kv * 3 + token) % 101 + 1


@pytest.mark.parametrize("prefill_block, decode_block", [(8, 16), (16, 8)])
@pytest.mark.parametrize("heads, prefill_size, decode_size", [(4, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1)])
def test_pages_of_another_block_size_land_token_for_token_in_every_rank(prefill_block, decode_block, heads,
                                                                          prefill_size, decode_size):
    """One layer slot, one byte per token: a head's slab is [K tokens][V tokens]. The pull is planned as
    the decode connector plans it (units of the smaller block), for a 32-token prompt."""
    fabric = FakeFabric()
    prefill = worker(fabric, "prefill", heads, prefill_size, fill=False, slab_bytes=2 * prefill_block)
    decode = worker(fabric, "decode", heads, decode_size, fill=False, slab_bytes=2 * decode_block)
    for rank, view in enumerate(prefill.views):
        first, count = rank_kv_heads(heads, prefill_size, rank)
        for block in range(NUM_BLOCKS):
            rows = view[block].view(count, 2, prefill_block)
            for offset, kv, token in itertools.product(range(count), range(2), range(prefill_block)):
                rows[offset, kv, token] = token_pattern(block, first + offset, kv, token)
    prefill_table = {8: [6, 1, 3, 7], 16: [5, 2]}[prefill_block]
    decode_table = {8: [4, 7, 2, 6], 16: [3, 1]}[decode_block]
    pull = plan_pull([HandoffSide(prefill_block, 0, prefill_table)], [HandoffSide(decode_block, 0, decode_table)], 32)
    key = connect(decode, prefill)
    handle = decode.transport.start_read(key, pull.local_ids, pull.remote_ids, b"")
    assert decode.transport.poll(handle) is TransferState.DONE
    assert handle.num_blocks == len(pull.local_ids) * heads * 2  # one descriptor per unit and row
    for rank, view in enumerate(decode.views):
        first, count = rank_kv_heads(heads, decode_size, rank)
        for position in range(32):
            local = view[decode_table[position // decode_block]].view(count, 2, decode_block)
            remote_block = prefill_table[position // prefill_block]
            for offset, kv in itertools.product(range(count), range(2)):
                expected = token_pattern(remote_block, first + offset, kv, position % prefill_block)
                assert local[offset, kv, position % decode_block] == expected, (rank, position, offset, kv)
        untouched = [b for b in range(NUM_BLOCKS) if b not in decode_table]
        assert torch.count_nonzero(view[untouched]) == 0


def test_state_moves_are_refused_between_equal_block_and_tp_sizes_where_state_pages_move_whole():
    from pdserve.transfer.state_ranges import StateSlotMove, StateSplit

    fabric = FakeFabric()
    move = StateSlotMove(local_page=3, local_offset_bytes=0, remote_page=6, remote_offset_bytes=0,
                         split=StateSplit((1,), (SLAB_BYTES,)))
    prefill = worker(fabric, "prefill", 2, 1, fill=True)
    decode = worker(fabric, "decode", 2, 1, fill=False)  # the same block size: state pages move whole there
    handle = decode.transport.start_read(connect(decode, prefill), [], [], b"", state_moves=[move])
    assert decode.transport.poll(handle) is TransferState.FAILED and "state moves as byte ranges" in handle.error
    assert torch.count_nonzero(decode.views[0]) == 0
