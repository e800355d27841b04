"""Both legs at once, decode side: a decode leg waits for P's params in the ticket inbox, bounded, and
leaves nothing behind when P fails before, during or after its admission, or when its own leg ends
while P computes. Meanwhile D's engine holds the blocks the prompt needs (a reservation awaiting its
ticket: engine/scheduler.py `take_ticket`), and the pull starts the moment the ticket is delivered;
every way the leg can end frees the reservation, and the free block counts come back to where they
were. Orders are forced (a delivery before or after the wait; a cancelled waiter), never raced against
the clock: the inbox's bound runs on a fake clock or a tiny wait where it is the subject."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from pdserve.api.kv_transfer import (AwaitedPrefillParams, FirstToken, KVParamsInvalid, KVPullFailed,
                                     KVTicketNotDelivered, parse_kv_transfer_params)
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.app.model_side import max_tokens_in_pool
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.engine.schedule_types import StepResult
from pdserve.metrics import Metrics
from pdserve.pd.ticket_inbox import Delivery, TicketInbox
from pdserve.pd.tickets import TicketAdmission, TicketClient
from pdserve.request import GenerationRequest, Request, RequestStatus
from pdserve.server.errors import install_error_handlers
from pdserve.server.kv_routes import RELEASE_PATH, TICKET_PATH, create_kv_router
from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import (NUM_BLOCKS, DecodeSide, FakeClock, InnerAdmission, PrefillSide, make_request,
                              source_for)

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



# ---- D's engine reserves the prompt's blocks while P computes -------------------------------------

def reserve(d: DecodeSide, request_id: str = "d-req", num_prompt: int = 30) -> Request:
    """The decode leg as D's engine gets it before its ticket: tokenized, no source yet."""
    request = make_request(request_id, num_prompt, awaited_ticket=KEY)
    d.scheduler.add_request(request)
    return request


def d_admit_s(d: DecodeSide) -> tuple[float, float]:
    """Samples and seconds of D's handoff component d_admit (verified source to READ start)."""
    [histogram] = [metric for metric in d.metrics.transfer.handoff_s.collect()]
    samples = {sample.name: sample.value for sample in histogram.samples if sample.labels.get("component") == "d_admit"}
    return samples.get("pdserve_pd_handoff_seconds_count", 0), samples.get("pdserve_pd_handoff_seconds_sum", 0.0)


def blocks_a_sequential_leg_allocates(clock, num_prompt: int) -> int:
    """What a decode leg admitted after its ticket holds, on a fresh P/D pair: the reference."""
    fabric = FakeFabric()
    p, other = PrefillSide(fabric, clock), DecodeSide(fabric, clock)
    assert other.connect(p) is None
    free_before = other.kv.num_free_blocks
    other.submit("ref", num_prompt, source_for(p, p.prefill("ref-p", num_prompt), clock()))
    other.scheduler.schedule()
    return free_before - other.kv.num_free_blocks


def test_d_reserves_its_blocks_while_p_computes_and_pulls_the_moment_the_ticket_comes(p, d, clock, fabric):
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    for _ in range(3):  # P computes: D holds the blocks and computes nothing for the request
        assert d.scheduler.schedule().chunks == []
        d.tick()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.scheduler.num_waiting_for_kv == 1
    assert free_before - d.kv.num_free_blocks == blocks_a_sequential_leg_allocates(clock, 30)
    assert d.connector.num_loading == 0
    params = p.prefill("r1", 30)
    first = FirstToken(token_id=5)
    assert d.scheduler.take_ticket("d-req", KEY, source_for(p, params, clock()), first, False)
    assert d.connector.num_loading == 1  # the READ started at the delivery, not at a later schedule()
    assert d_admit_s(d) == (1, 0.0)  # nothing left between the verified source and the READ
    d.tick()  # landed
    [(seeded, token)] = d.scheduler.take_first_tokens()
    assert seeded is request and token.token_id == 5 and request.output_token_ids == [5]
    [chunk] = d.scheduler.schedule().chunks
    assert (chunk.start_position, chunk.num_tokens) == (30, 1)  # a decode step: no prompt token computed here
    p.tick()
    assert p.connector.num_pinned_blocks == 0  # D told P it read the pin
    d.scheduler.finish("d-req", FinishReason.ABORT)
    assert d.kv.num_free_blocks == free_before
    d.kv.check_invariants()


