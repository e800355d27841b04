"""Penalties, logit bias, top logprobs and grammar masks in the batched sampler, checked against
reference implementations written here on the same logits (one row at a time, plain Python loops)."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from pdserve.engine.logits_processors import adjust_logits
from pdserve.engine.sampler import Sampler
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.grammar.compiler import compile_constraint
from pdserve.grammar.matchers import bitmask_to_allowed
from pdserve.request import SamplingParams
from pdserve.structured_protocol import OutputConstraint

VOCAB = 40


def chunk(request_id: str, prompt=(1, 2, 3), output=(), **params) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 0, ([1],), sample=True, sampling=SamplingParams(**params),
                          num_sampled_so_far=len(output), num_prompt_tokens=len(prompt),
                          prompt_token_ids=list(prompt), output_token_ids=list(output))


def reference_adjusted(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """OpenAI's presence/frequency penalties on generated tokens, HF's repetition penalty on prompt and
    generated tokens, then the bias: one token at a time."""
    row = logits.clone()
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            row[token] = row[token] / params.repetition_penalty if row[token] > 0 else row[token] * params.repetition_penalty
    for token, bias in params.logit_bias:
        row[token] += bias
    return row


CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-0.5, frequency_penalty=2.0),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=0.3),
    dict(logit_bias=((4, 9.0), (7, -100.0))),
    dict(),
]


def test_penalties_and_bias_match_the_reference_row_by_row(device):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(len(CASES), VOCAB, generator=generator) * 3)
    histories = [([1, 5, 5, 9], [5, 9, 9, 9, 12]), ([2, 3], [3, 3, 4]), ([0], [8, 8]), ([6, 7, 8], [7, 30]),
                 ([1, 2], [2, 11, 11]), ([4], []), ([1], [1, 1])]
    chunks = [chunk(f"r{i}", prompt, output, temperature=0, **case)
              for i, (case, (prompt, output)) in enumerate(zip(CASES, histories))]
    sampled = Sampler(torch.device(device)).sample(logits.to(device), chunks)
    for row, (case_chunk, (prompt, output)) in enumerate(zip(chunks, histories)):
        expected = reference_adjusted(logits[row], case_chunk.sampling, prompt, output)
        assert sampled[row].token_id == expected.argmax().item(), f"row {row}: {case_chunk.sampling}"
        # The adjustment itself, not only its argmax:

        adjusted = adjust_logits(logits.to(device), chunks)[row].cpu()
        torch.testing.assert_close(adjusted, expected, rtol=0, atol=1e-5)


def test_rows_without_adjustments_keep_their_logits_and_logprobs_stay_unadjusted(device):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    chunks = [chunk("plain", temperature=0, logprobs=True),
              chunk("biased", temperature=0, logprobs=True, logit_bias=((3, 50.0),))]
    sampled = Sampler(torch.device(device)).sample(logits, chunks)
    assert sampled[0].token_id == logits[0].argmax().item()
    assert sampled[1].token_id == 3
    log_probs = logits.double().log_softmax(-1).cpu()
    assert sampled[1].logprob == pytest.approx(log_probs[1, 3].item(), abs=1e-5)  # the model's, not the biased one


def test_top_logprobs_are_the_k_most_likely_tokens_per_row(device):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    chunks = [chunk("a", temperature=0, logprobs=True, top_logprobs=5),
              chunk("b", temperature=0.8, seed=3, logprobs=True, top_logprobs=2),
              chunk("c", temperature=0, logprobs=True)]
    sampled = Sampler(torch.device(device)).sample(logits, chunks)
    log_probs = logits.double().log_softmax(-1).cpu()
    for row, k in ((0, 5), (1, 2), (2, 0)):
        expected = log_probs[row].topk(k) if k else None
        assert len(sampled[row].top_logprobs) == k
        if k:
            assert [token for token, _ in sampled[row].top_logprobs] == expected.indices.tolist()
            assert [lp for _, lp in sampled[row].top_logprobs] == pytest.approx(expected.values.tolist(), abs=1e-5)


def test_a_grammar_mask_limits_greedy_and_random_rows_to_allowed_tokens(device):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(device)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0: only token 5
    bitmask[1, 1] = (1 << 3) | (1 << 9)  # row 1: tokens 35 and 41
    allowed = bitmask_to_allowed(bitmask, 64, torch.device(device))
    assert allowed[0].nonzero().flatten().tolist() == [5]
    assert allowed[1].nonzero().flatten().tolist() == [35, 41]
    sampler = Sampler(torch.device(device))
    for step in range(20):
        sampled = sampler.sample(logits, [chunk("g", temperature=0), chunk(f"r{step}", temperature=1.5)], allowed)
        assert sampled[0].token_id == 5 and sampled[1].token_id in (35, 41)


def test_compiled_grammars_accept_valid_json_and_refuse_invalid_json():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    grammar = compile_constraint(OutputConstraint("json_schema", schema=schema, param="response_format"))
    tokenizer = llguidance.LLTokenizer(_byte_tokenizer_json(), n_vocab=260, eos_token=[0])

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
        return ok and matcher.is_accepting()

    assert accepts(json.dumps({"n": 3}))
    assert not accepts(json.dumps({"n": "three"}))
    assert not accepts(json.dumps({"n": 3, "extra": 1}))


def _byte_tokenizer_json() -> str:
    """A tiny byte-level BPE vocabulary for llguidance (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<eos>": 0, **{char: index + 1 for index, char in enumerate(sorted(alphabet))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer.to_str()
