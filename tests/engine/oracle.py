"""Loads the embedded GGUF through `transformers`' own GGUF path: the engine tests' oracle.
Greedy decoding with it is `tests.models.hf_oracle.hf_greedy_generate`."""

from __future__ import annotations

import torch


def load_hf_gguf(path: str):
    import os

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
