"""P/D of a model with recurrent-state layers over the fake transport: P keeps a handoff page per
state group (its state after all but the last prompt token), pins it with the attention blocks and
names it in the ticket; D pulls it into its live page. A fake runner stands in for the model: it
performs the recorded state copies, writes each attention page's own id into it, and writes into a
state page's first byte how many tokens its state has seen."""

from __future__ import annotations

import pytest

from pdserve.api.kv_transfer import PROTOCOL_VERSION
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, plan_groups
from pdserve.pd.geometry import handoff_ranges
from pdserve.pd.leases import ClaimOutcome
from pdserve.request import Request, RequestStatus
from tests.pd.pd_pair import BLOCK, NUM_BLOCKS, PAGE_BYTES, DecodeSide, PrefillSide, make_request, source_for

STATE = RecurrentStateSpec("gated_delta_net", conv_channels=2, conv_window=3, recurrent_shape=(2, 2, 2))
# 56-byte state layers, 128-byte attention pages: two state layers a page, so two state groups.
STATE_PLAN = plan_groups([STATE, STATE, STATE, FullAttentionSpec()], attention_layer_bytes=128)
ATTENTION_GROUPS = [g.group_id for g in STATE_PLAN.groups if not g.is_state]


def test_the_plan_has_two_state_groups():
    assert len(STATE_PLAN.state_group_ids) == 2 and ATTENTION_GROUPS == [0]


@pytest.fixture
def p(fabric, clock):
    return PrefillSide(fabric, clock, plan=STATE_PLAN)


@pytest.fixture
def d(fabric, clock, p):
    side = DecodeSide(fabric, clock, plan=STATE_PLAN)
    assert side.connect(p) is None
    return side


def run_steps(side, request: Request, until) -> list:
    """Schedule, run the fake model, update, until `until()`; returns the chunks of `request`."""
    chunks = []
    for _ in range(20):
        if until():
            return chunks
        step = side.scheduler.schedule()
        for source, destination in step.state_copies:
            side.pool[destination] = side.pool[source]
        for chunk in step.chunks:
            for group_id, table in enumerate(chunk.block_ids):
                if side.plan.is_state_group(group_id):
                    side.pool[table[0]][0] = min(chunk.end_position, 127)
                else:
                    for block_id in table:
                        if block_id:
                            side.pool[block_id] = block_id
            if chunk.request_id == request.request_id:
                chunks.append((chunk.start_position, chunk.end_position))
        side.scheduler.update(step, [SampledToken(c.request_id, 5, 0.0) for c in step.chunks if c.sample])
    raise AssertionError("did not get there in 20 steps")


def prefill(p: PrefillSide, request_id: str, num_prompt: int):
    request = make_request(request_id, num_prompt, remote_decode=True,
                           sampling=SamplingParams(max_tokens=1, temperature=0))
    p.scheduler.add_request(request)
    chunks = run_steps(p, request, lambda: request.finish_reason is not None)
    assert request.finish_reason is FinishReason.LENGTH, request.error
    return request.kv_transfer_params, chunks


def num_free(side) -> int:
    """Free pages once the last recorded state copies ran (their pages stay pinned until the next
    schedule takes the copies after them)."""
    side.scheduler.schedule()
    return side.kv.num_free_blocks


def test_prefill_ends_a_chunk_before_the_last_token_and_pins_one_handoff_page_per_state_group(p):
    params, chunks = prefill(p, "r1", 10)
    assert chunks == [(0, 8), (8, 9), (9, 10)]  # 8: the prompt's last full block (a snapshot), 9: the handoff
    state_lists = [params.remote_block_ids[g] for g in STATE_PLAN.state_group_ids]
    assert all(len(ids) == 1 for ids in state_lists)
    for (page,) in state_lists:
        assert int(p.pool[page][0]) == 9  # the state after all but the last prompt token
    assert p.connector.num_pinned_blocks == sum(len(ids) for ids in params.remote_block_ids) == 3 + 2
    p.kv.check_invariants()


def test_without_prefix_caching_the_prefill_still_ends_a_chunk_before_the_last_token(fabric, clock):
    p = PrefillSide(fabric, clock, plan=STATE_PLAN, prefix_caching=False)
    params, chunks = prefill(p, "r1", 10)
    assert chunks == [(0, 9), (9, 10)]
    assert all(int(p.pool[params.remote_block_ids[g][0]][0]) == 9 for g in STATE_PLAN.state_group_ids)
    p.kv.check_invariants()


