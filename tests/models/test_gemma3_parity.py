"""A tiny random Gemma 3 text model (mixed sliding/full layers, window shorter
than the prompt, per-type RoPE with scaling on full layers, final logit
soft-capping) saved by transformers and loaded by our HF-directory loader."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits, randomize_norms, save_tiny_checkpoint
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from pdserve.models.gemma3 import gemma3_args
from pdserve.models.loader import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 320
WINDOW = 16
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING]


def _gemma3_config(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.08,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    settings.update(overrides)
    return transformers.Gemma3TextConfig(**settings)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForCausalLM(_gemma3_config()).eval()
    randomize_norms(hf_model, center=0.0)
    directory = save_tiny_checkpoint(hf_model, str(tmp_path_factory.mktemp("gemma3")))
    return hf_model, load_model(directory, torch.float32, torch.device("cpu"))


def _prompt(length: int = 60, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_layer_specs_follow_layer_types(gemma):
    _, ours = gemma
    expected = tuple(SlidingWindowSpec(WINDOW) if t == SLIDING else FullAttentionSpec() for t in LAYER_TYPES)
    assert ours.model.spec.layer_specs == expected
    assert ours.model.spec.architecture == "gemma3"


def test_prompt_longer_than_window_gives_transformers_logits(gemma):
    hf_model, ours = gemma
    prompt = _prompt()
    logits = forward_chunk(ours.model, ContiguousAttention(ours.model.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(logits, hf_prompt_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    assert logits.abs().max() < 30.0  # soft-capped


def test_ignoring_the_window_would_change_the_logits(gemma):
    """Guards the test above: the window really matters for this prompt."""
    hf_model, ours = gemma
    prompt = _prompt()
    all_full = ContiguousAttention((FullAttentionSpec(),) * len(LAYER_TYPES))
    logits = forward_chunk(ours.model, all_full, "s", prompt)
    assert (logits - hf_prompt_logits(hf_model, prompt)).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_tokens", [None, 13])
def test_greedy_decoding_matches_transformers(gemma, chunk_tokens):
    hf_model, ours = gemma
    prompt = _prompt(seed=3)
    generated = greedy_generate(ours.model, prompt, 32, chunk_tokens=chunk_tokens)
    assert generated == hf_greedy_generate(hf_model, prompt, 32)
    full = prompt + generated
    attention = ContiguousAttention(ours.model.spec.layer_specs)
    forward_chunk(ours.model, attention, "s", prompt)
    step_logits = torch.cat([forward_chunk(ours.model, attention, "s", [t]) for t in generated[:-1]])
    expected = hf_prompt_logits(hf_model, full)[len(prompt) : len(full) - 1]
    torch.testing.assert_close(step_logits, expected, atol=1e-4, rtol=1e-4)


def test_legacy_config_keys_map_to_per_layer_rope():
    """Hub configs predating transformers 5 spell RoPE as rope_theta / rope_local_base_freq / rope_scaling."""
    config = {
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 6,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 64,
        "sliding_window": 4, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    args = gemma3_args(config)
    assert args.rope_full == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert args.rope_sliding == {"rope_type": "default", "rope_theta": 10_000.0}
    assert args.layer_specs == (SlidingWindowSpec(4),) * 5 + (FullAttentionSpec(),)


def test_attention_softcapping_is_refused_clearly(tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForCausalLM(_gemma3_config(attn_logit_softcapping=50.0))
    directory = save_tiny_checkpoint(hf_model, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["attn_logit_softcapping"] == 50.0
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        load_model(directory, torch.float32, torch.device("cpu"))
