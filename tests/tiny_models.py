"""Tiny random-weight checkpoints made with transformers at test time (no hub access):
Gemma 3 text with a sliding window shorter than the test prompts, and Qwen3."""

from __future__ import annotations

import torch

from tests.models.hf_oracle import randomize_norms, save_tiny_checkpoint

GEMMA_VOCAB = 320
GEMMA_WINDOW = 16
GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention", "sliding_attention"]
QWEN_VOCAB = 300


def tiny_gemma3_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=GEMMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.08,
        sliding_window=GEMMA_WINDOW, layer_types=GEMMA_LAYER_TYPES, query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    settings.update(overrides)
    return transformers.Gemma3TextConfig(**settings)


def tiny_qwen3_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.08,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return transformers.Qwen3Config(**settings)


def make_tiny_gemma3(directory: str, seed: int = 0):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config()).eval()
    randomize_norms(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def make_tiny_qwen3(directory: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    randomize_norms(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
