"""The native form of a mixture of experts (`pdserve_cpu::SparseMoeMlp`, kernels/moe_experts.cpp):
routing, grouping by expert and every active expert's gate|up and down in one call per layer.

Invariant: an object is built only for experts the kernel computes as the torch path does
(`pdserve.models.moe`): float32 on the CPU, every expert's weights float32, bfloat16 or MXFP4
rows, or in the same block format the kernels read, biases float32, a routing rule and an activation the kernel
knows; anything else raises ValueError, and the caller keeps the torch path.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pdserve.kernels.native import cpu_kernels_available
from pdserve.models.quant.blocks import BlockFormat
from pdserve.models.quant.modules import Bfloat16Linear, Mxfp4Linear, QuantizedLinear

# Weight formats as kernels/moe_experts.h numbers them (0-2 also kernels/fused_layer.cpp's).
FLOAT_WEIGHT, Q4_1_WEIGHT, Q8_0_WEIGHT, MXFP4_WEIGHT, BFLOAT16_WEIGHT = 0, 1, 2, 3, 4
_BLOCK_FORMATS = {BlockFormat.Q4_1: Q4_1_WEIGHT, BlockFormat.Q8_0: Q8_0_WEIGHT}


def _no_tensor() -> torch.Tensor:
    """An empty tensor: "none" where a custom class argument cannot be optional."""
    return torch.empty(0)


def native_weight(linear: torch.nn.Module) -> tuple[torch.Tensor, int, Optional[torch.Tensor]]:
    """(weight or blocks, format number, bias) of a float or quantized linear layer; ValueError
    when the kernels cannot read it."""
    bias = getattr(linear, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError("a bias is not float32")
    if isinstance(linear, (Mxfp4Linear, Bfloat16Linear)):
        if linear.rows.device.type != "cpu":
            raise ValueError("weights are not on the CPU")
        return linear.rows, MXFP4_WEIGHT if isinstance(linear, Mxfp4Linear) else BFLOAT16_WEIGHT, bias
    if isinstance(linear, QuantizedLinear):
        if not linear.native:
            raise ValueError("quantized weights the native kernels do not read")
        return linear.blocks, _BLOCK_FORMATS[linear.format], bias
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError("a weight that is neither float32 nor in blocks")
    if weight.device.type != "cpu":
        raise ValueError("weights are not on the CPU")
    return weight, FLOAT_WEIGHT, bias


def _stacked(biases: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    if all(bias is None for bias in biases):
        return _no_tensor()
    if any(bias is None for bias in biases):
        raise ValueError("some experts have biases and some do not")
    return torch.stack([bias.detach() for bias in biases])


def native_experts(experts: torch.nn.Module, router_weight: Optional[torch.Tensor] = None,
                   router_bias: Optional[torch.Tensor] = None, routing: tuple[int, int] = (1, 0)) -> Any:
    """A `SparseMoeMlp` over `experts` (a `pdserve.models.moe.Experts`, not imported: moe.py imports
    this module), with the router for `forward` or without it for `run_experts` only; routing is
    (top_k, rule number). ValueError when the kernel cannot compute them."""
    if not cpu_kernels_available():
        raise ValueError("the native CPU kernels are unavailable")
    activation = getattr(experts.activation, "native_activation", None)
    if activation is None:
        raise ValueError("an activation the kernel does not compute")
    gate_up = [native_weight(linear) for linear in experts.gate_up]
    down = [native_weight(linear) for linear in experts.down]
    formats = {number for _, number, _ in gate_up + down}
    if len(formats) != 1:
        raise ValueError("experts in more than one weight format")
    if router_weight is not None and (router_weight.dtype != torch.float32 or router_weight.device.type != "cpu"):
        raise ValueError("the router is not float32 on the CPU")
    return torch.classes.pdserve_cpu.SparseMoeMlp(
        _no_tensor() if router_weight is None else router_weight.detach(),
        _no_tensor() if router_bias is None else router_bias.detach(),
        [weight for weight, _, _ in gate_up], [weight for weight, _, _ in down], formats.pop(),
        _stacked([bias for _, _, bias in gate_up]), _stacked([bias for _, _, bias in down]),
        list(routing), [float(value) for value in activation])
