"""Building blocks shared by the model files: RMS norms, activations, empty
parameters and the fused-weight copy used at load time.

Small parameters are allocated uninitialised on the target device and filled
once by `copy_rows`; linear layers and embeddings are built on the meta device
and materialised by `WeightLoader` in their final form (float or quantized), so
loading never holds two copies of a weight and never runs a random initialiser.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature

if TYPE_CHECKING:  # layers <- weight_loader imports run the other way at run time
    from pdserve.models.weight_loader import WeightLoader


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm: normalise in fp32, cast back, then scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_fp32_scale(x: torch.Tensor, scale_fp32: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm: normalise and scale in fp32 (scale is 1 + w), then cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale_fp32).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
})


def activation_named(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelFeature(f"activation {name!r} is not supported") from None


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        bias: bool,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = empty_linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = empty_linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.activation(gate) * up)

    def load(self, weights: "WeightLoader", prefix: str) -> None:
        """Fill `{prefix}gate_proj`, `up_proj`, `down_proj` (HF names) into the fused layout."""
        names = [prefix + "gate_proj", prefix + "up_proj"]
        self.gate_up_proj = weights.linear(self.gate_up_proj, [n + ".weight" for n in names], prefix + "gate_up")
        if self.gate_up_proj.bias is not None:
            copy_rows(self.gate_up_proj.bias, [weights.get(n + ".bias") for n in names], prefix + "gate_up bias")
        self.down_proj = weights.linear(self.down_proj, [prefix + "down_proj.weight"], prefix + "down_proj")
        if self.down_proj.bias is not None:
            copy_rows(self.down_proj.bias, [weights.get(prefix + "down_proj.bias")], prefix + "down_proj bias")
