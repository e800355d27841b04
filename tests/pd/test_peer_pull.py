"""Peer pulls over the fake transport: a worker (B) reads a prompt's prefix from a peer (A) that pinned
it by its own hash chain, computes only the rest, caches what it pulled, and A's pin is released by B's
"done"; a failed READ, a lost peer or a stale lease costs a recompute of the whole prompt, never the
request, and never leaves A's blocks pinned past its lease."""

from __future__ import annotations

import pytest

from pdserve.api.kv_transfer import KVPinnedFull, RemotePrefillParams
from pdserve.api.peer_pull import PeerPinRefused
from pdserve.api.config import SchedulerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.pd.peer_pins import PEER_PIN_PREFIX, pin_peer_prefix
from pdserve.pd.peer_pull import PeerPullConnector
from pdserve.pd.peers import PeerConnections
from pdserve.request import RemoteSource, RequestStatus
from tests.engine.checked_scheduler import CheckedScheduler
from tests.pd.pd_pair import BLOCK, PAGE_BYTES, PLAN, FakeClock, PrefillSide, make_request
from pdserve.transfer.fake_transport import FakeFabric

FULL = plan_groups([FullAttentionSpec(), FullAttentionSpec()])


class Puller:
    """Worker B: a prefill side whose scheduler talks to a PeerPullConnector around its own connector."""

    def __init__(self, fabric: FakeFabric, clock: FakeClock):
        self.side = PrefillSide(fabric, clock, name="B", plan=FULL)
        self.peers = PeerConnections(self.side.transport, connect_timeout_s=5.0, clock=clock)
        self.counts: dict[str, int] = {}
        self.connector = PeerPullConnector(self.side.connector, self.side.transport, self.peers, FULL, BLOCK,
                                           count_tokens=self._count, clock=clock, lease_s=30.0)
        self.scheduler = CheckedScheduler(SchedulerConfig(), self.side.kv, BLOCK, 10_000, connector=self.connector)

    def _count(self, result: str, num_tokens: int) -> None:
        self.counts[result] = self.counts.get(result, 0) + num_tokens

    def connect(self, holder: PrefillSide) -> None:
        import dataclasses

        from pdserve.transfer.transport import PeerInfo
        outcome: list = []
        peer = dataclasses.replace(PeerInfo.from_dict(holder.agent_info().transport, via="127.0.0.1:1"),
                                   block_size=BLOCK)
        self.peers.ensure(peer, outcome.append)
        self.peers.poll()
        assert outcome == [None]

    def tick(self) -> None:
        self.scheduler.apply_kv_events(self.connector.poll())


@pytest.fixture
def holder(fabric, clock):
    return PrefillSide(fabric, clock, name="A", plan=FULL)


@pytest.fixture
def puller(fabric, clock, holder):
    side = Puller(fabric, clock)
    side.connect(holder)
    return side


def compute_on(side: PrefillSide, request_id: str, num_prompt: int) -> list[int]:
    """A computes a prompt (a recognisable byte per page) and caches its full blocks."""
    request = make_request(request_id, num_prompt, sampling=SamplingParams(max_tokens=1, temperature=0))
    side.scheduler.add_request(request)
    step = side.scheduler.schedule()
    for table in step.chunks[0].block_ids:
        for block_id in table:
            side.pool[block_id] = block_id
    side.scheduler.update(step, [SampledToken(request_id, 5, 0.0)])
    return request.prompt_token_ids


def source_from(holder: PrefillSide, ticket, received_s: float) -> RemoteSource:
    params = RemotePrefillParams(
        do_remote_prefill=True, remote_engine_id=ticket.engine_id, remote_request_id=ticket.pin_id,
        remote_block_ids=ticket.block_ids, remote_host="127.0.0.1", remote_port=1, remote_epoch=ticket.epoch,
        num_prompt_tokens=ticket.num_tokens, lease_s=ticket.lease_left_s, remote_pin_nonce=ticket.nonce)
    return RemoteSource(params, holder.agent_info(), received_s, num_pull_tokens=ticket.num_tokens)


def test_holder_pins_the_longest_prefix_it_holds_by_its_own_chain(holder):
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt + [7, 7, 7, 7, 7])
    assert ticket is not None and ticket.pin_id.startswith(PEER_PIN_PREFIX)
    assert ticket.num_tokens == 4 * BLOCK  # the full blocks A computed; the tokens past them it never saw
    assert ticket.block_hashes == [h.hex() for h in hash_full_blocks(prompt[:4 * BLOCK], BLOCK, [])]
    assert [holder.pool[ids[0]][0].item() for ids in ticket.block_ids] == [ids[0] for ids in ticket.block_ids]
    assert holder.connector.num_pinned_blocks == 4 * len(FULL.groups)
    holder.kv.check_invariants()
    assert pin_peer_prefix(holder.kv, holder.connector, [99] * (2 * BLOCK)) is None  # holds none of it


def test_holder_refuses_models_whose_kv_does_not_move_between_peers(fabric, clock):
    sliding = PrefillSide(fabric, clock, name="S", plan=PLAN)
    with pytest.raises(PeerPinRefused, match="SlidingWindowSpec"):
        pin_peer_prefix(sliding.kv, sliding.connector, list(range(10, 10 + 2 * BLOCK)))


def test_holder_refuses_past_its_pin_limit(fabric, clock):
    holder = PrefillSide(fabric, clock, name="A", plan=FULL, max_pinned_blocks=2)
    holder.connector.leases.pin("other", 2)  # something else holds the limit
    prompt = compute_on(holder, "a", 2 * BLOCK + 1)
    with pytest.raises(KVPinnedFull):
        pin_peer_prefix(holder.kv, holder.connector, prompt)