def test_a_preempted_prefill_gives_its_handoff_pages_back_and_keeps_new_ones_when_it_runs_again(p):
    request = make_request("r1", 10, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    p.scheduler.add_request(request)
    run_steps(p, request, lambda: request.num_computed_tokens == 9)
    step = p.scheduler.schedule()  # the chunk at 9: its handoff pages are taken now
    assert p.kv.block_ids("r1", handoff=True)[STATE_PLAN.state_group_ids[0]] != []
    p.scheduler._preempt(request, step)
    p.kv.check_invariants()
    run_steps(p, request, lambda: request.finish_reason is not None)
    params = request.kv_transfer_params
    assert all(int(p.pool[params.remote_block_ids[g][0]][0]) == 9 for g in STATE_PLAN.state_group_ids)
    p.kv.check_invariants()


def test_the_ticket_names_the_handoff_pages_once(p):
    params, _ = prefill(p, "r1", 10)
    claim = p.connector.claim_ticket("r1", params.remote_pin_nonce)
    assert claim.outcome is ClaimOutcome.GRANTED
    assert claim.ticket.block_ids == params.remote_block_ids
    assert p.connector.claim_ticket("r1", params.remote_pin_nonce).outcome is ClaimOutcome.ALREADY_CLAIMED


def test_decode_pulls_the_state_into_its_live_page_and_computes_only_the_last_token(p, d, clock):
    params, _ = prefill(p, "r1", 10)
    request = d.submit("r1-d", 10, source_for(p, params, clock()))
    d.scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    d.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 9
    tables = d.kv.block_ids("r1-d")
    for group_id in STATE_PLAN.state_group_ids:
        assert int(d.pool[tables[group_id][0]][0]) == 9
    for local_id, remote_id in zip(tables[0], params.remote_block_ids[0]):
        assert int(d.pool[local_id][0]) == remote_id
    assert d.metrics.transfer.bytes._value.get() == (3 + 2) * PAGE_BYTES  # 3 KV blocks, 2 state pages
    chunks = run_steps(d, request, lambda: len(request.output_token_ids) >= 2)
    assert chunks[0] == (9, 10)  # D computes one prompt token
    p.tick()  # D's read notification: P frees everything, handoff pages included
    assert not p.kv.has_request("r1") and num_free(p) == NUM_BLOCKS - 1
    p.kv.check_invariants()
    d.kv.check_invariants()


def test_lease_expiry_frees_the_handoff_pages(p, clock):
    free_before = num_free(p)
    prefill(p, "r1", 10)
    assert num_free(p) < free_before
    clock.advance(31)
    p.tick()
    assert not p.kv.has_request("r1") and num_free(p) == free_before
    p.kv.check_invariants()


def test_an_early_release_frees_the_handoff_pages(p):
    free_before = num_free(p)
    params, _ = prefill(p, "r1", 10)
    p.connector.release_early("r1", params.remote_pin_nonce)
    p.tick()
    assert not p.kv.has_request("r1") and num_free(p) == free_before
    p.kv.check_invariants()


def test_a_repeated_prompt_restores_its_snapshot_then_keeps_the_handoff_in_that_order(p):
    prefill(p, "r1", 9)  # snapshot at 8 = all but the last token
    params, chunks = prefill(p, "r2", 9)
    assert chunks == [(8, 9)]  # the hit covers everything before the last token
    for g in STATE_PLAN.state_group_ids:
        assert int(p.pool[params.remote_block_ids[g][0]][0]) == 8  # the restored state, copied after the restore
    p.kv.check_invariants()


def test_a_one_token_prompt_hands_over_no_state_page(p, d, clock):
    params, chunks = prefill(p, "r1", 1)
    assert chunks == [(0, 1)]
    assert all(params.remote_block_ids[g] == [] for g in STATE_PLAN.state_group_ids)
    assert [len(r) for r in handoff_ranges(STATE_PLAN, 1, BLOCK)] == [1, 0, 0]


def test_a_full_pool_keeps_no_handoff_and_the_prefill_ends_with_503(p):
    request = make_request("r1", 9, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    assert p.kv.allocate_slots("r1", 0, 9)
    hogs = p.kv.pool.allocate(p.kv.num_free_blocks, 0)  # nothing left for the handoff pages
    assert not p.kv.keep_state_handoff("r1")
    tables = p.kv.block_ids("r1", handoff=True)
    assert all(tables[g] == [] for g in STATE_PLAN.state_group_ids)
    request.num_computed_tokens = 9
    action = p.connector.request_finished(request, FinishReason.LENGTH, tables)
    assert action.error is not None and action.error.status_code == 503 and "recurrent state" in action.error.message
    assert p.connector.num_pinned_blocks == 0
    p.kv.pool.free(hogs)
    p.kv.free("r1")
    p.kv.check_invariants()


def test_decode_with_its_own_snapshot_at_the_handoff_point_pulls_no_state(p, fabric, clock):
    d = DecodeSide(fabric, clock, plan=STATE_PLAN)
    assert d.connect(p) is None
    local = make_request("warm", 9, sampling=SamplingParams(max_tokens=1, temperature=0))
    d.scheduler.add_request(local)
    run_steps(d, local, lambda: local.finish_reason is not None)  # D's own snapshot at 8
    params, _ = prefill(p, "r1", 9)
    request = d.submit("r1-d", 9, source_for(p, params, clock()))
    d.scheduler.schedule()
    assert request.num_cached_tokens == 8
    d.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 8
    p.tick()
    assert not p.kv.has_request("r1")  # nothing to read: P was told to free
    d.kv.check_invariants()


@pytest.mark.parametrize("prefill_ranks", [1, 3])
def test_decode_of_two_ranks_takes_state_from_prefill_ranks_that_split_it_and_names_the_counts_otherwise(
        p, clock, prefill_ranks):
    import asyncio

    import httpx

    from pdserve.api.kv_transfer import KVParamsInvalid
    from pdserve.pd.admission import DecodeAdmission, PeerFailureMemory
    from pdserve.pd.handshake import HandshakeClient
    from pdserve.request import GenerationRequest

    params, _ = prefill(p, "r1", 10)
    params = params.model_copy(update={"tp_size": prefill_ranks})
    info = p.agent_info()
    claimed = info.model_copy(update={"tp_size": prefill_ranks})
    handshake = HandshakeClient("h", None, http_transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=claimed.model_dump_json())))
    connected = []

    async def connect(peer):
        connected.append(peer)

    gate = DecodeAdmission(handshake, STATE_PLAN, BLOCK, "recompute", connect, PeerFailureMemory(clock=clock),
                           tp_size=2)
    generation = GenerationRequest("req", tuple(range(10, 20)), SamplingParams(), kv_params=params)
    if prefill_ranks == 1:  # D's two ranks each read their heads' bytes of P's one rank
        assert asyncio.run(gate.admit(generation)).remote is not None
        assert [peer.block_size for peer in connected] == [BLOCK]
        return
    # This worker's ranks hold 2 conv channels and 2 heads of each layer: 4 of each in all, not a multiple of 3.
    with pytest.raises(KVParamsInvalid, match="prefill worker .* runs 3 tensor-parallel rank\\(s\\), this worker 2: "
                                              "3 ranks do not divide part 0 of a state layer \\(4 rows"):
        asyncio.run(gate.admit(generation))
    assert connected == []


def test_the_handshake_names_the_state_layers_a_peer_lacks():
    from pdserve.pd.handshake import compatibility_document, incompatibilities

    attention_only = plan_groups([FullAttentionSpec()] * 4)
    own = compatibility_document("m", "float32", 1, 8, STATE_PLAN)
    theirs = compatibility_document("m", "float32", 1, 8, attention_only)
    older = dict(own, protocol_version=5)
    assert "recurrent-state layers [0, 1, 2] here are not state layers there" in incompatibilities(own, theirs)
    assert f"protocol_version: {PROTOCOL_VERSION} here, 5 there" in incompatibilities(own, older)
    repaged = compatibility_document("m", "float32", 1, 8, plan_groups([STATE, STATE, STATE, FullAttentionSpec()],
                                                                        attention_layer_bytes=256))
    assert repaged == own  # state layers are listed whatever pages they share: block sizes may differ
    paged = dict(own, groups=[*own["groups"][:1], *(dict(own["groups"][1], layer_ids=ids) for ids in ([0, 2], [1]))])
    assert ("recurrent-state layers listed [[0, 1, 2]] here, [[0, 2], [1]] there (a worker from before state moved "
            "between block sizes") in incompatibilities(own, paged)
