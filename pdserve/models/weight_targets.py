"""The modules and parameters a model is built from before its weights arrive, and how weights land in them.

Small parameters are allocated uninitialised on the target device and filled
once by `copy_rows`; linear layers and embeddings are built on the meta device
and materialised by `WeightLoader` in their final form (float or quantized), so
loading never holds two copies of a weight and never runs a random initialiser.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.hf_config import ModelLoadError


def empty_param(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), computed as (weight @ x.T).T on CPU for small batches.

    Decode batches are a few rows against a wide weight. On CPU, BLAS runs the
    same product 15-40% faster with the weight as the left operand (measured
    in bench/engine.py's profile: 75 -> 60 ms a step at 16 rows). A single
    float32 row takes the native kernel, which splits the weight rows over
    every core (BLAS's matrix-vector path used one)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if (rows == 1 and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not torch.compiler.is_compiling() and cpu_kernels_available()):
        out = ops().f32_row_linear(x, weight)  # BLAS kept a single row on one core
        return out if bias is None else out.add_(bias)
    if x.device.type != "cpu" or not 1 < rows <= _SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


_SMALL_BATCH_ROWS = 256


class Linear(torch.nn.Linear):
    """nn.Linear whose forward uses `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return linear(x, self.weight, self.bias)


def empty_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    """A Linear on the meta device: `WeightLoader.linear` materialises it (float or quantized)."""
    layer = Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    layer.requires_grad_(False)
    return layer


class Embedding(torch.nn.Module):
    """Token id -> row of `weight`; built on meta, materialised by `WeightLoader.embedding`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param((num_embeddings, embedding_dim), dtype, torch.device("meta"))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


def copy_rows(dst: torch.Tensor, parts: Sequence[torch.Tensor], name: str) -> None:
    """Fill `dst` with `parts` stacked along dim 0 (q|k|v or gate|up fusion)."""
    offset = 0
    for part in parts:
        rows = part.shape[0]
        if offset + rows > dst.shape[0] or tuple(part.shape[1:]) != tuple(dst.shape[1:]):
            raise ModelLoadError(
                f"{name}: checkpoint shape {tuple(part.shape)} does not fit parameter {tuple(dst.shape)}"
            )
        dst[offset : offset + rows].copy_(part)
        offset += rows
    if offset != dst.shape[0]:
        raise ModelLoadError(f"{name}: checkpoint has {offset} rows, parameter has {dst.shape[0]}")