def test_puller_reads_the_prefix_computes_the_rest_and_releases_the_pin(holder, puller, clock):
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    longer = make_request("b", 6 * BLOCK + 2, remote=source_from(holder, ticket, clock()))
    assert longer.prompt_token_ids[:4 * BLOCK + 1] == prompt
    puller.scheduler.add_request(longer)
    step = puller.scheduler.schedule()
    assert not step.chunks and longer.status is RequestStatus.WAITING_FOR_REMOTE_KV
    local_ids = puller.side.kv.block_ids("b")
    puller.tick()  # the READ lands
    assert longer.status is RequestStatus.RUNNING and longer.num_computed_tokens == 4 * BLOCK
    for group, ids in enumerate(local_ids):
        assert [puller.side.pool[b][0].item() for b in ids[:4]] == ticket.block_ids[group]
    step = puller.scheduler.schedule()  # only the rest is computed
    assert step.chunks[0].start_position == 4 * BLOCK and len(step.chunks[0].token_ids) == 2 * BLOCK + 2
    puller.scheduler.update(step, [SampledToken("b", 5, 0.0)])
    assert puller.counts == {"pulled": 4 * BLOCK} and not longer.pd_recomputed
    hit = puller.side.kv.find_prefix(hash_full_blocks(longer.prompt_token_ids, BLOCK, []), 6 * BLOCK + 2)
    assert hit.num_tokens == 6 * BLOCK  # the pulled blocks became ordinary cached blocks
    holder.tick()  # "done" arrives with the READ's completion
    assert holder.connector.num_pinned_blocks == 0 and not holder.kv.has_request(ticket.pin_id)
    holder.kv.check_invariants()


def test_a_failed_read_recomputes_the_whole_prompt_and_frees_the_pin(holder, puller, clock):
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    request = make_request("b", 5 * BLOCK, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    puller.side.transport.fail_reads = True
    puller.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == 0 and len(step.chunks[0].token_ids) == 5 * BLOCK
    assert puller.counts == {"failed": 4 * BLOCK} and not request.pd_recomputed  # no P/D leg was recomputed
    holder.tick()  # the puller's "free"
    assert holder.connector.num_pinned_blocks == 0 and not holder.kv.has_request(ticket.pin_id)


def test_a_stale_lease_is_never_read_and_the_holder_lease_frees_a_lost_puller(holder, puller, clock):
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    request = make_request("b", 5 * BLOCK, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    clock.advance(ticket.lease_left_s / 2 + 1)  # queued past half the lease: the pages may be gone
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == 0 and puller.counts == {"failed": 4 * BLOCK}
    # A pin nobody reads or frees (the puller died) goes with its lease.
    other = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    holder.tick()
    clock.advance(holder.connector.leases.lease_s + 1)
    holder.tick()
    assert holder.connector.num_pinned_blocks == 0 and not holder.kv.has_request(other.pin_id)
    holder.kv.check_invariants()


def test_a_prefix_already_cached_here_is_not_pulled(holder, puller, clock):
    prompt = compute_on(holder, "a", 4 * BLOCK + 1)
    compute_on(puller.side, "mine", 4 * BLOCK + 1)  # B computed the same prompt meanwhile
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:4 * BLOCK])
    request = make_request("b", 5 * BLOCK, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 4 * BLOCK
    assert puller.scheduler.schedule().chunks[0].start_position == 4 * BLOCK
    assert puller.counts == {}  # nothing read, nothing recomputed
    holder.tick()  # told "free" at once
    assert holder.connector.num_pinned_blocks == 0


def test_a_puller_of_another_block_size_reads_the_prefix_in_units_of_the_smaller(fabric, clock, holder):
    from pdserve.transfer.ranked_transport import RankedTransport

    side = PrefillSide(fabric, clock, name="B8", plan=FULL, block_size=2 * BLOCK, page_bytes=2 * PAGE_BYTES)
    reader = RankedTransport(side.transport, None, [], num_kv_heads=1, num_layer_slots=FULL.group_size)
    puller = Puller.__new__(Puller)
    puller.side, puller.counts = side, {}
    puller.peers = PeerConnections(reader, connect_timeout_s=5.0, clock=clock)
    puller.connector = PeerPullConnector(side.connector, reader, puller.peers, FULL, 2 * BLOCK,
                                         count_tokens=puller._count, clock=clock)
    puller.scheduler = CheckedScheduler(SchedulerConfig(), side.kv, 2 * BLOCK, 10_000, connector=puller.connector)
    puller.connect(holder)
    prompt = compute_on(holder, "a", 5 * BLOCK + 1)
    ticket = pin_peer_prefix(holder.kv, holder.connector, prompt[:6 * BLOCK])
    assert ticket.num_tokens == 5 * BLOCK  # whole blocks of the holder's size: 2.5 of the puller's
    request = make_request("b", 7 * BLOCK + 2, remote=source_from(holder, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    puller.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 5 * BLOCK
    first = side.kv.block_ids("b")[0][0]  # tokens 0-7: the holder's blocks of tokens 0-3 and 4-7
    assert set(side.pool[first].tolist()) == {ticket.block_ids[0][0], ticket.block_ids[0][1]}
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == 5 * BLOCK  # mid-block: the rest of block 2 is computed here
    puller.scheduler.update(step, [SampledToken("b", 5, 0.0)])
    hit = side.kv.find_prefix(hash_full_blocks(request.prompt_token_ids, 2 * BLOCK, []), 7 * BLOCK + 2)
    assert hit.num_tokens == 3 * 2 * BLOCK and puller.counts == {"pulled": 5 * BLOCK}
    holder.tick()
    assert holder.connector.num_pinned_blocks == 0
