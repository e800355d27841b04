"""Peer pulls between workers of different TP sizes, over the fake transport: the holder pins on its rank 0
and the pin's block ids name every rank's slice (the ranks page the same ids); each puller rank reads
its KV heads of those blocks from the holder rank holding them, the holder hears "done" once, after
every rank's share landed, and a READ one rank failed is recomputed with the holder's pin freed.

    2 KV heads, SLAB bytes each; a holder page b holds head h as bytes 2*b + h:
      TP=2 holder   rank 0 page b = [2b]         rank 1 page b = [2b+1]
      TP=1 puller   page b' = [2b | 2b+1]        (and the other way round: rank r of 2 gets [2b+r])"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from pdserve.api.config import SchedulerConfig
from pdserve.api.kv_transfer import PROTOCOL_VERSION, AgentInfo, PoolGeometry
from pdserve.api.sampling import SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.head_split import rank_kv_heads
from pdserve.kv.manager import KVCacheManager
from pdserve.metrics import Metrics
from pdserve.pd.handshake import groups_to_wire
from pdserve.pd.leases import LeaseTable
from pdserve.pd.peer_pins import pin_peer_prefix
from pdserve.pd.peer_pull import PeerPullConnector
from pdserve.pd.peers import PeerConnections
from pdserve.pd.prefill import PrefillConnector, PrefillIdentity
from pdserve.request import RequestStatus
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.ranked_transport import FollowerTransport, RankedTransport, RankReader
from pdserve.transfer.transport import PeerInfo
from tests.engine.checked_scheduler import CheckedScheduler
from tests.pd.pd_pair import BLOCK, FakeClock, make_request
from tests.pd.test_peer_pull import FULL, source_from
from tests.transfer.test_ranked_transport import Clock, InProcessLink

HEADS = 2
SLAB = 16  # bytes of one KV head of a block (its layer slots, K and V)
NUM_BLOCKS = 64  # head values 2*b + h stay within int8


@dataclasses.dataclass
class RankedSide:
    """A prefill worker of `size` ranks: rank 0's KV manager, pin table and scheduler, one pool slice per
    rank (the same block ids, each its own heads); as a puller, a peer-pull connector around its own."""

    name: str
    size: int
    views: list[torch.Tensor]
    fakes: list[FakeTransport]
    transport: RankedTransport
    kv: KVCacheManager
    connector: PrefillConnector
    scheduler: CheckedScheduler
    peers: Optional[PeerConnections] = None
    puller: Optional[PeerPullConnector] = None
    counts: dict = dataclasses.field(default_factory=dict)

    def agent_info(self) -> AgentInfo:
        return AgentInfo(
            protocol_version=PROTOCOL_VERSION, compat_hash="h", engine_id=self.name, epoch="epoch-1",
            geometry=PoolGeometry(num_blocks=NUM_BLOCKS, page_bytes=self.transport.page_bytes, block_size=BLOCK,
                                  group_size=FULL.group_size, groups=groups_to_wire(FULL)),
            transport=self.transport.local_peer_info(self.name, "epoch-1").to_dict(), tp_size=self.size)

    def fill(self, block_id: int) -> None:
        for rank, view in enumerate(self.views):
            first, count = rank_kv_heads(HEADS, self.size, rank)
            for offset in range(count):
                view[block_id].view(-1, SLAB)[offset] = 2 * block_id + first + offset

    def heads(self, block_id: int) -> list[set[int]]:
        """Per global KV head, the byte values of its slab in `block_id` (on the rank that holds it)."""
        found = []
        for head in range(HEADS):
            for rank, view in enumerate(self.views):
                first, count = rank_kv_heads(HEADS, self.size, rank)
                if first <= head < first + count:
                    found.append(set(view[block_id].view(-1, SLAB)[head - first].tolist()))
                    break
        return found

    def connect(self, holder: "RankedSide") -> None:
        outcome: list = []
        peer = dataclasses.replace(PeerInfo.from_dict(holder.agent_info().transport, via="127.0.0.1:1"),
                                   block_size=BLOCK)  # as the admission sets it from the handshake
        self.peers.ensure(peer, outcome.append)
        self.peers.poll()
        assert outcome == [None]

    def tick(self) -> None:
        self.scheduler.apply_kv_events((self.puller or self.connector).poll())

    def _count(self, result: str, num_tokens: int) -> None:
        self.counts[result] = self.counts.get(result, 0) + num_tokens


def ranked_side(fabric: FakeFabric, clock: FakeClock, name: str, size: int, pulls: bool = False) -> RankedSide:
    views = [torch.zeros(NUM_BLOCKS, rank_kv_heads(HEADS, size, rank)[1] * SLAB, dtype=torch.int8)
             for rank in range(size)]
    fakes = [FakeTransport(view, f"{name}-rank{rank}", fabric) for rank, view in enumerate(views)]
    followers = [FollowerTransport(RankReader(fakes[rank], rank, size, HEADS, FULL.group_size))
                 for rank in range(1, size)]
    transport = RankedTransport(fakes[0], InProcessLink(followers) if followers else None,
                                [follower.descriptor() for follower in followers], HEADS, FULL.group_size,
                                clock=Clock())
    kv = KVCacheManager(FULL, NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
    connector = PrefillConnector(transport, LeaseTable(30.0, clock=clock),
                                 PrefillIdentity(name, "epoch-1", "127.0.0.1", 1, size), FULL, BLOCK,
                                 Metrics().transfer)
    side = RankedSide(name, size, views, fakes, transport, kv, connector, None)  # type: ignore[arg-type]
    if pulls:
        side.peers = PeerConnections(transport, connect_timeout_s=5.0, clock=clock)
        side.puller = PeerPullConnector(connector, transport, side.peers, FULL, BLOCK, count_tokens=side._count,
                                        clock=clock, lease_s=30.0, tp_size=size)
    side.scheduler = CheckedScheduler(SchedulerConfig(), kv, BLOCK, 10_000, connector=side.puller or connector)
    return side


def compute_on(side: RankedSide, request_id: str, num_prompt: int) -> list[int]:
    """The holder computes a prompt (every rank writes its heads of each page) and caches its full blocks."""
    request = make_request(request_id, num_prompt, sampling=SamplingParams(max_tokens=1, temperature=0))
    side.scheduler.add_request(request)
    step = side.scheduler.schedule()
    for table in step.chunks[0].block_ids:
        for block_id in table:
            side.fill(block_id)
    side.scheduler.update(step, [SampledToken(request_id, 5, 0.0)])
    return request.prompt_token_ids


def pair(holder_ranks: int, puller_ranks: int) -> tuple[FakeClock, RankedSide, RankedSide]:
    fabric, clock = FakeFabric(), FakeClock()
    holder = ranked_side(fabric, clock, "A", holder_ranks)
    puller = ranked_side(fabric, clock, "B", puller_ranks, pulls=True)
    puller.connect(holder)
    return clock, holder, puller


@pytest.mark.parametrize("holder_ranks, puller_ranks", [(2, 1), (1, 2)])
def test_each_puller_rank_reads_its_heads_of_the_pinned_blocks_from_the_holder_rank_holding_them(
        holder_ranks, puller_ranks):
    clock, holder, puller = pair(holder_ranks, puller_ranks)
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    assert holder.connector.num_pinned_blocks == 4 * len(FULL.groups)  # one pin, on rank 0, for every slice
    request = make_request("b", 6 * BLOCK + 2, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    puller.tick()  # every rank's READ landed
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 4 * BLOCK
    for ours, theirs in zip(puller.kv.block_ids("b"), ticket.block_ids):
        for local, remote in zip(ours[:4], theirs):
            assert puller.heads(local) == [{2 * remote + head} for head in range(HEADS)], (local, remote)
        assert all(puller.heads(local) == [{0}] * HEADS for local in ours[4:])  # the rest is computed here
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == 4 * BLOCK and len(step.chunks[0].token_ids) == 2 * BLOCK + 2
    puller.scheduler.update(step, [SampledToken("b", 5, 0.0)])
    assert puller.counts == {"pulled": 4 * BLOCK} and not request.pd_recomputed
    holder.tick()  # "done", sent by the puller's rank 0 once every rank landed, to the holder's rank 0
    assert holder.connector.num_pinned_blocks == 0 and not holder.kv.has_request(ticket.pin_id)
    holder.kv.check_invariants()
    puller.kv.check_invariants()


@pytest.mark.parametrize("holder_ranks, puller_ranks", [(2, 1), (1, 2)])
def test_a_read_one_rank_failed_recomputes_the_prompt_and_frees_the_holders_pin(holder_ranks, puller_ranks):
    clock, holder, puller = pair(holder_ranks, puller_ranks)
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    request = make_request("b", 5 * BLOCK, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    puller.fakes[-1].fail_reads = True  # the last rank's share (all of it at TP=1) never lands
    puller.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == 0 and len(step.chunks[0].token_ids) == 5 * BLOCK
    assert puller.counts == {"failed": 4 * BLOCK}
    holder.tick()  # the puller's "free"
    assert holder.connector.num_pinned_blocks == 0 and not holder.kv.has_request(ticket.pin_id)
    holder.kv.check_invariants()
