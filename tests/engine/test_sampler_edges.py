"""Sampling never fails a batch: every value the API accepts gives a token of the filtered distribution
(tiny and denormal temperatures, tiny top_p, huge top_k, any seed), and a row the sampler cannot draw
from fails alone."""

from __future__ import annotations

import types
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api.sampling import SamplingParams
from pdserve.runner.grammar_matchers import GrammarMatchers, bitmask_to_allowed
from pdserve.runner.logits_processors import adjust_logits
from pdserve.runner.sampler import Sampler, unpack_sampled
from pdserve.engine.schedule_types import ScheduledChunk

VOCAB = 64


def chunk(request_id: str, **params) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 0, ([1],), sample=True, sampling=SamplingParams(**params))


def logits_for(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-38, 1e-30])
def test_a_vanishing_temperature_is_the_argmax(temperature):
    logits = logits_for(6)
    chunks = [chunk(f"r{i}", temperature=temperature, seed=i if i % 2 else None) for i in range(6)]
    sampled = Sampler(torch.device("cpu")).sample(logits, chunks)
    assert [s.token_id for s in sampled] == logits.argmax(dim=-1).tolist()
    assert not any(s.failed for s in sampled)


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_top_token(top_p):
    logits = logits_for(4, seed=1)
    sampled = Sampler(torch.device("cpu")).sample(logits, [chunk(f"r{i}", temperature=1.5, top_p=top_p) for i in range(4)])
    assert [s.token_id for s in sampled] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 10**6, 2**63, 2**200])
def test_a_top_k_past_the_vocabulary_keeps_every_token(top_k):
    sampled = Sampler(torch.device("cpu")).sample(logits_for(3, 2), [chunk(f"r{i}", top_k=top_k, top_p=0.99)
                                                                     for i in range(3)])
    assert all(0 <= s.token_id < VOCAB and not s.failed for s in sampled)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1])
def test_any_seed_the_api_allows_draws_reproducibly(seed):
    logits = logits_for(1, 3)
    first = Sampler(torch.device("cpu")).sample(logits, [chunk("a", seed=seed)])[0].token_id
    again = Sampler(torch.device("cpu"), seed=99).sample(logits, [chunk("b", seed=seed)])[0].token_id
    assert first == again and 0 <= first < VOCAB


def test_a_row_its_grammar_leaves_no_token_fails_alone_and_keeps_the_others_logprobs():
    logits = logits_for(3, 9)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[1] = False  # a grammar that allows nothing
    allowed[2, :5] = False
    chunks = [chunk("free", temperature=0, logprobs=True, top_logprobs=2), chunk("dead", temperature=0.8),
              chunk("masked", temperature=0, logprobs=True)]
    sampled = Sampler(torch.device("cpu")).sample(logits, chunks, allowed)
    assert [s.failed for s in sampled] == [False, True, False]
    assert sampled[0].token_id == logits[0].argmax().item() and len(sampled[0].top_logprobs) == 2
    assert sampled[2].token_id == 5 + logits[2, 5:].argmax().item()
    assert sampled[2].logprob == pytest.approx(logits[2].log_softmax(-1)[sampled[2].token_id].item(), rel=1e-5)


def test_a_row_with_non_finite_logits_fails_alone():
    logits = logits_for(4, 4)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    chunks = [chunk("greedy", temperature=0), chunk("nan", temperature=0.8), chunk("random", temperature=0.8, seed=5),
              chunk("inf", temperature=0)]
    sampled = Sampler(torch.device("cpu")).sample(logits, chunks)
    assert [s.failed for s in sampled] == [False, True, False, True]
    assert sampled[0].token_id == logits[0].argmax().item()
    assert 0 <= sampled[2].token_id < VOCAB


params = st.fixed_dictionaries({
    "temperature": st.floats(min_value=0.0, max_value=2.0),  # the API's range, denormals included
    "top_p": st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    "top_k": st.one_of(st.just(0), st.integers(min_value=1, max_value=2**80)),
    "seed": st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**64 - 1)),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True),
    "logit_bias": st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0)), max_size=4).map(tuple),
})


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(params, min_size=1, max_size=6), logits_seed=st.integers(0, 2**16))
def test_every_accepted_parameter_mix_gives_valid_tokens(rows, logits_seed):
    logits = logits_for(len(rows), logits_seed)
    chunks = [chunk(f"r{i}", **p) for i, p in enumerate(rows)]
    sampled = Sampler(torch.device("cpu")).sample(logits, chunks)
    chosen_from = adjust_logits(logits, chunks)  # penalties and bias, as the sampler applies them
    for row, (token, p) in enumerate(zip(sampled, rows)):
        assert not token.failed and 0 <= token.token_id < VOCAB
        assert torch.isfinite(torch.tensor(token.logprob))
        if p["temperature"] < 1e-30:  # at or under the float32 floor the distribution is the argmax's
            assert token.token_id == chosen_from[row].argmax().item()


def test_grammar_masks_that_do_not_come_in_time_fail_only_the_grammar_rows_and_a_fresh_helper_takes_over():
    matchers = GrammarMatchers(types.SimpleNamespace(vocab_size=VOCAB), mask_timeout_s=0.01)
    stuck = Future()  # a helper thread that never answers
    chunks = [chunk("free", temperature=0), chunk("json", temperature=0, grammar="start: /[0-9]+/")]
    bitmask, late = matchers.result(stuck, chunks)
    assert late == [1]
    allowed = bitmask_to_allowed(bitmask, VOCAB, torch.device("cpu"))
    assert allowed[0].all() and not allowed[1].any()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    sampled = unpack_sampled(Sampler(torch.device("cpu")).sample_packed(logits, chunks, allowed).tolist(), chunks)
    assert not sampled[0].failed and sampled[0].token_id == int(logits[0].argmax())
    assert sampled[1].failed
    assert matchers._pool is None  # the stuck helper is abandoned; the next step starts another
