"""The engine (paged pool, scheduler, chunked prefill) on CUDA, greedy, against
transformers on the same GPU and dtype: the embedded SmolLM2, a tiny Qwen3 and a
tiny Gemma 3 whose window is shorter than the prompts. Skipped without CUDA.

fp32 must match token for token. In bf16 two correct implementations may round a
near-tie differently (different kernels, different summation order), after which
the continuations diverge; so in bf16 every token up to the first difference must
match, and that first difference is allowed only where transformers' own top-two
logits were within BF16_TIE_MARGIN of each other."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.loader import embedded_model_path, load_model
from tests.devices import cuda_available
from tests.engine.harness import generate, greedy, make_engine
from tests.engine.oracle import load_hf_gguf
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import GEMMA_VOCAB, QWEN_VOCAB, make_tiny_gemma3, make_tiny_qwen3, random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CUDA")]

NUM_TOKENS = 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_TIE_MARGIN = 0.5  # bf16 keeps 8 significant bits: a logit near 24 reads +-0.06, and 30 layers compound it
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and say why they are prime."]


def assert_greedy_agrees(ours: list[int], theirs: list[int], margins: list[float], dtype: str) -> None:
    if dtype == "float32" or ours == theirs:
        assert ours == theirs
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    assert margins[first] < BF16_TIE_MARGIN, (
        f"bf16 diverged at token {first} where transformers' top-2 gap was {margins[first]:.3f}: "
        f"ours {ours[:first + 1]} vs {theirs[:first + 1]}")


def run_both(hf_model, loaded, prompts, dtype: str, **engine_args) -> None:
    hf_model = hf_model.to(device="cuda", dtype=DTYPES[dtype])
    engine = make_engine(loaded=loaded, device="cuda", dtype=dtype, **engine_args)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        theirs, margins = hf_greedy_with_margins(hf_model, prompt, NUM_TOKENS)
        assert_greedy_agrees(result.token_ids, theirs, margins, dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_smollm2_greedy_on_cuda_matches_transformers(dtype):
    loaded = load_model(None, DTYPES[dtype], torch.device("cuda"))
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in QUESTIONS]
    run_both(load_hf_gguf(embedded_model_path()), loaded, prompts, dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tiny_qwen3_batched_chunked_greedy_on_cuda_matches_transformers(dtype, tmp_path):
    hf_model = make_tiny_qwen3(str(tmp_path))
    loaded = load_model(str(tmp_path), DTYPES[dtype], torch.device("cuda"))
    prompts = [random_prompt(n, QWEN_VOCAB, seed) for seed, n in enumerate((7, 45, 90))]
    run_both(hf_model, loaded, prompts, dtype, block_size=4, budget=32)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tiny_gemma3_window_shorter_than_prompt_on_cuda_matches_transformers(dtype, tmp_path):
    hf_model = make_tiny_gemma3(str(tmp_path))
    loaded = load_model(str(tmp_path), DTYPES[dtype], torch.device("cuda"))
    prompts = [random_prompt(100, GEMMA_VOCAB, seed) for seed in range(3)]  # window 16, chunks of 24
    run_both(hf_model, loaded, prompts, dtype, block_size=4, budget=24)
