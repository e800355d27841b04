"""The first token from P (protocol 7) over the fake transport: P's ticket carries the token it sampled;
D, given it, pulls every prompt token's KV, makes it output token 1 and starts with a decode step;
where D may not start from it (pd/first_token.py), D computes it, counted by reason; where the pull fails, D
computes the prompt and goes on from P's token."""

from __future__ import annotations

from typing import Optional

import pytest

from pdserve.api.kv_transfer import FirstToken, PinTicket, prompt_digest
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.pd.first_token import first_draw_key, usable_first_token
from pdserve.pd.geometry import handoff_ranges, handoff_slices
from pdserve.request import RequestStatus
from tests.pd.pd_pair import BLOCK, PLAN, DecodeSide, FakeClock, PrefillSide, make_request, source_for

FIRST_TOKEN_ID = 5  # what PrefillSide.prefill samples


def ticket_of(p: PrefillSide, params) -> PinTicket:
    claim = p.connector.claim_ticket(params.remote_request_id, params.remote_pin_nonce)
    assert claim.ticket is not None
    return claim.ticket


def admit_with_first_token(d: DecodeSide, p: PrefillSide, clock: FakeClock, request_id: str, num_prompt: int,
                           params, first_token: Optional[FirstToken], sampling: Optional[SamplingParams] = None):
    request = make_request(request_id, num_prompt, sampling=sampling, remote=source_for(p, params, clock()),
                           first_token=first_token)
    d.scheduler.add_request(request)
    d.scheduler.schedule()
    return request


def first_token_counts(d: DecodeSide, reason: str) -> tuple[float, float]:
    transfer = d.metrics.transfer
    return transfer.first_token_from_prefill._value.get(), transfer.first_token_recomputed.labels(reason=reason)._value.get()


def test_ps_ticket_carries_the_token_it_sampled_and_no_logprob_unasked(p):
    params = p.prefill("r1", 29)
    first = ticket_of(p, params).first_token
    assert first.token_id == FIRST_TOKEN_ID
    assert first.sampling_sha256 == first_draw_key(SamplingParams(temperature=0))  # max_tokens is not in it
    assert first.logprob is None and first.top_logprobs == []


def test_ps_ticket_carries_the_first_tokens_logprobs_when_asked(p):
    sampling = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=2)
    request = make_request("r1", 9, sampling=sampling, remote_decode=True)
    p.scheduler.add_request(request)
    step = p.scheduler.schedule()
    p.scheduler.update(step, [SampledToken("r1", 7, -0.25, ((7, -0.25), (3, -1.5)))])
    first = ticket_of(p, request.kv_transfer_params).first_token
    assert (first.token_id, first.logprob, first.num_top_logprobs) == (7, -0.25, 2)
    assert [tuple(entry) for entry in first.top_logprobs] == [(7, -0.25), (3, -1.5)]


@pytest.mark.parametrize("num_prompt", [29, 32], ids=["last-block-holds-one-token", "last-block-full"])
def test_decode_starts_from_ps_token_with_every_prompt_page_pulled(p, d, clock, num_prompt):
    params = p.prefill("r1", num_prompt)
    request = admit_with_first_token(d, p, clock, "r1-d", num_prompt, params, ticket_of(p, params).first_token)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and request.output_token_ids == []
    d.tick()
    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == num_prompt and request.output_token_ids == [FIRST_TOKEN_ID]
    [(seeded, token)] = d.scheduler.take_first_tokens()
    assert seeded is request and token.token_id == FIRST_TOKEN_ID
    # Every handed-over page came across, the last (partial) block's included.
    local = handoff_slices(d.kv.block_ids("r1-d"), handoff_ranges(PLAN, num_prompt, BLOCK))
    for local_ids, remote_ids in zip(local, params.remote_block_ids):
        assert [int(d.pool[block_id][0]) for block_id in local_ids] == remote_ids
    step = d.scheduler.schedule()  # a decode step: token 1 at position P, drawing with index 1
    [chunk] = step.chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (num_prompt, 1, True)
    assert chunk.token_ids == [FIRST_TOKEN_ID] and chunk.num_sampled_so_far == 1
    assert first_token_counts(d, "pull_failed") == (1, 0)
    d.kv.check_invariants()


def test_a_one_token_answer_ends_when_the_pull_lands_and_frees_everything(p, d, clock):
    params = p.prefill("r1", 29)
    request = admit_with_first_token(d, p, clock, "r1-d", 29, params, ticket_of(p, params).first_token,
                                     SamplingParams(max_tokens=1, temperature=0))
    d.tick()
    assert request.finish_reason is FinishReason.LENGTH and request.output_token_ids == [FIRST_TOKEN_ID]
    assert [seeded for seeded, _ in d.scheduler.take_first_tokens()] == [request]
    assert not d.kv.has_request("r1-d") and d.scheduler.schedule().chunks == []
    p.tick()
    assert p.connector.num_pinned_blocks == 0
    d.kv.check_invariants()


def test_ps_token_meets_the_stop_token_ids(p, d, clock):
    params = p.prefill("r1", 29)
    request = admit_with_first_token(d, p, clock, "r1-d", 29, params, ticket_of(p, params).first_token,
                                     SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(FIRST_TOKEN_ID,)))
    d.tick()
    assert request.finish_reason is FinishReason.STOP


