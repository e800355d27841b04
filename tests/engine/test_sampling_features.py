"""Penalties, logit bias, top logprobs and grammar masks in the batched sampler, checked against
reference implementations written here on the same logits (one row at a time, plain Python loops)."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.api.structured_protocol import OutputConstraint
from pdserve.runner.grammar_matchers import allow_only, bitmask_to_allowed
from pdserve.runner.logits_processors import adjust_logits
from pdserve.runner.sampler import Sampler
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.grammar.compiler import compile_constraint

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


@pytest.mark.parametrize("eos_ids", [[31], [63], [31, 63, 64, 95], [0, 2]])
def test_an_eos_only_mask_allows_exactly_the_eos_tokens_even_on_a_words_sign_bit(eos_ids):
    bitmask = torch.full((1, 3), -1, dtype=torch.int32)  # everything allowed before
    allow_only(bitmask[0], eos_ids)
    assert bitmask_to_allowed(bitmask, 96, torch.device("cpu"))[0].nonzero().flatten().tolist() == sorted(eos_ids)


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


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, frequency_penalty=0.9, presence_penalty=0.4),
    dict(temperature=1.2, repetition_penalty=1.6, logit_bias=((9, 2.5), (0, -100.0))),
    dict(temperature=1.0, top_k=5, frequency_penalty=-0.8, logit_bias=((6, 1.0),)),
], ids=["openai-penalties", "repetition-and-bias", "top-k-after-penalties"])
def test_random_rows_sample_from_the_adjusted_distribution(device, params):
    """Penalties and bias change what is drawn, not only the argmax: frequencies follow the softmax of the
    reference-adjusted logits (then top-k), within 5 binomial standard deviations."""
    num_rows, prompt, output = 20_000, [1, 2, 2], [0, 3, 3, 3, 7]
    row = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0])
    chunks = [chunk(f"r{i}", prompt, output, **params) for i in range(num_rows)]
    tokens = [s.token_id for s in Sampler(torch.device(device), seed=5).sample(
        row.expand(num_rows, -1).contiguous().to(device), chunks)]
    adjusted = reference_adjusted(row, chunks[0].sampling, prompt, output).double() / params["temperature"]
    if params.get("top_k"):
        adjusted[adjusted < adjusted.topk(params["top_k"]).values[-1]] = float("-inf")
    expected = adjusted.softmax(-1)
    frequencies = torch.bincount(torch.tensor(tokens), minlength=len(row)).double() / num_rows
    for token, (frequency, probability) in enumerate(zip(frequencies.tolist(), expected.tolist())):
        bound = 5 * (probability * (1 - probability) / num_rows) ** 0.5 + 1e-9
        assert abs(frequency - probability) <= bound, f"token {token}: {frequency:.4f} vs {probability:.4f}"


def test_a_seeded_penalised_row_draws_the_same_tokens_whatever_shares_its_batch(device):
    """Sibling choices of `n > 1` run as seeded rows next to each other: each one's draws depend on its seed
    and history only, not on its neighbours' penalties, bias or seeds."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4)).to(device)
    own = dict(temperature=1.0, seed=42, frequency_penalty=0.5, logit_bias=((2, 3.0),))

    def draws(neighbours: list[dict]) -> list[int]:
        sampler = Sampler(torch.device(device), seed=len(neighbours))
        tokens, output = [], []
        for step in range(10):
            chunks = [chunk("own", (1, 2), tuple(output), **own),
                      *(chunk(f"n{i}", (1,), (3,) * step, **params) for i, params in enumerate(neighbours))]
            chunks[0].num_sampled_so_far = step
            token = sampler.sample(logits[:len(chunks)], chunks)[0].token_id
            tokens.append(token)
            output.append(token)
        return tokens

    alone = draws([])
    crowded = draws([dict(temperature=0.7, seed=43, presence_penalty=1.0), dict(temperature=1.5),
                     dict(temperature=0, repetition_penalty=2.0), dict(temperature=1.0, seed=42)])
    assert alone == crowded
    assert len(set(alone)) > 1  # really drawn, not one fixed token


def test_min_tokens_keeps_eos_and_stop_ids_from_being_drawn_until_enough_tokens_are_out(device):
    eos, stop = 7, 11
    logits = torch.zeros(5, VOCAB)
    logits[:, eos], logits[:, stop], logits[:, 20] = 9.0, 8.0, 1.0  # EOS first, the stop id second
    logits = logits.to(device)

    def row(name: str, num_sampled: int, **params) -> ScheduledChunk:
        made = chunk(name, output=(20,) * num_sampled, temperature=0, stop_token_ids=(stop,), **params)
        made.num_sampled_so_far, made.eos_token_ids = num_sampled, (eos,)
        return made

    chunks = [row("early", 1, min_tokens=3), row("done", 3, min_tokens=3), row("no-minimum", 0),
              row("ignoring-eos", 0, min_tokens=2, ignore_eos=True), row("random", 2, min_tokens=4)]
    chunks[4].sampling = SamplingParams(temperature=5.0, seed=1, min_tokens=4, stop_token_ids=(stop,))
    sampler = Sampler(torch.device(device))
    assert [s.token_id for s in sampler.sample(logits, chunks)[:4]] == [20, eos, eos, eos]
    for _ in range(30):  # hot random draws never land on a suppressed id
        assert sampler.sample(logits, chunks)[4].token_id not in (eos, stop)
    adjusted = adjust_logits(logits, chunks).cpu()
    expected = logits.cpu().clone()
    expected[[0, 0, 3, 4, 4], [eos, stop, stop, eos, stop]] = float("-inf")
    torch.testing.assert_close(adjusted, expected, rtol=0, atol=0)


def test_min_tokens_leaves_a_grammar_row_to_its_grammar(device):
    grammar = compile_constraint(OutputConstraint("json_object", param="response_format"))
    made = chunk("g", temperature=0, min_tokens=5, grammar=grammar)
    made.eos_token_ids = (3,)
    assert made.suppressed_stop_ids == ()


def test_a_tokenizer_llguidance_cannot_read_is_a_remembered_request_fault():
    from types import SimpleNamespace

    from pdserve.runner.grammar_matchers import GrammarTokenizer
    from pdserve.grammar.errors import GrammarTokenizerUnavailable

    calls = []
    backend = SimpleNamespace(to_str=lambda: calls.append(1) or json.dumps({"model": {"type": "BPE"}}))
    grammar_tokenizer = GrammarTokenizer(SimpleNamespace(backend=backend, eos_token_ids=(0,)), VOCAB)
    for _ in range(2):
        with pytest.raises(GrammarTokenizerUnavailable, match="cannot be used for grammars"):
            grammar_tokenizer.get()
    assert calls == [1]  # not rebuilt (about a second each) for every request
