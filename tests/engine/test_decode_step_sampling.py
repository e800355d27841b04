"""Every sampling feature gives the same tokens, logprobs and alternatives whether a decode-only step
runs through `DecodeStep` or the eager paged path: penalties, logit bias, min_tokens' EOS masking,
grammar masks, seeded draws, top logprobs (embedded SmolLM2, a few tokens each, one batch)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.api.structured_protocol import OutputConstraint
from pdserve.grammar.compiler import compile_constraint
from pdserve.models.loader import embedded_model_path, load_model
from pdserve.request import GenerationRequest
from tests.engine.harness import Collected, make_engine
from tests.models.test_quantized_blocks import require_native_kernels

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 2683, 314, 4194, 314, 260, 3373]
BIASED_TOKEN = 2683


@pytest.fixture(scope="module")
def loaded():
    return load_model(embedded_model_path(), torch.float32, torch.device("cpu"))


def cases(eos: int) -> dict[str, SamplingParams]:
    grammar = compile_constraint(OutputConstraint("json_object", param="response_format"))
    return {
        "greedy-top-logprobs": SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3),
        "penalties-seeded": SamplingParams(max_tokens=6, temperature=0.8, seed=11, presence_penalty=1.5,
                                           frequency_penalty=0.7, repetition_penalty=1.4, logprobs=True),
        "logit-bias": SamplingParams(max_tokens=5, temperature=0, logit_bias=((BIASED_TOKEN, 100.0),)),
        # EOS biased to win every step: min_tokens alone keeps it out.
        "min-tokens": SamplingParams(max_tokens=5, temperature=0, min_tokens=5, logit_bias=((eos, 100.0),)),
        "grammar-seeded": SamplingParams(max_tokens=8, temperature=0.7, seed=5, grammar=grammar, logprobs=True,
                                         top_logprobs=2),
    }


def run_batch(loaded, use_decode_step: bool) -> tuple[dict[str, Collected], int]:
    built = make_engine(loaded=loaded)
    step = built.runner.decode_step
    if not use_decode_step:
        step.native = step.compiled = False  # the runner then takes the eager path for every step
    calls = []
    original_run = step.run
    step.run = lambda chunks: calls.append(len(chunks)) or original_run(chunks)
    eos = built.loaded.tokenizer.eos_token_ids[0]
    collected = {name: Collected() for name in cases(eos)}
    loop = built.engine.engine_loop
    for name, sampling in cases(eos).items():
        loop.submit(GenerationRequest(name, tuple(PROMPT), sampling), collected[name].outputs.append)
    loop.run_until_idle()
    built.kv_manager.check_invariants()
    return collected, len(calls)


def test_every_sampling_feature_is_the_same_through_the_decode_step_and_the_eager_path(loaded):
    require_native_kernels()
    eager, eager_calls = run_batch(loaded, use_decode_step=False)
    stepped, stepped_calls = run_batch(loaded, use_decode_step=True)
    assert eager_calls == 0 and stepped_calls >= 4, "each path really ran"
    for name in eager:
        a, b = eager[name], stepped[name]
        assert b.final.error is None and a.final.error is None, name
        assert b.token_ids == a.token_ids, name
        logprobs_a = [lp for output in a.outputs for lp in output.new_logprobs]
        logprobs_b = [lp for output in b.outputs for lp in output.new_logprobs]
        assert logprobs_b == pytest.approx(logprobs_a, abs=1e-3), name
        tops_a = [[t for t, _ in top] for output in a.outputs for top in output.new_top_logprobs]
        tops_b = [[t for t, _ in top] for output in b.outputs for top in output.new_top_logprobs]
        assert tops_b == tops_a, name
    # And the features did act on the decode-step path.
    assert stepped["logit-bias"].token_ids == [BIASED_TOKEN] * 5
    eos = loaded.tokenizer.eos_token_ids[0]
    assert len(stepped["min-tokens"].token_ids) == 5 and eos not in stepped["min-tokens"].token_ids
    assert len(stepped["greedy-top-logprobs"].outputs[-1].new_top_logprobs[-1]) == 3
    text = stepped["grammar-seeded"].text
    assert text.startswith("{") and (stepped["grammar-seeded"].final.finish_reason.value == "length"
                                     or isinstance(json.loads(text), dict)), text