def test_a_failed_pull_computes_the_prompt_here_and_goes_on_from_ps_token(p, d, clock):
    params = p.prefill("r1", 29)
    d.transport.fail_reads = True
    request = admit_with_first_token(d, p, clock, "r1-d", 29, params, ticket_of(p, params).first_token)
    d.tick()
    assert request.status is RequestStatus.WAITING and request.output_token_ids == []
    step = d.scheduler.schedule()
    # P's token is output token 1 at once; the prefill computes the prompt and token 1, and draws token 2.
    assert request.output_token_ids == [FIRST_TOKEN_ID]
    assert [(seeded, token.token_id) for seeded, token in d.scheduler.take_first_tokens()] == [
        (request, FIRST_TOKEN_ID)]
    [chunk] = step.chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (0, 30, True)
    assert chunk.token_ids[-1] == FIRST_TOKEN_ID and chunk.num_sampled_so_far == 1  # draw 1, as after a pull
    assert first_token_counts(d, "no_first_token") == (0, 0)  # neither started from pulled pages nor recomputed
    assert d.metrics.transfer.recomputed_prompt_tokens.labels(reason="pull_failed")._value.get() == 29
    d.kv.check_invariants()


def test_a_stale_ticket_with_a_one_token_answer_ends_on_ps_token_without_computing(p, d, clock):
    params = p.prefill("r1", 29)
    request = make_request("r1-d", 29, sampling=SamplingParams(max_tokens=1, temperature=0),
                           remote=source_for(p, params, clock()), first_token=ticket_of(p, params).first_token)
    d.scheduler.add_request(request)
    clock.advance(params.lease_s)  # past half P's lease before the pull: D may not read those pages
    step = d.scheduler.schedule()
    assert step.chunks == [] and request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [FIRST_TOKEN_ID] and not d.kv.has_request("r1-d")
    assert [seeded for seeded, _ in d.scheduler.take_first_tokens()] == [request]
    assert d.metrics.transfer.recomputed_prompt_tokens.labels(reason="stale_ticket")._value.get() == 29
    d.kv.check_invariants()


def test_without_a_first_token_decode_computes_the_last_prompt_token_as_before(p, d, clock):
    params = p.prefill("r1", 29)
    request = admit_with_first_token(d, p, clock, "r1-d", 29, params, None)
    d.tick()
    assert request.num_computed_tokens == 28 and request.output_token_ids == []
    [chunk] = d.scheduler.schedule().chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.num_sampled_so_far) == (28, 1, 0)


def _ticket(first: Optional[FirstToken]) -> PinTicket:
    return PinTicket(request_id="r", block_ids=[[1]], num_prompt_tokens=1, prompt_sha256=prompt_digest([1]),
                     lease_left_s=1.0, first_token=first)


def _first(sampling: SamplingParams, **fields) -> FirstToken:
    """A first token P drew under `sampling`."""
    return FirstToken(token_id=3, sampling_sha256=first_draw_key(sampling), **fields)


SEEDED = SamplingParams(temperature=0.8, seed=7, presence_penalty=1.0)
LOGPROBS = SamplingParams(logprobs=True, top_logprobs=2)


@pytest.mark.parametrize("first, sampling, takes, reason", [
    (None, SamplingParams(), True, "no_first_token"),
    (_first(SamplingParams()), SamplingParams(), False, "recurrent_state"),
    (_first(SamplingParams()), SamplingParams(grammar="start: /a/"), True, "structured_output"),
    (_first(SamplingParams()), SamplingParams(logprobs=True), True, "logprobs_mismatch"),
    (_first(LOGPROBS, logprob=-1.0), LOGPROBS, True, "logprobs_mismatch"),  # P recorded no alternatives
    (_first(SEEDED), SamplingParams(temperature=0.8, seed=8, presence_penalty=1.0), True, "sampling_mismatch"),
    (_first(SEEDED), SamplingParams(temperature=0.8, seed=7), True, "sampling_mismatch"),
    # A proxy that dropped min_tokens from P's leg: P's draw could have been a stop token D's may not be.
    (_first(SamplingParams()), SamplingParams(min_tokens=2), True, "sampling_mismatch"),
    (FirstToken(token_id=3), SamplingParams(), True, "sampling_mismatch"),  # no key: nothing to compare
])
def test_decode_computes_the_first_token_where_ps_cannot_be_continued(first, sampling, takes, reason):
    assert usable_first_token(_ticket(first), sampling, takes) == (None, reason)


@pytest.mark.parametrize("first, sampling", [
    (_first(SEEDED), SamplingParams(max_tokens=50, temperature=0.8, seed=7, presence_penalty=1.0)),
    (_first(SamplingParams(min_tokens=1)), SamplingParams(min_tokens=5)),  # either way a stop is banned at draw 0
    (_first(LOGPROBS, logprob=-1.0, num_top_logprobs=2, top_logprobs=[(3, -1.0), (4, -2.0)]), LOGPROBS),
])
def test_decode_takes_ps_first_token_when_it_can_continue_it(first, sampling):
    assert usable_first_token(_ticket(first), sampling, True) == (first, None)


def test_a_first_token_of_the_wrong_type_makes_the_ticket_malformed():
    with pytest.raises(ValueError):
        PinTicket.model_validate({**_ticket(None).model_dump(), "first_token": {"token_id": "3"}})
