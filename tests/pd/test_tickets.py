"""Params are tickets: D reads only the block ids of P's own pin record, claimed once with the pin's nonce,
and only for its own prompt; everything else is a local prefill (counted by reason) or a 409."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from fastapi import FastAPI

from pdserve.api.kv_transfer import KVParamsStale, KVTicketUnusable, RemotePrefillParams, prompt_digest
from pdserve.api.sampling import SamplingParams
from pdserve.pd.leases import ClaimOutcome, LeaseTable
from pdserve.pd.tickets import TicketAdmission, TicketClient
from pdserve.request import GenerationRequest
from pdserve.metrics import Metrics
from pdserve.server.errors import install_error_handlers
from pdserve.server.kv_routes import PIN_PATH, RELEASE_PATH, create_kv_router
from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import FakeClock, InnerAdmission, PrefillSide

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Pair:
    def __init__(self, policy: str = "recompute"):
        self.p = PrefillSide(FakeFabric(), FakeClock())
        router = create_kv_router(self.p.agent_info, None, self.p.connector.release_early,
                                  self.p.connector.claim_ticket)
        self.app = FastAPI()
        install_error_handlers(self.app, Metrics().request)
        self.app.include_router(router)
        self.client = TicketClient(None, http_transport=httpx.ASGITransport(app=self.app))
        self.inner = InnerAdmission()
        self.recomputed: list[tuple[str, int]] = []
        self.admission = TicketAdmission(self.inner, self.client, policy,
                                         count_recompute=lambda reason, n: self.recomputed.append((reason, n)))

    async def admit(self, params: RemotePrefillParams, prompt=None) -> GenerationRequest:
        prompt = tuple(range(10, 10 + params.num_prompt_tokens)) if prompt is None else prompt
        return await self.admission.admit(GenerationRequest("d-req", prompt, SamplingParams(), kv_params=params))

    async def settle_releases(self) -> None:
        await asyncio.gather(*list(self.client._releases))
        self.p.tick()


def test_a_pins_ticket_goes_once_to_the_nonces_holder():
    clock = FakeClock()
    table = LeaseTable(lease_s=30, clock=clock)
    lease = table.pin("a", 3, ticket="record")
    assert table.claim("a", "0" * 32).outcome is ClaimOutcome.UNKNOWN  # wrong nonce: as if nothing were pinned
    assert table.claim("b", lease.nonce).outcome is ClaimOutcome.UNKNOWN
    clock.advance(10)
    granted = table.claim("a", lease.nonce)
    assert granted.outcome is ClaimOutcome.GRANTED and granted.ticket == "record" and granted.lease_left_s == 20
    assert table.claim("a", lease.nonce).outcome is ClaimOutcome.ALREADY_CLAIMED
    table.release("a")
    assert table.claim("a", lease.nonce).outcome is ClaimOutcome.UNKNOWN


def test_the_ticket_names_the_pinned_blocks_and_the_digest_of_the_prompt_p_computed():
    p = PrefillSide(FakeFabric(), FakeClock())
    params = p.prefill("r1", 30)
    claim = p.connector.claim_ticket("r1", params.remote_pin_nonce)
    assert claim.ticket.block_ids == params.remote_block_ids and claim.ticket.num_prompt_tokens == 30
    assert claim.ticket.prompt_sha256 == prompt_digest(list(range(10, 40)))


async def test_client_block_ids_never_reach_the_admission_that_plans_the_read():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    forged = params.model_copy(update={"remote_block_ids": [list(reversed(ids)) for ids in params.remote_block_ids],
                                       "lease_s": 9999.0})
    admitted = await pair.admit(forged)
    assert admitted.remote is not None and not pair.recomputed
    [seen] = pair.inner.seen
    assert seen.kv_params.remote_block_ids == params.remote_block_ids  # P's, not the reversed ones
    assert seen.kv_params.lease_s <= 30  # what P's lease has left, not what the params claim


async def test_the_params_of_another_prompt_are_computed_locally_counted_and_their_pin_released():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    other_prompt = tuple(range(11, 41))  # same length, other tokens
    admitted = await pair.admit(params, other_prompt)
    assert admitted.remote is None and admitted.kv_params is None and not pair.inner.seen
    assert pair.recomputed == [("prompt_mismatch", 30)]
    await pair.settle_releases()
    assert pair.p.connector.num_pinned_blocks == 0  # D will not read it: P frees at once


async def test_the_params_of_another_prompt_are_a_409_under_the_fail_policy():
    pair = Pair("fail")
    params = pair.p.prefill("r1", 30)
    with pytest.raises(KVTicketUnusable) as refused:
        await pair.admit(params, tuple(range(11, 41)))
    assert refused.value.status_code == 409 and not pair.inner.seen and not pair.recomputed


@pytest.mark.parametrize("change", [
    {"remote_request_id": "never-pinned"},
    {"remote_pin_nonce": "0" * 32},
])
async def test_an_unknown_pin_or_a_wrong_nonce_is_a_stale_ticket(change):
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    admitted = await pair.admit(params.model_copy(update=change))
    assert admitted.remote is None and pair.recomputed == [("stale_ticket", 30)] and not pair.inner.seen
    assert pair.p.connector.num_pinned_blocks > 0  # and the real pin is untouched


async def test_a_ticket_is_claimed_once_so_a_second_reader_never_reads_the_same_pin():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    first = await pair.admit(params)
    replay = await pair.admit(params)
    assert first.remote is not None and replay.remote is None
    assert pair.recomputed == [("stale_ticket", 30)] and len(pair.inner.seen) == 1


async def test_params_naming_an_earlier_start_of_the_prefill_worker_are_a_409_whatever_the_policy():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    with pytest.raises(KVParamsStale):  # P restarted between the legs: the proxy re-runs leg 1
        await pair.admit(params.model_copy(update={"remote_epoch": "an-earlier-start"}))
    assert not pair.recomputed and not pair.inner.seen


async def test_an_unreachable_prefill_worker_is_a_counted_local_prefill_and_then_skipped():
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    pair = Pair()
    pair.admission.client = TicketClient(None, http_transport=httpx.MockTransport(refuse))
    params = pair.p.prefill("r1", 30)
    assert (await pair.admit(params)).remote is None
    assert (await pair.admit(params)).remote is None
    assert pair.recomputed == [("pull_failed", 30)] * 2 and len(calls) == 1  # the second one skipped the dead peer


async def test_a_local_prefill_after_a_usable_ticket_keeps_ps_first_token():
    """The inner admission could not reach P's data path: D computes the prompt, and goes on from P's token 1
    (the engine makes it output token 1; the client may hold it already)."""
    pair = Pair()

    async def unreachable(request: GenerationRequest) -> GenerationRequest:
        return dataclasses.replace(request, kv_params=None, remote=None)

    pair.inner.admit = unreachable
    params = pair.p.prefill("r1", 30)
    request = GenerationRequest("d-req", tuple(range(10, 40)), SamplingParams(temperature=0), kv_params=params)
    admitted = await pair.admission.admit(request)
    assert admitted.remote is None and admitted.pd_recomputed
    assert admitted.first_token is not None and admitted.first_token.token_id == 5  # what PrefillSide samples
    assert pair.recomputed == [("pull_failed", 30)]


async def test_an_oversized_ticket_is_refused_without_reading_it_whole():
    def huge(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"x" * 4096)

    pair = Pair()
    pair.admission.client = TicketClient(None, http_transport=httpx.MockTransport(huge), max_bytes=1024)
    assert (await pair.admit(pair.p.prefill("r1", 30))).remote is None
    assert pair.recomputed == [("pull_failed", 30)]


async def test_the_release_route_frees_only_with_the_pins_nonce():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    body = {key: getattr(params, key) for key in
            ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=pair.app), base_url="http://p") as http:
        bare = await http.post(RELEASE_PATH, json={**body, "remote_pin_nonce": None})
        forged = await http.post(RELEASE_PATH, json={**body, "remote_pin_nonce": "0" * 32})
        pair.p.tick()
        assert bare.status_code == 400 and forged.status_code == 202 and pair.p.connector.num_pinned_blocks > 0
        unknown = await http.post(PIN_PATH, json={**body, "remote_pin_nonce": "0" * 32})
        stale = await http.post(PIN_PATH, json={**body, "remote_epoch": "another-start"})
        accepted = await http.post(RELEASE_PATH, json=body)
    pair.p.tick()
    assert unknown.status_code == 404 and stale.status_code == 409 and accepted.status_code == 202
    assert pair.p.connector.num_pinned_blocks == 0


async def test_the_first_token_comes_from_ps_ticket_never_from_the_clients_params():
    pair = Pair()
    params = pair.p.prefill("r1", 30)  # P sampled token 5
    forged = RemotePrefillParams.model_validate({**params.model_dump(), "first_token": {"token_id": 99}})
    sampling = SamplingParams(temperature=0)  # as P's leg drew it (PrefillSide.prefill)
    admitted = await pair.admission.admit(GenerationRequest("d-req", tuple(range(10, 40)), sampling, kv_params=forged))
    assert admitted.first_token is not None and admitted.first_token.token_id == 5


async def test_a_decode_leg_naming_other_sampling_than_ps_leg_computes_the_first_token_counted():
    pair = Pair()
    reasons: list[str] = []
    pair.admission.count_first_token_recompute = reasons.append
    params = pair.p.prefill("r1", 30)  # drawn greedily
    seeded = SamplingParams(temperature=0.8, seed=3)
    admitted = await pair.admission.admit(GenerationRequest("d-req", tuple(range(10, 40)), seeded, kv_params=params))
    assert admitted.remote is not None and admitted.first_token is None  # the KV is still pulled
    assert reasons == ["sampling_mismatch"]


async def test_a_grammar_request_takes_no_first_token_and_is_counted():
    pair = Pair()
    reasons: list[str] = []
    pair.admission.count_first_token_recompute = reasons.append
    params = pair.p.prefill("r1", 30)
    prompt = tuple(range(10, 40))
    admitted = await pair.admission.admit(GenerationRequest("d-req", prompt, SamplingParams(grammar="start: /a/"),
                                                            kv_params=params))
    assert admitted.remote is not None and admitted.first_token is None
    assert reasons == ["structured_output"]
