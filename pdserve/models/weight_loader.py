"""Turns checkpoint tensors into a model's layers: float parameters or quantized blocks.

Model files build their linear layers and embeddings on the meta device and hand them here
with the checkpoint names to fill them from; the `WeightPolicy` decides whether each comes back
as a float layer or a quantized one. Invariant: a layer is materialised once, in its final
form, so loading never holds a float copy of a weight that is served quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

import torch

from pdserve.kernels.native import cpu_kernels_available
from pdserve.models.hf_config import ModelLoadError
from pdserve.models.quant.blocks import (
    GROUP_SIZE, BlockFormat, PackedWeight, concat_rows, dequantize, quantize_q4_1, quantize_q8_0)
from pdserve.models.quant.modules import Bfloat16Linear, Mxfp4Linear, QuantizedEmbedding, QuantizedLinear
from pdserve.models.quant.mxfp4 import Mxfp4Weight
from pdserve.models.weight_targets import Embedding, Linear, copy_rows
from pdserve.models.weights import WeightSource

logger = logging.getLogger(__name__)

QuantizationChoice = Literal["none", "gguf", "int8", "int4"]


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """keep_packed: a GGUF's Q4_0/Q4_1/Q8_0 tensors stay blocks; float_format: float weights of
    linear layers are quantized to it (None: they stay float). Embeddings and output heads that
    get quantized use Q8_0 whatever `float_format` is: 4 bits there cost too much accuracy."""

    keep_packed: bool = False
    float_format: Optional[BlockFormat] = None

    @staticmethod
    def for_choice(choice: QuantizationChoice) -> "WeightPolicy":
        return {
            "none": WeightPolicy(),
            "gguf": WeightPolicy(keep_packed=True),
            "int8": WeightPolicy(keep_packed=True, float_format=BlockFormat.Q8_0),
            "int4": WeightPolicy(keep_packed=True, float_format=BlockFormat.Q4_1),
        }[choice]

    @property
    def quantizes(self) -> bool:
        return self.keep_packed or self.float_format is not None


def _quantize(weight: torch.Tensor, block_format: BlockFormat) -> PackedWeight:
    return quantize_q4_1(weight) if block_format is BlockFormat.Q4_1 else quantize_q8_0(weight)


class WeightLoader:
    """A model's view of its checkpoint during `load_weights`."""

    def __init__(self, source: WeightSource, policy: WeightPolicy, device: torch.device):
        self.source = source
        self.policy = policy
        self.device = torch.device(device)
        self.num_compact_layers = 0  # linear layers kept in blocks, MXFP4 or bfloat16 rather than the model dtype
        self.num_float_slices = 0  # layers the policy would quantize whose input width cuts a block

    def get(self, name: str) -> torch.Tensor:
        """A float tensor (norm weights, biases, anything that is not a matmul weight)."""
        return self.source.get(name)

    def _weight(self, names: Sequence[str], float_format: Optional[BlockFormat]) -> Union[PackedWeight, list[torch.Tensor]]:
        """The rows of `names` stacked: packed when the policy says so, else float parts."""
        packed_parts: list[Optional[PackedWeight]] = [
            self.source.get_packed(name) if self.policy.keep_packed else None
            for name in names
        ]
        if all(part is not None for part in packed_parts):
            formats = {part.format for part in packed_parts}  # type: ignore[union-attr]
            if len(formats) == 1:
                return concat_rows(packed_parts)  # type: ignore[arg-type]
            float_format = BlockFormat.Q8_0  # mixed formats: re-pack all at the finer one
        floats = [self.source.get(name) if part is None else dequantize(part) for name, part in zip(names, packed_parts)]
        if any(part is not None for part in packed_parts) and float_format is None:
            float_format = BlockFormat.Q8_0  # partly packed: keep it packed
        if float_format is None:
            return floats
        return concat_rows([_quantize(part, float_format) for part in floats])

    def linear(self, layer: Linear, names: Sequence[str], label: str) -> torch.nn.Module:
        """`layer` (on meta) filled from the stacked rows of `names`, as float or quantized."""
        weight = self._weight(names, self.policy.float_format)
        return self._finish_linear(layer, weight, label)

    def linear_from_tensors(self, layer: Linear, parts: Sequence[torch.Tensor], label: str) -> torch.nn.Module:
        """`layer` filled from float tensors the model file cut out of the checkpoint itself (one
        expert of a fused expert tensor, dequantized MXFP4, a rank's slice of an expert), quantized
        when the policy says so and its input width is whole blocks, float otherwise."""
        float_format = self.policy.float_format
        if float_format is not None and layer.in_features % GROUP_SIZE:
            # A tensor-parallel rank's slice of an expert can be narrower than whole blocks allow.
            if not self.num_float_slices:
                logger.warning("%s: %d input features do not fill %d-weight blocks; kept in float (and any "
                               "more like it, unlogged)", label, layer.in_features, GROUP_SIZE)
            self.num_float_slices += 1
            float_format = None
        weight = list(parts) if float_format is None else concat_rows([_quantize(p, float_format) for p in parts])
        return self._finish_linear(layer, weight, label)

    def linear_from_mxfp4(self, layer: Linear, weight: Mxfp4Weight, label: str) -> torch.nn.Module:
        """`layer` as an `Mxfp4Linear` over `weight` (MXFP4 expert rows the model file kept), its
        bias left for the model file to fill, as `_finish_linear` leaves it."""
        bias = self._packed_layer_bias(layer, (weight.out_features, weight.in_features), label)
        return Mxfp4Linear(Mxfp4Weight(weight.rows.to(self.device), weight.in_features), bias)

    def native_experts_read_compact(self, dtype: torch.dtype) -> bool:
        """Whether the native experts run a model of `dtype` here, reading compact expert rows
        (MXFP4, bfloat16) themselves: float32 on a CPU with the kernels. Elsewhere the torch path
        would widen such rows on every call, so they are widened once, at load."""
        return self.device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()

    def keeps_bfloat16(self, layer: Linear, parts: Sequence[torch.Tensor]) -> bool:
        """Whether expert weights `parts` stay bfloat16 in `layer` (`linear_from_bfloat16`): the
        checkpoint holds them so, the native experts read them (`native_experts_read_compact`),
        and the policy quantizes nothing."""
        return (self.policy.float_format is None and all(part.dtype == torch.bfloat16 for part in parts)
                and self.native_experts_read_compact(layer.weight.dtype))

    def linear_from_bfloat16(self, layer: Linear, parts: Sequence[torch.Tensor], label: str) -> torch.nn.Module:
        """`layer` as a `Bfloat16Linear` over `parts` stacked (rows = outputs), its bias left for
        the model file to fill."""
        rows = torch.cat(list(parts)).to(self.device)
        bias = self._packed_layer_bias(layer, tuple(rows.shape), label)
        return Bfloat16Linear(rows, bias)

    def _packed_layer_bias(self, layer: Linear, shape: tuple[int, int], label: str) -> Optional[torch.nn.Parameter]:
        """The empty bias (or None) of a packed layer that replaces `layer`; ModelLoadError when the
        checkpoint's weight `shape` does not fit it. Counts the layer as compact."""
        if shape != (layer.out_features, layer.in_features):
            raise ModelLoadError(f"{label}: checkpoint shape {shape} "
                                 f"does not fit parameter {(layer.out_features, layer.in_features)}")
        self.num_compact_layers += 1
        if layer.bias is None:
            return None
        return torch.nn.Parameter(torch.empty_like(layer.bias, device=self.device), requires_grad=False)

    def output_head(self, layer: Linear, name: str) -> torch.nn.Module:
        format_for_floats = BlockFormat.Q8_0 if self.policy.float_format is not None else None
        return self._finish_linear(layer, self._weight([name], format_for_floats), name)

    def _finish_linear(self, layer: Linear, weight: Union[PackedWeight, list[torch.Tensor]], label: str) -> torch.nn.Module:
        """Model files copy biases in afterwards, into `.bias` of whatever this returns."""
        if not isinstance(weight, PackedWeight):
            layer = layer.to_empty(device=self.device)
            copy_rows(layer.weight, weight, label)
            return layer
        bias = self._packed_layer_bias(layer, (weight.out_features, weight.in_features), label)
        return QuantizedLinear(PackedWeight(weight.blocks.to(self.device), weight.format, weight.in_features), bias)

    def embedding(self, layer: Embedding, name: str) -> torch.nn.Module:
        format_for_floats = BlockFormat.Q8_0 if self.policy.float_format is not None else None
        weight = self._weight([name], format_for_floats)
        if isinstance(weight, PackedWeight):
            return QuantizedEmbedding(PackedWeight(weight.blocks.to(self.device), weight.format, weight.in_features),
                                      layer.weight.dtype)
        layer = layer.to_empty(device=self.device)
        copy_rows(layer.weight, weight, name)
        return layer

    def tied_head(self, embedding: torch.nn.Module, layer: Linear) -> torch.nn.Module:
        """The output head sharing the embedding's storage (float weight or blocks)."""
        if isinstance(embedding, QuantizedEmbedding):
            return QuantizedLinear(embedding.packed)
        layer = layer.to_empty(device=self.device)
        layer.weight = embedding.weight
        return layer
