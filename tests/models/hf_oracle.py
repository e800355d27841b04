"""Helpers that run Hugging Face `transformers` as the oracle for model tests:
greedy decoding with its own KV cache, and tiny random checkpoints saved in
the HF layout (safetensors + a word-level tokenizer.json)."""

from __future__ import annotations

from typing import Sequence

import torch

from bench.lib.tiny_model import write_word_tokenizer  # noqa: F401 (re-exported)


def hf_greedy_generate(hf_model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy loop over transformers' model and cache (never stops at EOS), on the model's device."""
    return hf_greedy_with_margins(hf_model, prompt_ids, max_new_tokens)[0]


def hf_greedy_with_margins(hf_model: torch.nn.Module, prompt_ids: Sequence[int],
                           max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the gap between the best and second-best logit
    (how close a step was to a tie: where half-precision paths may rightly differ)."""
    device = next(hf_model.parameters()).device
    generated: list[int] = []
    margins: list[float] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([list(prompt_ids)], device=device), use_cache=True)
        for _ in range(max_new_tokens):
            top2 = out.logits[0, -1].float().topk(2)
            generated.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = hf_model(torch.tensor([[generated[-1]]], device=device), past_key_values=out.past_key_values,
                           use_cache=True)
    return generated, margins


def hf_prompt_logits(hf_model: torch.nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([list(prompt_ids)])).logits[0].float()


def randomize_norms(hf_model: torch.nn.Module, center: float = 1.0, seed: int = 0) -> None:
    """HF initialises norm weights to a constant; give them random values around
    `center` (1 for Llama-style norms, 0 for Gemma's 1 + w) so a mis-applied
    norm cannot hide."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + center)


def save_tiny_checkpoint(hf_model: torch.nn.Module, directory: str, max_shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_word_tokenizer(directory, hf_model.config.vocab_size)
    return directory
