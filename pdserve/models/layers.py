"""Building blocks shared by the model files: RMS norms, activations and the gated MLP.

The parameters they are built from, and how weights land in them, are
`pdserve.models.weight_targets`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.nn.functional as F

from pdserve.models.hf_config import UnsupportedModelFeature
from pdserve.models.weight_targets import copy_rows, empty_linear

if TYPE_CHECKING:
    from pdserve.models.weight_loader import WeightLoader


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
