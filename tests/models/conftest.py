"""Session fixtures for model tests: the embedded SmolLM2 loaded once through
our loader, and once through transformers' own GGUF path (the oracle)."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.models.loader import LoadedModel, embedded_model_path, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="session")
def hf_smollm2_model():
    """transformers' LlamaForCausalLM from the same GGUF, dequantized by its own code.

    transformers refuses GGUF files unless `accelerate` is importable, which it
    only uses to dispatch across several devices; we load on one CPU, so the
    gate is lifted for this load only.
    """
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as modeling_utils

    path = embedded_model_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()
