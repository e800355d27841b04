"""A decode worker lends its prefixes to peers, over the fake transport: D pulls a prompt from P, decodes
an answer, and keeps the full blocks of both in its prefix cache; a peer (B) asks D to pin the next
turn's prompt (that prompt, that answer and more) and D pins, by its own hash chain, blocks the answer
filled; B reads them and computes only the rest, and D's pin goes with B's "done", an early release
carrying the nonce, or the lease (nothing pinned after). D's lease table is the prefill worker's
(pd/lending.py), and its readers' messages come through D's own poll."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.api.config import SchedulerConfig
from pdserve.api.kv_transfer import PROTOCOL_VERSION, AgentInfo, PoolGeometry
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.metrics import Metrics
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.pd.decode import DecodeConnector
from pdserve.pd.handshake import groups_to_wire
from pdserve.pd.leases import LeaseTable
from pdserve.pd.lending import LenderIdentity, PinLender
from pdserve.pd.peer_pins import pin_peer_prefix
from pdserve.pd.peers import PeerConnections
from pdserve.request import Request, RequestStatus
from pdserve.transfer.fake_transport import FakeTransport
from pdserve.transfer.ranked_transport import encode_ranks, rank_descriptor
from tests.engine.checked_scheduler import CheckedScheduler
from tests.pd.pd_pair import BLOCK, NUM_BLOCKS, PAGE_BYTES, DecodeSide, PrefillSide, make_request, source_for
from tests.pd.test_peer_pull import Puller, source_from

FULL = plan_groups([FullAttentionSpec(), FullAttentionSpec()])
LEASE_S = 30.0
NUM_PROMPT = 4 * BLOCK + 1
NUM_ANSWER = 2 * BLOCK + 2


class LendingDecode(DecodeSide):
    """Worker D with peer pulls on: its connector holds a `PinLender` over D's own transport."""

    def __init__(self, fabric, clock):  # DecodeSide's fields, over a connector that lends
        self.plan, self.block_size, self.name = FULL, BLOCK, "D"
        self.kv = KVCacheManager(FULL, NUM_BLOCKS, BLOCK)
        self.pool = torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.int8)
        self.transport = FakeTransport(self.pool, "D", fabric)
        self.metrics = Metrics()
        self.peers = PeerConnections(self.transport, connect_timeout_s=5.0, clock=clock)
        self.lender = PinLender(self.transport, LeaseTable(LEASE_S, clock=clock),
                                LenderIdentity("D", "epoch-1", "127.0.0.1", 2), self.metrics.transfer)
        self.connector = DecodeConnector(self.transport, self.peers, FULL, BLOCK, self.metrics.transfer,
                                         clock=clock, lender=self.lender)
        self.scheduler = CheckedScheduler(SchedulerConfig(), self.kv, BLOCK, 10_000, connector=self.connector)

    def agent_info(self) -> AgentInfo:  # what D's handshake answers a puller
        peer = self.transport.local_peer_info("D", "epoch-1")
        ranked = dataclasses.replace(peer, agent_metadata=encode_ranks([rank_descriptor(peer)]))
        return AgentInfo(protocol_version=PROTOCOL_VERSION, compat_hash="h", engine_id="D", epoch="epoch-1",
                         geometry=PoolGeometry(num_blocks=NUM_BLOCKS, page_bytes=PAGE_BYTES, block_size=BLOCK,
                                               group_size=FULL.group_size, groups=groups_to_wire(FULL)),
                         transport=ranked.to_dict())

    def converse(self, p: PrefillSide, clock) -> list[int]:
        """Turn 1 through P and D: P prefills, D pulls and decodes NUM_ANSWER tokens, writing a
        recognisable byte into every page it computes (as the model would its KV). Returns prompt + answer."""
        params = p.prefill("turn-1", NUM_PROMPT)
        request = make_request("turn-1", NUM_PROMPT, remote=source_for(p, params, clock()),
                               sampling=SamplingParams(max_tokens=NUM_ANSWER, temperature=0))
        self.scheduler.add_request(request)
        self.scheduler.schedule()
        self.tick()  # the pull lands
        assert request.status is RequestStatus.RUNNING
        answer = 500
        while request.status is RequestStatus.RUNNING:
            step = self.scheduler.schedule()
            for table in step.chunks[0].block_ids:
                self.pool[table[-1]] = table[-1]  # the page the step's token lands in
            answer += 1
            self.scheduler.update(step, [SampledToken("turn-1", answer, 0.0)])
        assert request.finish_reason is FinishReason.LENGTH and len(request.output_token_ids) == NUM_ANSWER
        return request.prompt_token_ids + request.output_token_ids


