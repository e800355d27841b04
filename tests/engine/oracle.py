"""Hugging Face `transformers` as the correctness oracle (test-only dependency)."""

from __future__ import annotations

from typing import Sequence

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
    """Plain greedy decoding with the HF model's own KV cache; no EOS handling,
    so it can be compared with `ignore_eos=True` runs token for token."""
    input_ids = torch.tensor([list(prompt_ids)])
    out = model(input_ids=input_ids, use_cache=True)
    generated: list[int] = []
    for _ in range(num_tokens):
        next_id = int(out.logits[0, -1].argmax())
        generated.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def load_hf_gguf(path: str):
    import os

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
