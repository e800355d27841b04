"""The engine on the embedded SmolLM2 against transformers, through the paged pool."""

from __future__ import annotations

import pytest

from pdserve.models.loader import load_model
from tests.engine.harness import generate, generate_one_by_one, greedy, make_engine
from tests.models.hf_oracle import hf_greedy_generate

import torch

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three prime numbers and say why they are prime.",
]
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def chat_prompts(loaded):
    tokenizer = loaded.tokenizer
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_answers(chat_prompts, hf_smollm2_model):
    return [hf_greedy_generate(hf_smollm2_model, prompt, NUM_TOKENS) for prompt in chat_prompts]


def test_batched_greedy_matches_transformers_token_for_token(loaded, chat_prompts, hf_answers):
    engine = make_engine(loaded=loaded)
    results = generate(engine, chat_prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for result, expected in zip(results, hf_answers):
        assert result.token_ids == expected
        assert result.final.finish_reason.value == "length"


def test_chunked_prefill_over_many_blocks_matches_transformers(loaded, chat_prompts, hf_answers):
    # Budget 24 < every prompt, block size 8: prompts span several blocks and
    # are prefilled over several steps while other requests decode.
    engine = make_engine(loaded=loaded, block_size=8, budget=24)
    results = generate(engine, chat_prompts, greedy(NUM_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in results] == hf_answers


def test_batched_and_sequential_runs_give_identical_outputs(loaded, chat_prompts):
    engine = make_engine(loaded=loaded, prefix_caching=False)
    batched = generate(engine, chat_prompts, greedy(NUM_TOKENS, ignore_eos=True))
    sequential = generate_one_by_one(engine, chat_prompts, greedy(NUM_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in batched] == [r.token_ids for r in sequential]


def test_preemption_under_tiny_pool_gives_identical_outputs(loaded, chat_prompts, hf_answers):
    # 4 requests of ~40 prompt + 40 generated tokens need ~20 blocks of 16 each
    # at the end; 12 usable blocks force preemption and recomputation.
    engine = make_engine(loaded=loaded, num_blocks=13)
    results = generate(engine, chat_prompts, greedy(NUM_TOKENS, ignore_eos=True))
    preemptions = engine.engine.engine_loop.stats.metrics.scheduler.preemptions._value.get()
    assert preemptions > 0
    assert [r.token_ids for r in results] == hf_answers


def test_prefix_cache_hit_gives_identical_outputs_and_computes_fewer_prompt_tokens(loaded, chat_prompts):
    system = "You are a careful assistant. " * 12  # a long shared prefix (several blocks)
    tokenizer = loaded.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS[:2]
    ]
    cold = make_engine(loaded=loaded, prefix_caching=False)
    expected = generate_one_by_one(cold, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    warm = make_engine(loaded=loaded)
    first = generate(warm, [prompts[0]], greedy(NUM_TOKENS, ignore_eos=True), prefix="first")[0]
    computed_before = warm.engine.engine_loop.stats.num_computed_prompt_tokens
    second = generate(warm, [prompts[1]], greedy(NUM_TOKENS, ignore_eos=True), prefix="second")[0]
    computed_second = warm.engine.engine_loop.stats.num_computed_prompt_tokens - computed_before
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in expected]
    assert second.final.num_cached_tokens >= 16 * 4  # the shared system prompt, whole blocks only
    assert computed_second == len(prompts[1]) - second.final.num_cached_tokens
    assert computed_second < len(prompts[1]) / 2