@pytest.fixture
def p(fabric, clock):
    return PrefillSide(fabric, clock, plan=FULL)


@pytest.fixture
def lender(fabric, clock, p):
    side = LendingDecode(fabric, clock)
    assert side.connect(p) is None
    return side


@pytest.fixture
def puller(fabric, clock, lender):
    side = Puller(fabric, clock)
    side.connect(lender)
    return side


def pinned_on(side: LendingDecode) -> tuple[int, int]:
    """D's pinned blocks, as /load and the gauge report them."""
    return side.connector.num_pinned_blocks, int(side.metrics.transfer.pinned_blocks._value.get())


def test_decode_pins_its_prompt_and_answer_blocks_by_its_own_chain(lender, p, clock):
    conversation = lender.converse(p, clock)
    turn_2 = conversation + [900 + i for i in range(BLOCK + 3)]
    ticket = pin_peer_prefix(lender.kv, lender.lender, turn_2)
    # Every full block D computed or pulled: the prompt's and the answer's but its last token (sampled, not computed).
    num_held = (NUM_PROMPT + NUM_ANSWER - 1) // BLOCK * BLOCK
    assert ticket is not None and ticket.num_tokens == num_held > NUM_PROMPT // BLOCK * BLOCK
    assert ticket.engine_id == "D" and ticket.block_hashes == [h.hex() for h in hash_full_blocks(turn_2[:num_held], BLOCK, [])]
    lender.tick()  # the lender's tick runs while it holds a pin
    assert pinned_on(lender) == (num_held // BLOCK * len(FULL.groups),) * 2
    lender.kv.check_invariants()


def test_a_peer_pulls_the_answer_from_decode_and_the_pin_goes_with_its_done(lender, puller, p, clock):
    conversation = lender.converse(p, clock)
    turn_2 = conversation + [900 + i for i in range(BLOCK + 3)]
    ticket = pin_peer_prefix(lender.kv, lender.lender, turn_2)
    request = Request("turn-2", turn_2, SamplingParams(max_tokens=4, temperature=0), (0,), 0.0,
                      remote=source_from(lender, ticket, clock()))
    puller.scheduler.add_request(request)
    puller.scheduler.schedule()
    puller.tick()  # the READ lands
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == ticket.num_tokens
    for group, ids in enumerate(puller.side.kv.block_ids("turn-2")):  # D's pages, the answer's included
        assert [puller.side.pool[b][0].item() for b in ids[:len(ticket.block_ids[group])]] == [
            lender.pool[b][0].item() for b in ticket.block_ids[group]]
    step = puller.scheduler.schedule()
    assert step.chunks[0].start_position == ticket.num_tokens  # only the new part is computed
    assert puller.counts == {"pulled": ticket.num_tokens}
    lender.tick()  # B's "done" came with the READ
    assert pinned_on(lender) == (0, 0) and not lender.kv.has_request(ticket.pin_id)
    lender.kv.check_invariants()


def test_decode_pins_go_by_an_early_release_with_the_nonce_or_by_the_lease(lender, p, clock):
    conversation = lender.converse(p, clock)
    first = pin_peer_prefix(lender.kv, lender.lender, conversation)
    lender.lender.release_early(first.pin_id, "0" * 32)  # a made-up nonce frees nothing
    lender.tick()
    assert lender.kv.has_request(first.pin_id) and pinned_on(lender)[0] > 0
    lender.lender.release_early(first.pin_id, first.nonce)
    lender.tick()
    assert pinned_on(lender) == (0, 0) and not lender.kv.has_request(first.pin_id)
    second = pin_peer_prefix(lender.kv, lender.lender, conversation)  # a puller that never comes
    assert lender.connector.has_pending()  # the engine loop keeps polling D for the lease's end
    lender.tick()
    clock.advance(LEASE_S + 1)
    lender.tick()
    assert pinned_on(lender) == (0, 0) and not lender.kv.has_request(second.pin_id)
    assert not lender.connector.has_pending()
    lender.kv.check_invariants()


def test_a_decode_worker_without_a_lender_holds_nothing_for_others(fabric, clock):
    d = DecodeSide(fabric, clock)
    assert d.connector.lender is None and d.connector.num_pinned_blocks == 0 and not d.connector.has_pending()