def test_a_reserved_request_whose_ticket_comes_too_late_computes_its_prompt_from_ps_token(p, d, clock):
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    params = p.prefill("r1", 30)
    clock.advance(params.lease_s)  # the ticket comes after half P's lease: D may not read those pages
    assert d.scheduler.take_ticket("d-req", KEY, source_for(p, params, clock() - params.lease_s),
                                   FirstToken(token_id=5), False)
    assert d.connector.num_loading == 0 and request.status is RequestStatus.WAITING
    [chunk] = d.scheduler.schedule().chunks  # the prompt and P's token 1, drawing token 2
    assert request.output_token_ids == [5] and [t.token_id for _, t in d.scheduler.take_first_tokens()] == [5]
    assert (chunk.start_position, chunk.num_tokens, chunk.num_sampled_so_far) == (0, 31, 1)
    d.scheduler.finish("d-req", FinishReason.ABORT)
    assert d.kv.num_free_blocks == free_before
    d.kv.check_invariants()


def test_a_reservation_counts_against_the_pool_and_the_running_cap_for_others(p, fabric, clock):
    d = DecodeSide(fabric, clock, max_running=2)
    assert d.connect(p) is None
    free_before = d.kv.num_free_blocks
    reserve(d, "held", 120)  # 32 of the pool's 63 blocks (the sliding windows keep only their last blocks)
    big = reserve(d, "big", 120)  # 32 more do not fit: it waits behind the reservation, all or nothing
    local = make_request("local", 8)
    d.scheduler.add_request(local)
    assert d.scheduler.schedule().chunks == []
    assert big.status is RequestStatus.WAITING and local.status is RequestStatus.WAITING  # first come, first served
    d.scheduler.finish("held", FinishReason.ABORT)  # its leg ended: the blocks are back at once
    d.scheduler.schedule()
    assert big.status is RequestStatus.WAITING_FOR_REMOTE_KV
    capped = DecodeSide(FakeFabric(), clock, max_running=1)
    reserve(capped, "held", 8)
    other = make_request("other", 8)
    capped.scheduler.add_request(other)
    assert capped.scheduler.schedule().chunks == [] and other.status is RequestStatus.WAITING  # the cap is taken
    d.scheduler.finish("big", FinishReason.ABORT)
    d.scheduler.finish("local", FinishReason.ABORT)
    assert d.kv.num_free_blocks == free_before


def test_a_leg_that_ends_before_its_ticket_frees_the_reservation_at_once(d):
    """P failed (the proxy's call-off), the inbox's bound ran out, or D's leg closed: the async side
    aborts the request (engine/async_engine.py; tested below), and an abort is all the engine sees of each."""
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    d.scheduler.schedule()
    assert d.kv.num_free_blocks < free_before
    d.scheduler.finish("d-req", FinishReason.ABORT)
    assert request.finished and d.kv.num_free_blocks == free_before and d.scheduler.num_waiting_for_kv == 0
    assert d.scheduler.take_released_ids() == ["d-req"]
    assert not d.scheduler.take_ticket("d-req", KEY, None, None, False)  # a late delivery finds nobody


def test_a_ticket_that_ends_in_a_local_prefill_gives_the_reservation_back_and_computes_the_prompt(d):
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    d.scheduler.schedule()
    assert d.scheduler.take_ticket("d-req", KEY, None, None, True)  # admission chose to compute it here
    assert request.status is RequestStatus.WAITING and d.kv.num_free_blocks == free_before
    [chunk] = d.scheduler.schedule().chunks
    assert (chunk.start_position, chunk.num_tokens) == (0, 30) and request.pd_recomputed
    d.scheduler.finish("d-req", FinishReason.ABORT)
    assert d.kv.num_free_blocks == free_before


def test_a_ticket_for_a_leg_still_queued_is_kept_and_the_leg_pulls_once_admitted(p, fabric, clock):
    d = DecodeSide(fabric, clock, max_running=1)
    assert d.connect(p) is None
    free_before = d.kv.num_free_blocks
    first = make_request("first", 8)
    d.scheduler.add_request(first)
    d.scheduler.schedule()
    request = reserve(d)
    d.scheduler.schedule()
    assert request.status is RequestStatus.WAITING  # behind the running cap
    params = p.prefill("r1", 30)
    assert d.scheduler.take_ticket("d-req", KEY, source_for(p, params, clock()), None, False)
    assert request.status is RequestStatus.WAITING and d.connector.num_loading == 0
    clock.advance(0.25)  # it waits in D's queue with its ticket
    d.scheduler.finish("first", FinishReason.ABORT)
    d.scheduler.schedule()  # admitted as any decode leg with its source: the READ starts
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.connector.num_loading == 1
    assert d_admit_s(d) == (1, 0.25)  # the queue after the ticket, as the handoff component d_admit
    d.tick()
    [chunk] = d.scheduler.schedule().chunks
    assert (chunk.start_position, chunk.num_tokens) == (29, 1)  # no first token: D computes the last one
    d.scheduler.finish("d-req", FinishReason.ABORT)
    p.tick()
    assert d.kv.num_free_blocks == free_before and p.connector.num_pinned_blocks == 0


