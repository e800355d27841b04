"""Which device and dtype a worker (or one of its tensor-parallel ranks) runs on, and how many CPU threads."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from pdserve.models.base import CausalLM
from pdserve.runner.fused_layer import unfusable_reason

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(choice: str) -> torch.device:
    """auto, cpu, cuda or cuda:N -> a device with an index on CUDA (the pool's NIXL device id)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(choice)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {choice}: CUDA is not available (torch {torch.__version__})")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {choice}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    # Library handles and kernels launched without an explicit device land here too.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def pick_kv_dtype(choice: str, dtype_choice: str, model: CausalLM, model_dtype: torch.dtype,
                  device: torch.device) -> torch.dtype:
    """The KV pool's element type: `--kv-cache-dtype`, or for auto: bfloat16 where the model's decode
    runs the fused native layers (Llama family, float32 activations, the CPU) outside the exact mode
    (`--dtype float32`, where every number stays float32: what parity tests with transformers use);
    elsewhere the model's dtype. There the kernels read it widened in registers: decode attention
    1.16x faster at batch 16, the step no slower at batch 1, greedy tokens unchanged on the embedded
    model (docs/benchmarks.md). bfloat16 rather than float16: float32's range, so no model's keys or
    values overflow it."""
    if choice != "auto":
        return _DTYPES[choice]
    if dtype_choice == "auto" and unfusable_reason(model, device) is None:
        return torch.bfloat16
    return model_dtype


def rank_device(choice: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the configured one (one device per rank), or the CPU."""
    if choice.type != "cuda":
        return choice
    return torch.device("cuda", ((choice.index or 0) + rank) % torch.cuda.device_count())


def rank_threads(num_threads: Optional[int], size: int) -> int:
    """CPU threads of one rank: the worker's threads (default: every core) shared out, at least one each."""
    cores = os.cpu_count() or 1
    if size > cores:
        logger.warning("%d tensor-parallel ranks on %d cores: ranks will wait for each other's cores", size, cores)
    return max(1, (num_threads or cores) // size)
