"""Random access to checkpoint tensors by Hugging Face parameter name.

A model's `load_weights` pulls each tensor it needs by name from a
`WeightSource`; the source reads (and for GGUF dequantizes) one tensor at a
time, so peak memory is the model plus one tensor, whatever the format.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Any, Optional, Protocol

import torch
from safetensors import safe_open

from pdserve.models.hf_config import ModelLoadError
from pdserve.models.quant.blocks import PackedWeight

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class WeightSource(Protocol):
    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor under this HF name."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The tensor under this HF name, on the CPU; ModelLoadError when absent."""
        ...

    def get_packed(self, name: str) -> Optional[PackedWeight]:
        """The weight as quantized blocks the native kernels run as they are; None when the source
        holds it in another form (the loader then takes `get`)."""
        ...


class SafetensorsSource:
    """Tensors of a Hugging Face directory: one `model.safetensors`, a sharded
    index, or any set of `*.safetensors` files. Files stay memory-mapped."""

    def __init__(self, directory: str):
        self._stack = ExitStack()
        self._file_of: dict[str, Any] = {}
        for filename in _safetensors_files(directory):
            handle = self._stack.enter_context(safe_open(os.path.join(directory, filename), framework="pt"))
            for name in handle.keys():
                self._file_of[name] = handle

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        handle = self._file_of.get(name)
        if handle is None:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        return handle.get_tensor(name)

    def get_packed(self, name: str) -> Optional[PackedWeight]:
        return None  # safetensors checkpoints hold plain tensors

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _safetensors_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(directory, SAFETENSORS_SINGLE)):
        return [SAFETENSORS_SINGLE]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} holds no *.safetensors weights")
    return files