def test_a_stale_ticket_under_the_fail_policy_ends_the_leg_with_its_error_and_frees_both_sides(p, fabric, clock):
    d = DecodeSide(fabric, clock, policy="fail")
    assert d.connect(p) is None
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    d.scheduler.schedule()
    params = p.prefill("r1", 30)
    source = source_for(p, params, clock())
    clock.advance(params.lease_s)  # the ticket came too late to trust P's pages
    assert d.scheduler.take_ticket("d-req", KEY, source, None, False)
    [ended] = d.scheduler.take_ended()
    assert ended is request and isinstance(request.error, KVPullFailed) and request.finished
    p.tick()
    assert d.kv.num_free_blocks == free_before and p.connector.num_pinned_blocks == 0


def test_p_failing_under_the_pull_of_a_reserved_leg_recomputes_it_and_frees_everything(p, d, clock, fabric):
    free_before = d.kv.num_free_blocks
    request = reserve(d)
    d.scheduler.schedule()
    params = p.prefill("r1", 30)
    d.transport.fail_reads = True
    fabric.kill("P")
    d.scheduler.take_ticket("d-req", KEY, source_for(p, params, clock()), None, False)
    d.tick()
    assert request.status is RequestStatus.WAITING and request.pd_recomputed
    d.scheduler.finish("d-req", FinishReason.ABORT)
    d.tick()
    assert d.kv.num_free_blocks == free_before and not d.connector.has_pending()


def test_a_ticket_under_another_key_is_not_this_requests(d):
    request = reserve(d)
    d.scheduler.schedule()
    assert not d.scheduler.take_ticket("d-req", "f" * 32, None, None, True)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and request.awaited_ticket == KEY


# ---- the async side: the leg enters the engine before its wait; an error or a cancel aborts it -------

class RecordingLoop:
    """The engine loop as the async side sees it: what it was asked, in order."""

    def __init__(self):
        self.request_ids = RequestIdRegistry()
        self.calls: list[tuple] = []

    def submit(self, request, sink) -> None:
        self.calls.append(("submit", request))

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    def deliver_ticket(self, key: str, admitted) -> None:
        self.calls.append(("ticket", key, admitted))

    def is_alive(self) -> bool:
        return True


def leg_through_the_engine(legs: Legs):
    """The decode leg's stream as D's HTTP layer drives it: the first output asked for."""
    loop = RecordingLoop()
    engine = AsyncEngine(loop, "m", 1000, None, 8, legs.admission, reserves_before_ticket=True)
    params = parse_kv_transfer_params({"do_remote_prefill": True, "awaited_ticket": KEY})
    stream = engine.generate(GenerationRequest("d-req", PROMPT, SamplingParams(temperature=0), kv_params=params))
    return loop, engine, stream, asyncio.ensure_future(stream.__anext__())


async def test_the_leg_enters_the_engine_before_its_wait_and_its_ticket_follows_through_the_engine_thread(p):
    legs = Legs(p)
    loop, engine, stream, first_output = leg_through_the_engine(legs)
    await until_waiting(legs.inbox)
    [(what, reserved)] = loop.calls  # before any ticket: the engine reserves its blocks meanwhile
    assert what == "submit"
    assert reserved.awaited_ticket == KEY and reserved.kv_params is None and reserved.remote is None
    await legs.deliver(p.prefill("r1", 30))
    for _ in range(1000):  # forced order: until the claim from P went through
        if len(loop.calls) == 2:
            break
        await asyncio.sleep(0)
    [_, (what, key, admitted)] = loop.calls
    assert what == "ticket" and key == KEY and admitted.remote is not None and admitted.first_token.token_id == 5
    first_output.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first_output


