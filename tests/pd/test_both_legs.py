"""Both legs at once, decode side: a decode leg waits for P's params in the ticket inbox, bounded, and
leaves nothing behind when P fails before, during or after its admission, or when its own leg ends
while P computes. Orders are forced (a delivery before or after the wait; a cancelled waiter), never
raced against the clock: the inbox's bound runs on a fake clock or a tiny wait where it is the subject."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from pdserve.api.kv_transfer import (AwaitedPrefillParams, KVParamsInvalid, KVTicketNotDelivered,
                                     parse_kv_transfer_params)
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.metrics import Metrics
from pdserve.pd.ticket_inbox import Delivery, TicketInbox
from pdserve.pd.tickets import TicketAdmission, TicketClient
from pdserve.request import GenerationRequest, RequestStatus
from pdserve.server.errors import install_error_handlers
from pdserve.server.kv_routes import RELEASE_PATH, TICKET_PATH, create_kv_router
from tests.pd.pd_pair import FakeClock, InnerAdmission, source_for

pytestmark = pytest.mark.anyio
KEY = "c0ffee" * 5 + "00"  # 32 hex digits, as the proxy makes them
PROMPT = tuple(range(10, 40))  # the 30 tokens PrefillSide.prefill computes


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Legs:
    """P's internal routes (claim, release) and D's (ticket delivery) over ASGI, and D's ticket admission."""

    def __init__(self, p, wait_s: float = 60.0):
        self.p = p
        p_app = FastAPI()
        install_error_handlers(p_app, Metrics().request)
        p_app.include_router(create_kv_router(p.agent_info, None, p.connector.release_early, p.connector.claim_ticket))
        self.p_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=p_app), base_url="http://p")
        self.inbox = TicketInbox(wait_s)
        self.inner = InnerAdmission()
        self.admission = TicketAdmission(self.inner, TicketClient(None, http_transport=httpx.ASGITransport(app=p_app)),
                                         "recompute", inbox=self.inbox)
        d_app = FastAPI()
        install_error_handlers(d_app, Metrics().request)
        d_app.include_router(create_kv_router(lambda: None, None, deliver=self.inbox.deliver))
        self.d_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=d_app), base_url="http://d")

    def decode_leg(self) -> "asyncio.Task[GenerationRequest]":
        """D's side of the decode leg the proxy sent with the prefill leg: parsed, then admitted (waits)."""
        params = parse_kv_transfer_params({"do_remote_prefill": True, "awaited_ticket": KEY})
        assert isinstance(params, AwaitedPrefillParams)
        request = GenerationRequest("d-req", PROMPT, SamplingParams(temperature=0), kv_params=params)
        return asyncio.ensure_future(self.admission.admit(request))

    async def deliver(self, params) -> httpx.Response:
        wire = params.model_dump() if params is not None else None
        return await self.d_http.post(TICKET_PATH, json={"awaited_ticket": KEY, "kv_transfer_params": wire})

    async def release(self, params) -> httpx.Response:  # the proxy's release of a pin no decode worker reads
        body = {key: getattr(params, key) for key in
                ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")}
        return await self.p_http.post(RELEASE_PATH, json=body)


async def until_waiting(inbox: TicketInbox) -> None:
    """Let the decode leg's task run until it waits in the inbox (a forced order, not a timed one)."""
    for _ in range(1000):
        if inbox.num_waiting:
            return
        await asyncio.sleep(0)
    raise AssertionError("the decode leg never waited for its ticket")


# ---- the inbox ---------------------------------------------------------------------------------

async def test_a_ticket_delivered_before_or_after_the_wait_reaches_the_leg_once():
    inbox = TicketInbox(wait_s=60)
    assert inbox.deliver("a" * 32, {"n": 1}) is Delivery.ACCEPTED  # P answered before D's leg got here
    assert inbox.deliver("a" * 32, {"n": 2}) is Delivery.DUPLICATE
    assert await inbox.wait("a" * 32) == {"n": 1} and inbox.num_slots == 0
    waiter = asyncio.ensure_future(inbox.wait("b" * 32))
    await until_waiting(inbox)
    assert inbox.deliver("b" * 32, {"n": 3}) is Delivery.ACCEPTED
    assert await waiter == {"n": 3} and inbox.num_slots == 0


async def test_a_call_off_a_timeout_and_a_second_wait_end_the_leg_and_leave_no_slot():
    inbox = TicketInbox(wait_s=60)
    waiter = asyncio.ensure_future(inbox.wait("a" * 32))
    await until_waiting(inbox)
    with pytest.raises(KVTicketNotDelivered):
        await inbox.wait("a" * 32)  # one leg per key
    inbox.deliver("a" * 32, None)
    with pytest.raises(KVTicketNotDelivered, match="called the decode leg off"):
        await waiter
    short = TicketInbox(wait_s=0.01)  # the bound itself is the subject here
    with pytest.raises(KVTicketNotDelivered, match="within"):
        await short.wait("c" * 32)
    assert inbox.num_slots == 0 and short.num_slots == 0


async def test_a_cancelled_leg_frees_its_slot_and_unclaimed_deliveries_expire_within_the_bound():
    clock = FakeClock()
    inbox = TicketInbox(wait_s=5, max_slots=2, clock=clock)
    waiter = asyncio.ensure_future(inbox.wait("a" * 32))
    await until_waiting(inbox)
    waiter.cancel()  # the proxy closed the leg (its client left, or P failed)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert inbox.num_slots == 0
    inbox.deliver("b" * 32, {})
    inbox.deliver("c" * 32, {})
    assert inbox.deliver("d" * 32, {}) is Delivery.FULL  # bounded: refused, never queued
    clock.advance(6)  # nobody came for them within the bound
    assert inbox.deliver("d" * 32, {}) is Delivery.ACCEPTED and inbox.num_slots == 1


# ---- the legs, P failing before, during and after D's admission; D's leg ending while P computes --------

async def test_the_delivered_params_are_a_ticket_claimed_from_p_like_a_sequential_legs(p):
    legs = Legs(p)
    leg = legs.decode_leg()
    await until_waiting(legs.inbox)  # D parsed and tokenized; P computes
    params = p.prefill("r1", 30)
    forged_blocks = [list(reversed(ids)) for ids in params.remote_block_ids]
    answer = await legs.deliver(params.model_copy(update={"remote_block_ids": forged_blocks}))
    assert answer.status_code == 202
    admitted = await leg
    [seen] = legs.inner.seen
    assert admitted.remote is not None and seen.kv_params.remote_block_ids == params.remote_block_ids  # P's own
    assert seen.first_token is not None and seen.first_token.token_id == 5  # P's first token, from its ticket
    assert legs.inbox.num_slots == 0


async def test_p_failing_before_ds_leg_arrives_ends_it_at_once_with_nothing_held(p):
    legs = Legs(p)
    assert (await legs.deliver(None)).status_code == 202  # the proxy's call-off came first
    with pytest.raises(KVTicketNotDelivered):
        await legs.decode_leg()
    assert legs.inbox.num_slots == 0 and not legs.inner.seen and p.connector.num_pinned_blocks == 0


async def test_p_failing_while_d_waits_ends_the_wait_at_once_with_nothing_held(p):
    legs = Legs(p)
    leg = legs.decode_leg()
    await until_waiting(legs.inbox)
    assert (await legs.deliver(None)).status_code == 202
    with pytest.raises(KVTicketNotDelivered):
        await leg
    assert legs.inbox.num_slots == 0 and not legs.inner.seen and p.connector.num_pinned_blocks == 0


async def test_p_failing_after_ds_admission_recomputes_on_d_and_frees_everything(p, d, clock, fabric):
    legs = Legs(p)
    leg = legs.decode_leg()
    await until_waiting(legs.inbox)
    params = p.prefill("r1", 30)
    await legs.deliver(params)
    await leg
    free_before = d.kv.num_free_blocks
    [seen] = legs.inner.seen
    request = d.submit("d-req", 30, source_for(p, seen.kv_params, clock()))
    d.scheduler.schedule()  # D's engine reserves its blocks and starts the READ
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.kv.num_free_blocks < free_before
    d.transport.fail_reads = True  # P dies under the pull
    fabric.kill("P")
    d.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0  # computed locally
    d.scheduler.finish(request.request_id, FinishReason.ABORT)  # its client leaves: D frees all of it
    d.tick()
    assert d.kv.num_free_blocks == free_before and not d.connector.has_pending() and legs.inbox.num_slots == 0
    d.kv.check_invariants()


async def test_ds_leg_ending_while_p_computes_leaves_no_slot_and_the_proxy_frees_ps_pin(p):
    legs = Legs(p)
    leg = legs.decode_leg()
    await until_waiting(legs.inbox)
    leg.cancel()  # D's client (the proxy) went away, or D's leg failed: its wait ends with it
    with pytest.raises(asyncio.CancelledError):
        await leg
    assert legs.inbox.num_slots == 0
    params = p.prefill("r1", 30)  # P finishes regardless and pins
    assert p.connector.num_pinned_blocks > 0
    assert (await legs.release(params)).status_code == 202  # proxy/kv_release.py: no decode worker reads it
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")


async def test_a_delivery_that_names_no_pin_is_refused_at_the_route_and_the_leg_keeps_waiting(p):
    legs = Legs(p)
    leg = legs.decode_leg()
    await until_waiting(legs.inbox)
    refused = await legs.d_http.post(TICKET_PATH, json={"awaited_ticket": KEY,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert refused.status_code == 400 and legs.inbox.num_waiting == 1
    leg.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leg


async def test_a_worker_without_an_inbox_refuses_awaited_params_by_name():
    admission = TicketAdmission(InnerAdmission(), TicketClient(None), "recompute")
    params = parse_kv_transfer_params({"do_remote_prefill": True, "awaited_ticket": KEY})
    with pytest.raises(KVParamsInvalid, match="awaited_ticket"):
        await admission.admit(GenerationRequest("d-req", PROMPT, SamplingParams(), kv_params=params))

