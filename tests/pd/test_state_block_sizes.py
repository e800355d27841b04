"""P/D of a model with recurrent state between workers of different block sizes, over the fake
transport: P and D cut their state layers into pages differently (a page holds as many state layers
as the attention page allows, and that grows with the block size), so D pulls each layer's slot of
P's handoff page into that layer's slot of its own live page, as byte ranges beside the attention
units, and no page padding travels.

    layers: 3 state (300 bytes each), 1 full attention (20 bytes a token per K or V)
    block 4:  attention page 160 bytes -> pages of 512 (padded), state pages [[0], [1], [2]]
    block 16: attention page 640 bytes -> pages of 640,          state pages [[0, 2], [1]]

A fake runner stands in for the model: it writes each attention page's own id into all of it, each
state slot as (its layer * 40 + the tokens its state has seen), and a state page's padding as 99."""

from __future__ import annotations

import math

import pytest

from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, plan_groups
from pdserve.request import Request, RequestStatus
from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import NUM_BLOCKS, DecodeSide, FakeClock, PrefillSide, make_request, source_for

STATE = RecurrentStateSpec("gated_delta_net", conv_channels=5, conv_window=3, recurrent_shape=(60,))
HEAD_BYTES = 20  # one token of one head, K or V
PADDING = 99
PROMPT = 10


def plan_for(block_size: int):
    return plan_groups([STATE, STATE, STATE, FullAttentionSpec()], attention_layer_bytes=2 * block_size * HEAD_BYTES)


def kv_page_bytes(block_size: int) -> int:
    return 2 * block_size * HEAD_BYTES


def page_bytes(block_size: int) -> int:
    return plan_for(block_size).padded_page_bytes or kv_page_bytes(block_size)


def test_the_two_block_sizes_page_the_state_layers_differently():
    assert STATE.state_bytes == 300
    assert [g.layer_ids for g in plan_for(4).groups if g.is_state] == [(0,), (1,), (2,)]
    assert [g.layer_ids for g in plan_for(16).groups if g.is_state] == [(0, 2), (1,)]
    assert (page_bytes(4), page_bytes(16)) == (512, 640)


def run_steps(side, request: Request, until) -> None:
    for _ in range(20):
        if until():
            return
        step = side.scheduler.schedule()
        for source, destination in step.state_copies:
            side.pool[destination] = side.pool[source]
        for chunk in step.chunks:
            for group_id, table in enumerate(chunk.block_ids):
                group = side.plan.groups[group_id]
                if group.is_state:
                    page = side.pool[table[0]]
                    page[:] = PADDING
                    for slot, layer_id in enumerate(group.layer_ids):
                        page[slot * STATE.state_bytes:(slot + 1) * STATE.state_bytes] = layer_id * 40 + min(
                            chunk.end_position, 39)
                else:
                    for block_id in table:
                        if block_id:
                            side.pool[block_id] = block_id
        side.scheduler.update(step, [SampledToken(c.request_id, 5, 0.0) for c in step.chunks if c.sample])
    raise AssertionError("did not get there in 20 steps")


def expected_pull_bytes(prefill_block: int, decode_block: int) -> int:
    """From both plans: the full-attention group's units (of the smaller block) covering the prompt, K
    and V rows each, and one state slot per state layer of D's plan (no padding)."""
    unit_tokens = min(prefill_block, decode_block)
    units = math.ceil(PROMPT / unit_tokens)
    attention = units * 2 * unit_tokens * HEAD_BYTES
    state = sum(len(g.layer_ids) * g.spec.state_bytes for g in plan_for(decode_block).groups if g.is_state)
    return attention + state


