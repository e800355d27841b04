"""P/D of a recurrent-state model between workers of different TP sizes (and block sizes), over the
fake transport: D plans the pull from both plans (pd/geometry.py) and every D rank reads, for each
state layer, exactly the byte ranges of its heads' conv window parts and recurrent state from the P
rank(s) holding them, beside its KV heads (transfer/state_ranges.py, ranked_transport.py).

    model: 3 Gated DeltaNet layers (conv parts q 4 | k 4 | v 8 channels, window 3; recurrent 4 heads
           of 2x2; 256 bytes of state a layer in all), 1 full-attention layer (KV heads 1 or 2, dim 2)
    a rank of N holds 1/N of every conv part and of the heads, and its pages page its own share

P's pages are filled from the whole model's state and KV, cut by the sharding rule; after the pull
each D rank's slots must equal the whole state cut for it, and nothing else may be written."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pdserve.kv.head_split import rank_kv_heads
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan, RecurrentStateSpec, plan_groups
from pdserve.pd.geometry import handoff_ranges, peer_plan, plan_handoff_pull
from pdserve.pd.handshake import groups_to_wire
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.ranked_transport import FollowerTransport, RankedTransport, RankReader
from pdserve.transfer.state_ranges import StateSplit, rank_state_spec, state_splits
from pdserve.transfer.transport import PeerInfo, TransferState
from tests.transfer.test_ranked_transport import Clock, InProcessLink

WHOLE = RecurrentStateSpec("gated_delta_net", conv_channels=16, conv_window=3, recurrent_shape=(4, 2, 2),
                           conv_parts=(4, 4, 8))
HEAD_DIM = 2  # float32
NUM_BLOCKS = 8
PROMPT = 10
NUM_STATE_LAYERS = 3


def whole_state(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's state of one layer: (conv [16, 3], recurrent [4, 2, 2]), every value distinct."""
    conv = torch.arange(16 * 3, dtype=torch.float32).view(16, 3) + 1000 * (layer + 1)
    recurrent = torch.arange(16, dtype=torch.float32).view(4, 2, 2) + 1000 * (layer + 1) + 500
    return conv, recurrent


