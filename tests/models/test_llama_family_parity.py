"""Tiny random Llama-family checkpoints (Llama 3 rope scaling, Qwen2 biases,
Qwen3 q/k norms, Mistral sliding window) saved by transformers and loaded by
our HF-directory loader: logits and greedy decoding match transformers."""

from __future__ import annotations

import pytest
import torch

from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits, randomize_norms, save_tiny_checkpoint
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from pdserve.models.loader import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 384
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08,
)


def _llama3():
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    config = transformers.LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config), "llama", FullAttentionSpec()


def _smollm_like_tied():
    rope = {"rope_type": "default", "rope_theta": 100000.0}
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope)
    return transformers.LlamaForCausalLM(config), "llama", FullAttentionSpec()


def _qwen2():
    config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config), "qwen2", FullAttentionSpec()


def _qwen3():
    config = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config), "qwen3", FullAttentionSpec()


def _mistral_sliding():
    config = transformers.MistralConfig(**COMMON, sliding_window=12, tie_word_embeddings=False)
    return transformers.MistralForCausalLM(config), "mistral", SlidingWindowSpec(12)


FAMILIES = {
    "llama3": _llama3, "llama_tied": _smollm_like_tied, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral_sliding,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    hf_model, architecture, layer_spec = FAMILIES[request.param]()
    hf_model.eval()
    randomize_norms(hf_model)
    if any(name.endswith("bias") for name, _ in hf_model.named_parameters()):
        with torch.no_grad():  # HF zero-initialises biases; make them matter
            for name, param in hf_model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
    directory = save_tiny_checkpoint(hf_model, str(tmp_path_factory.mktemp(request.param)))
    ours = load_model(directory, torch.float32, torch.device("cpu"))
    return hf_model, ours, architecture, layer_spec


def _prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_spec_reflects_the_config(family):
    hf_model, ours, architecture, layer_spec = family
    spec = ours.model.spec
    assert spec.architecture == architecture
    assert spec.layer_specs == (layer_spec,) * 3
    assert (spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (4, 2, VOCAB)
    config = hf_model.config
    assert spec.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def test_prompt_logits_match_transformers(family):
    hf_model, ours, _, _ = family
    prompt = _prompt(40)
    logits = forward_chunk(ours.model, ContiguousAttention(ours.model.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(logits, hf_prompt_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_greedy_decoding_matches_transformers(family, chunk_tokens):
    hf_model, ours, _, _ = family
    prompt = _prompt(40, seed=2)
    generated = greedy_generate(ours.model, prompt, 32, chunk_tokens=chunk_tokens)
    assert generated == hf_greedy_generate(hf_model, prompt, 32)
    # Decode-time logits too (teacher-forced by transformers over the whole sequence).
    full = prompt + generated
    attention = ContiguousAttention(ours.model.spec.layer_specs)
    forward_chunk(ours.model, attention, "s", prompt)
    step_logits = torch.cat([forward_chunk(ours.model, attention, "s", [t]) for t in generated[:-1]])
    expected = hf_prompt_logits(hf_model, full)[len(prompt) : len(full) - 1]
    torch.testing.assert_close(step_logits, expected, atol=1e-4, rtol=1e-4)
