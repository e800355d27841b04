"""One native call per decoder layer in a decode step (`pdserve_cpu::llama_decode_layer`).

A decode step at one row spends most of its time dispatching small torch ops from Python (about
120 a layer: norms, RoPE, activations, residuals, views), not multiplying. The native kernel
runs a whole Llama-family layer (norms, q/k/v, optional q/k norm, RoPE, paged attention, o, the
gated SiLU MLP, both residuals) in C++; this module gathers each layer's arguments once, at
start-up. Invariant: a layer is fused only when the kernel computes exactly what the torch layer
does (float32 activations on the CPU, SiLU, rotation over the whole head, weights float32 or in
blocks the kernels read); any other layer makes the whole model keep the torch path, and
`unfusable_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from pdserve.runner.decode_attention import DecodeRows
from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.base import CausalLM, DecoderLayer
from pdserve.models.llama import LlamaDecoderLayer
from pdserve.models.quant.blocks import BlockFormat
from pdserve.models.quant.modules import QuantizedLinear

_FLOAT_WEIGHT, _Q4_1_WEIGHT, _Q8_0_WEIGHT = 0, 1, 2  # formats as kernels/fused_layer.cpp numbers them
_BLOCK_FORMATS = {BlockFormat.Q4_1: _Q4_1_WEIGHT, BlockFormat.Q8_0: _Q8_0_WEIGHT}


def _weight_of(linear: torch.nn.Module) -> tuple[torch.Tensor, int, Optional[torch.Tensor]]:
    """(weight or blocks, format number, bias) of a float or quantized linear layer; ValueError
    when the kernel cannot read it."""
    bias = getattr(linear, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError("a bias is not float32")
    if isinstance(linear, QuantizedLinear):
        if not linear.native:
            raise ValueError("quantized weights the native kernels do not read")
        return linear.blocks, _BLOCK_FORMATS[linear.format], bias
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError("a weight that is neither float32 nor in blocks")
    return weight, _FLOAT_WEIGHT, bias


@dataclass(frozen=True)
class FusedLlamaLayer:
    """The fixed arguments of one layer's native call."""

    norms: tuple[torch.Tensor, torch.Tensor]  # input, post-attention
    qk_norm: Optional[torch.Tensor]
    weights: tuple[torch.Tensor, ...]  # qkv, o, gate|up, down
    formats: tuple[int, ...]
    biases: tuple[Optional[torch.Tensor], ...]
    geometry: tuple[int, int, int]  # heads, kv heads, head dim
    eps: float
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> "FusedLlamaLayer":
        """ValueError when `layer` is not one the kernel computes exactly."""
        if type(layer) is not LlamaDecoderLayer:
            raise ValueError(f"{type(layer).__name__} layers have no fused kernel")
        attention, mlp = layer.self_attn, layer.mlp
        if mlp.activation is not F.silu:
            raise ValueError("the MLP's activation is not SiLU")
        if layer.input_norm.dtype != torch.float32 or layer.input_norm.device.type != "cpu":
            raise ValueError("activations are not float32 on the CPU")
        parts = [_weight_of(linear) for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj,
                                                   mlp.down_proj)]
        return cls(
            norms=(layer.input_norm.detach(), layer.post_attention_norm.detach()),
            qk_norm=None if attention.qk_norm is None else attention.qk_norm.detach(),
            weights=tuple(weight for weight, _, _ in parts),
            formats=tuple(number for _, number, _ in parts),
            biases=tuple(bias for _, _, bias in parts),
            geometry=(attention.num_heads, attention.num_kv_heads, attention.head_dim),
            eps=layer.eps,
            scale=layer.attention_scale,
        )

    def __call__(self, h: torch.Tensor, rope: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows,
                 write_blocks: torch.Tensor, write_offsets: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer; the rows' new K/V are stored in their page slots
        (int64 block ids and offsets), after attending, which reads other slots only."""
        cos, sin = rope
        h, _, _ = ops().llama_decode_layer(
            h, list(self.norms), self.qk_norm, list(self.weights), list(self.formats), list(self.biases), cos, sin,
            k_cache, v_cache, rows.block_table, rows.key_start, rows.key_end, write_blocks, write_offsets,
            list(self.geometry), self.eps, self.scale,
        )
        return h


class FusedDecoderStack:
    """Every fused layer of a model as one native object (`pdserve_cpu::LlamaDecoderStack`): a
    decode step calls it once instead of once per layer, each layer's fixed arguments and page
    views handed over at start-up."""

    def __init__(self, layers: Sequence[FusedLlamaLayer], layer_caches: Sequence[tuple[int, torch.Tensor, torch.Tensor]]):
        self._stack = torch.classes.pdserve_cpu.LlamaDecoderStack()
        no_bias = torch.empty(0)
        for layer, (group_id, k_cache, v_cache) in zip(layers, layer_caches, strict=True):
            self._stack.add_layer(list(layer.norms), layer.qk_norm, list(layer.weights), list(layer.formats),
                                  [no_bias if bias is None else bias for bias in layer.biases], list(layer.geometry),
                                  layer.eps, layer.scale, k_cache, v_cache, group_id)

    def __call__(self, h: torch.Tensor, rope: Any, rows: Sequence[DecodeRows], write_blocks: Sequence[torch.Tensor],
                 write_offsets: torch.Tensor) -> torch.Tensor:
        """The residual stream after every layer (rows and write blocks per KV group); each layer's
        new K/V are stored in their page slots, after it attends."""
        cos, sin = rope
        return self._stack.forward(h, cos, sin, [r.block_table for r in rows], [r.key_start for r in rows],
                                   [r.key_end for r in rows], list(write_blocks), write_offsets)


def _fuse(model: CausalLM, device: torch.device) -> tuple[Optional[list[FusedLlamaLayer]], Optional[str]]:
    """(one `FusedLlamaLayer` per layer, None), or (None, why not)."""
    if device.type != "cpu" or not cpu_kernels_available():
        return None, "the fused decoder layer is a native CPU kernel"
    layers = []
    for layer in model.layers:
        try:
            layers.append(FusedLlamaLayer.of(layer))
        except ValueError as exc:
            return None, f"layer {layer.layer_id}: {exc}"
    return layers, None


def unfusable_reason(model: CausalLM, device: torch.device) -> Optional[str]:
    """None when every layer of `model` can run as one native call; else why not."""
    return _fuse(model, device)[1]


def fused_layers(model: CausalLM, device: torch.device) -> Optional[Sequence[FusedLlamaLayer]]:
    """One `FusedLlamaLayer` per layer, or None when any layer cannot be fused."""
    return _fuse(model, device)[0]