def rank_state(layer: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s slot, by the sharding rule: its share of each conv part, then of the heads."""
    conv, recurrent = whole_state(layer)
    parts, first = [], 0
    for channels in WHOLE.conv_parts:
        share = channels // size
        parts.append(conv[first + rank * share: first + (rank + 1) * share])
        first += channels
    heads = recurrent.shape[0] // size
    return torch.cat([torch.cat(parts).reshape(-1), recurrent[rank * heads:(rank + 1) * heads].reshape(-1)])


def kv_value(head: int, position: int, kv: int) -> float:
    return 1000.0 * (head + 1) + 10 * position + kv


@dataclasses.dataclass
class Worker:
    size: int
    block_size: int
    kv_heads: int
    plan: KVGroupPlan
    views: list[torch.Tensor]
    transport: RankedTransport

    @property
    def local_heads(self) -> int:
        return rank_kv_heads(self.kv_heads, self.size, 0)[1]

    @property
    def kv_page_bytes(self) -> int:
        return self.local_heads * 2 * self.block_size * HEAD_DIM * 4

    def state_slot(self, rank: int, page: int, slot: int) -> torch.Tensor:
        spec = self.plan.groups[self.plan.state_group_ids[0]].spec
        data = self.views[rank][page, slot * spec.state_bytes:(slot + 1) * spec.state_bytes]
        return data.view(torch.float32)

    def kv_row(self, rank: int, page: int, local_head: int, kv: int) -> torch.Tensor:
        """[block_size, HEAD_DIM] of one local head's K or V in one page."""
        slab = self.kv_page_bytes // self.local_heads
        row = slab // 2
        start = local_head * slab + kv * row
        return self.views[rank][page, start:start + row].view(torch.float32).view(self.block_size, HEAD_DIM)


def make_worker(fabric: FakeFabric, name: str, size: int, block_size: int, kv_heads: int) -> Worker:
    spec = rank_state_spec(WHOLE, 1, size)
    local_heads = rank_kv_heads(kv_heads, size, 0)[1]
    kv_page_bytes = local_heads * 2 * block_size * HEAD_DIM * 4
    plan = plan_groups([spec] * NUM_STATE_LAYERS + [FullAttentionSpec()], attention_layer_bytes=kv_page_bytes)
    page_bytes = plan.padded_page_bytes or kv_page_bytes
    views = [torch.zeros(NUM_BLOCKS, page_bytes, dtype=torch.int8) for _ in range(size)]
    fakes = [FakeTransport(view, f"{name}-rank{rank}", fabric) for rank, view in enumerate(views)]
    geometry = dict(block_size=block_size, kv_page_bytes=kv_page_bytes, state_splits=state_splits(plan, size))
    followers = [FollowerTransport(RankReader(fakes[rank], rank, size, kv_heads, 1, **geometry))
                 for rank in range(1, size)]
    link = InProcessLink(followers) if followers else None
    ranked = RankedTransport(fakes[0], link, [follower.descriptor() for follower in followers], kv_heads, 1,
                             clock=Clock(), **geometry)
    return Worker(size, block_size, kv_heads, plan, views, ranked)


def tables(worker: Worker, first_page: int) -> list[list[int]]:
    """Per group: the full group's blocks for the prompt, one page per state group (ids from first_page)."""
    num_blocks = math.ceil(PROMPT / worker.block_size)
    ids = iter(range(first_page, NUM_BLOCKS))
    return [[next(ids) for _ in range(num_blocks)] if not group.is_state else [next(ids)]
            for group in worker.plan.groups]


def fill_prefill(prefill: Worker, table: list[list[int]]) -> None:
    for group, ids in zip(prefill.plan.groups, table):
        for rank in range(prefill.size):
            first, count = rank_kv_heads(prefill.kv_heads, prefill.size, rank)
            if group.is_state:
                for slot, layer in enumerate(group.layer_ids):
                    prefill.state_slot(rank, ids[0], slot)[:] = rank_state(layer, rank, prefill.size)
                continue
            for index, page in enumerate(ids):
                for offset, kv, token in ((o, k, t) for o in range(count) for k in range(2)
                                          for t in range(prefill.block_size)):
                    position = index * prefill.block_size + token
                    prefill.kv_row(rank, page, offset, kv)[token] = kv_value(first + offset, position, kv)


def connect(decode: Worker, prefill: Worker) -> str:
    peer = PeerInfo.from_dict(prefill.transport.local_peer_info("engine-p", "epoch-1").to_dict())
    peer = dataclasses.replace(peer, block_size=prefill.block_size)  # as admission sets it from the handshake
    key = decode.transport.begin_connect(peer)
    assert decode.transport.poll_connect(key) is TransferState.DONE, decode.transport.connect_failure(key)
    return key


def test_a_rank_holds_its_share_of_every_conv_part_and_of_the_heads():
    split = StateSplit.of(rank_state_spec(WHOLE, 1, 2), 2)
    assert split == StateSplit.of(WHOLE, 1) == StateSplit((4, 4, 8, 4), (12, 12, 12, 16))
    assert split.rank_bytes(2) == 128 and WHOLE.state_bytes == 256
    # D rank 1 of 2 from P's one rank: q1, k1, v1 and heads 2-3, each one range of P's slot.
    assert [(p.remote_rank, p.local_offset_bytes, p.remote_offset_bytes, p.num_bytes)
            for p in split.pieces(1, 2, 1)] == [(0, 0, 24, 24), (0, 24, 72, 24), (0, 48, 144, 48), (0, 96, 224, 32)]
    # D's one rank from P's two: each part in two halves, one from each P rank.
    assert [(p.remote_rank, p.local_offset_bytes, p.remote_offset_bytes, p.num_bytes)
            for p in split.pieces(0, 1, 2)] == [(0, 0, 0, 24), (1, 24, 0, 24), (0, 48, 24, 24), (1, 72, 24, 24),
                                                (0, 96, 48, 48), (1, 144, 48, 48), (0, 192, 96, 32), (1, 224, 96, 32)]
    # Equal sizes: the whole slot of the same rank, one range.
    assert [(p.remote_rank, p.num_bytes) for p in split.pieces(1, 2, 2)] == [(1, 128)]
    assert split.problem(3) == "3 ranks do not divide part 0 of a state layer (4 rows: conv channels or heads)"


@pytest.mark.parametrize("prefill_size, prefill_block, decode_size, decode_block, kv_heads", [
    (1, 4, 2, 4, 2),  # TP 1 -> 2
    (2, 4, 1, 4, 2),  # TP 2 -> 1
    (2, 4, 1, 4, 1),  # one KV head (replicated): D reads P rank 1 for its state alone
    (1, 4, 2, 16, 2),  # TP and block size both differ; D pages two state layers a page, P one
    (2, 16, 1, 4, 2),
    (2, 4, 2, 16, 2),  # equal TP, other block sizes: every rank reads its own slots, rank to rank
    (2, 4, 2, 4, 2),  # equal sizes: each rank's pages move whole, rank to rank
])
def test_each_decode_rank_pulls_its_heads_state_bytes_and_kv_from_the_prefill_ranks_holding_them(
        prefill_size, prefill_block, decode_size, decode_block, kv_heads):
    fabric = FakeFabric()
    prefill = make_worker(fabric, "prefill", prefill_size, prefill_block, kv_heads)
    decode = make_worker(fabric, "decode", decode_size, decode_block, kv_heads)
    prefill_tables, decode_tables = tables(prefill, 1), tables(decode, 2)
    fill_prefill(prefill, prefill_tables)
    their_plan = peer_plan(decode.plan, groups_to_wire(prefill.plan), decode_size, prefill_size)
    their_ranges = handoff_ranges(their_plan, PROMPT, prefill_block)
    their_ids = [table[r.start:r.stop] for table, r in zip(prefill_tables, their_ranges)]
    pull = plan_handoff_pull(decode.plan, decode_block, decode_tables, their_plan, prefill_block, their_ids, PROMPT,
                             0, decode_size, prefill_size)
    same_pages = (prefill_size, prefill_block) == (decode_size, decode_block)
    assert len(pull.state_moves) == (0 if same_pages else NUM_STATE_LAYERS)  # one per layer slot, not per page
    handle = decode.transport.start_read(connect(decode, prefill), pull.local_ids, pull.remote_ids, b"",
                                         state_moves=pull.state_moves)
    assert decode.transport.poll(handle) is TransferState.DONE, handle.error
    page_bytes = decode.views[0].shape[1]
    if same_pages:  # whole pages, padding included
        assert handle.num_bytes == decode_size * page_bytes * sum(len(ids) for ids in decode_tables)
    else:
        unit_tokens = min(prefill_block, decode_block)
        kv_bytes = decode_size * decode.local_heads * math.ceil(PROMPT / unit_tokens) * unit_tokens * 2 * HEAD_DIM * 4
        assert handle.num_bytes == kv_bytes + NUM_STATE_LAYERS * WHOLE.state_bytes  # the state once, no padding
    written = torch.zeros(decode_size, NUM_BLOCKS, page_bytes, dtype=torch.bool)
    for group, ids in zip(decode.plan.groups, decode_tables):
        for rank in range(decode_size):
            first, count = rank_kv_heads(kv_heads, decode_size, rank)
            if group.is_state:
                for slot, layer in enumerate(group.layer_ids):
                    assert torch.equal(decode.state_slot(rank, ids[0], slot), rank_state(layer, rank, decode_size))
                    state_bytes = group.spec.state_bytes
                    written[rank, ids[0], slot * state_bytes:(slot + 1) * state_bytes] = True
                continue
            for position in range(PROMPT):
                page, token = ids[position // decode_block], position % decode_block
                for offset, kv in ((o, k) for o in range(count) for k in range(2)):
                    row = decode.kv_row(rank, page, offset, kv)
                    assert torch.all(row[token] == kv_value(first + offset, position, kv)), (rank, position)
            for page in ids:
                written[rank, page, :decode.kv_page_bytes] = True
    for rank in range(decode_size):  # nothing outside the slots and KV pages of the prompt
        assert torch.count_nonzero(decode.views[rank][~written[rank]]) == 0