@pytest.mark.parametrize("how", ["called_off_first", "called_off", "timed_out", "leg_closed"])
async def test_a_leg_ended_before_its_ticket_aborts_its_reservation_with_todays_error(p, how):
    legs = Legs(p, wait_s=0.01 if how == "timed_out" else 60.0)  # the bound itself is the subject there
    if how == "called_off_first":
        await legs.deliver(None)  # P failed before D's leg arrived
    loop, engine, stream, first_output = leg_through_the_engine(legs)
    if how == "called_off":
        await until_waiting(legs.inbox)
        await legs.deliver(None)  # P failed
    elif how == "leg_closed":
        await until_waiting(legs.inbox)
        first_output.cancel()  # the proxy closed D's leg
    expected = asyncio.CancelledError if how == "leg_closed" else KVTicketNotDelivered
    with pytest.raises(expected):
        await first_output
    assert [call[0] for call in loop.calls] == ["submit", "abort"] and loop.calls[1][1] == "d-req"
    await stream.aclose()
    assert len(loop.calls) == 2 and engine.num_in_flight == 0 and legs.inbox.num_slots == 0


def test_a_ticket_for_a_leg_that_ended_meanwhile_frees_ps_pin_at_once(p, d, clock):
    params = p.prefill("r1", 30)
    assert p.connector.num_pinned_blocks > 0
    loop = EngineLoop(d.scheduler, None, None, (0,), None)
    admitted = GenerationRequest("gone", PROMPT, SamplingParams(), remote=source_for(p, params, clock()))
    loop._take_ticket(KEY, admitted)  # what deliver_ticket runs on the engine thread
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not d.connector.has_pending()


class IdleRunner:
    """A runner for steps that compute nothing (a reservation's)."""

    cancellable = False
    replays_failed_steps = False

    def execute(self, scheduled):  # noqa: ANN001
        assert not scheduled.chunks
        return StepResult()

    def synchronize(self) -> None:
        pass


class RecordingShare:
    """The core ledger as D's loop writes it (engine/core_share.py): busy or not, per write."""

    def __init__(self):
        self.published: list[bool] = []

    def before_step(self, busy: bool) -> None:
        self.published.append(busy)

    def publish(self, busy: bool) -> None:
        self.published.append(busy)


def test_a_reservation_is_no_work_for_the_cores_so_p_keeps_them_while_it_computes(p, d, clock):
    share = RecordingShare()
    stats = type("Stats", (), {"record_step": lambda *args: None})()
    loop = EngineLoop(d.scheduler, IdleRunner(), None, (0,), stats, core_share=share)
    reserve(d)
    assert loop.step()  # the reservation was made: progress
    assert d.scheduler.num_waiting_for_kv == 1
    # D says idle before the admission too (the leg queued for its reservation): a busy-then-idle flap
    # within the step would narrow P if P read the byte in between.
    assert share.published == [False, False]
    params = p.prefill("r1", 30)
    loop._take_ticket(KEY, GenerationRequest("d-req", PROMPT, SamplingParams(), remote=source_for(p, params, clock())))
    assert loop._queue_sizes() == (0, 1, 0, 0, 0)  # the pull is work again


def test_a_fault_while_taking_a_ticket_fails_that_request_only_and_frees_its_blocks(p, d, clock, monkeypatch):
    free_before = d.kv.num_free_blocks
    failed: list = []
    emitter = type("Emitter", (), {"emit_final": lambda self, request: failed.append(request),
                                   "fail": lambda self, request_id, error: None})()
    loop = EngineLoop(d.scheduler, None, emitter, (0,), None)
    request = reserve(d)
    d.scheduler.schedule()
    monkeypatch.setattr(d.connector, "start_pull", lambda *args: 1 / 0)  # a bug on the engine thread
    loop._take_ticket(KEY, GenerationRequest("d-req", PROMPT, SamplingParams(),
                                             remote=source_for(p, p.prefill("r1", 30), clock())))
    assert failed == [request] and request.finish_reason is FinishReason.ERROR  # the loop lives on
    p.tick()
    assert d.kv.num_free_blocks == free_before and p.connector.num_pinned_blocks == 0


def test_every_prompt_the_edge_lets_through_can_be_reserved_on_an_idle_decode_worker(d):
    """A prompt D's pool cannot hold is refused before the wait, as before: the worker caps its context
    (max_model_len, checked when the request is parsed) at the longest prompt its pool holds, and that
    any prompt up to it has a reservation that fits an idle pool: none can wait at the head for ever."""
    longest = max_tokens_in_pool(d.plan, NUM_BLOCKS, d.block_size)
    free_before = d.kv.num_free_blocks
    for num_prompt in range(1, longest + 1):
        request = reserve(d, f"r{num_prompt}", num_prompt)
        d.scheduler.schedule()
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV, num_prompt
        d.scheduler.finish(request.request_id, FinishReason.ABORT)
        assert d.kv.num_free_blocks == free_before