@pytest.mark.parametrize("prefill_block, decode_block", [(4, 16), (16, 4)])
def test_decode_pulls_each_state_layer_into_its_own_slot_across_block_sizes(prefill_block, decode_block):
    clock, fabric = FakeClock(), FakeFabric()
    p = PrefillSide(fabric, clock, plan=plan_for(prefill_block), block_size=prefill_block,
                    page_bytes=page_bytes(prefill_block))
    d = DecodeSide(fabric, clock, block_size=decode_block, plan=plan_for(decode_block),
                   page_bytes=page_bytes(decode_block), kv_page_bytes=kv_page_bytes(decode_block),
                   prefill_block_size=prefill_block)
    assert d.connect(p) is None
    prefill = make_request("r1", PROMPT, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    p.scheduler.add_request(prefill)
    run_steps(p, prefill, lambda: prefill.finish_reason is not None)
    assert prefill.finish_reason is FinishReason.LENGTH, prefill.error
    params = prefill.kv_transfer_params
    assert len(params.remote_block_ids) == len(p.plan.groups)  # P's own groups, not D's

    request = d.submit("r1-d", PROMPT, source_for(p, params, clock()))
    d.scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    d.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == PROMPT - 1

    tables = d.kv.block_ids("r1-d")
    for group in d.plan.groups:
        if not group.is_state:
            continue
        page = d.pool[tables[group.group_id][0]]
        for slot, layer_id in enumerate(group.layer_ids):
            data = page[slot * STATE.state_bytes:(slot + 1) * STATE.state_bytes]
            assert (data == layer_id * 40 + PROMPT - 1).all(), (layer_id, data)  # P's state after 9 tokens
        assert (page[len(group.layer_ids) * STATE.state_bytes:] == 0).all()  # P's padding stayed there
    attention, theirs = tables[0], params.remote_block_ids[0]
    assert not d.plan.groups[0].is_state
    row = decode_block * HEAD_BYTES
    for token in range(PROMPT):
        page = d.pool[attention[token // decode_block]]
        for kv in range(2):  # each token's K and V hold the id of P's block that held it
            at = kv * row + (token % decode_block) * HEAD_BYTES
            assert (page[at:at + HEAD_BYTES] == theirs[token // prefill_block]).all(), (token, kv)
    assert d.metrics.transfer.bytes._value.get() == expected_pull_bytes(prefill_block, decode_block)

    run_steps(d, request, lambda: len(request.output_token_ids) >= 2)
    p.tick()  # D's read notification: P frees everything, its handoff pages included
    p.scheduler.schedule()
    assert not p.kv.has_request("r1") and p.kv.num_free_blocks == NUM_BLOCKS - 1
    assert p.connector.num_pinned_blocks == 0
    p.kv.check_invariants()
    d.kv.check_invariants()


def test_a_one_token_prompt_pulls_no_state_across_block_sizes():
    clock, fabric = FakeClock(), FakeFabric()
    p = PrefillSide(fabric, clock, plan=plan_for(4), block_size=4, page_bytes=page_bytes(4))
    d = DecodeSide(fabric, clock, block_size=16, plan=plan_for(16), page_bytes=page_bytes(16),
                   kv_page_bytes=kv_page_bytes(16), prefill_block_size=4)
    assert d.connect(p) is None
    prefill = make_request("r1", 1, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    p.scheduler.add_request(prefill)
    run_steps(p, prefill, lambda: prefill.finish_reason is not None)
    request = d.submit("r1-d", 1, source_for(p, prefill.kv_transfer_params, clock()))
    d.scheduler.schedule()
    d.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 0
    assert d.metrics.transfer.bytes._value.get() == 2 * 4 * HEAD_BYTES  # one unit of K and V, no state
    d.kv.check_invariants()


def test_admission_checks_p_block_lists_against_p_own_groups_and_names_p_block_size_to_the_reader():
    import asyncio

    import httpx

    from pdserve.api.kv_transfer import KVParamsInvalid
    from pdserve.pd.admission import DecodeAdmission, PeerFailureMemory
    from pdserve.pd.handshake import HandshakeClient
    from pdserve.request import GenerationRequest

    clock, fabric = FakeClock(), FakeFabric()
    p = PrefillSide(fabric, clock, plan=plan_for(4), block_size=4, page_bytes=page_bytes(4))
    prefill = make_request("r1", PROMPT, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    p.scheduler.add_request(prefill)
    run_steps(p, prefill, lambda: prefill.finish_reason is not None)
    params = prefill.kv_transfer_params
    info = p.agent_info()
    connected = []

    async def connect(peer):
        connected.append(peer)

    def gate(tp_size: int) -> DecodeAdmission:
        handshake = HandshakeClient("h", None, http_transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=info.model_dump_json())))
        return DecodeAdmission(handshake, plan_for(16), 16, "recompute", connect, PeerFailureMemory(clock=clock),
                               tp_size=tp_size)

    generation = GenerationRequest("req", tuple(range(10, 10 + PROMPT)), SamplingParams(), kv_params=params)
    admitted = asyncio.run(gate(1).admit(generation))
    assert admitted.remote is not None and [peer.block_size for peer in connected] == [4]
    assert asyncio.run(gate(2).admit(generation)).remote is not None  # two ranks each read their heads' share
    # D's own partition has 2 state groups, P's 3: P's lists are checked against P's, a state page each.
    bad = params.model_copy(update={"remote_block_ids": [*params.remote_block_ids[:3], [7, 8]]})
    with pytest.raises(KVParamsInvalid, match="remote_block_ids\\[3\\] must name 1 non-null blocks"):
        asyncio.run(gate(1).admit(GenerationRequest("req", generation.prompt_token_ids, SamplingParams(),
                                                    kv_params=bad)))
