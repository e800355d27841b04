"""Session fixtures for model tests: the embedded SmolLM2 loaded once through
our loader, and once through transformers' own GGUF path (the oracle, `hf_smollm2_model`
in tests/conftest.py: the engine tests compare against it too)."""

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
