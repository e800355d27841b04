"""Linear layers and token embeddings whose weights stay in quantized blocks (GGUF's, and MXFP4
experts), and experts whose weights stay in bfloat16 in a float32 model.

Invariant: the blocks are the only copy of the weight; a forward pass never keeps a float copy.
On a CPU with the native kernels, small batches (decode) multiply the blocks directly and
large ones (prefill) dequantize one layer at a time into a transient float matrix for BLAS
(the kernel decides, so that a compiled graph has no branch on the batch size); elsewhere (no
kernels, other devices) the torch reference dequantizes per call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.quant.blocks import BlockFormat, PackedWeight, dequantize
from pdserve.models.quant.mxfp4 import Mxfp4Weight


def _uses_native_kernels(blocks: torch.Tensor) -> bool:
    return blocks.device.type == "cpu" and cpu_kernels_available()


class QuantizedLinear(torch.nn.Module):
    """y = x @ W.T (+ bias) with W held as blocks (see `blocks.py`)."""

    def __init__(self, weight: PackedWeight, bias: Optional[torch.nn.Parameter] = None):
        super().__init__()
        self.register_buffer("blocks", weight.blocks)
        self.format = weight.format
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = bias
        self.native = _uses_native_kernels(weight.blocks)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.blocks, self.format, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.label}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.native:
            out = self._native(rows.float()).to(x.dtype)
        else:
            out = F.linear(rows, dequantize(self.packed, x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _native(self, rows: torch.Tensor) -> torch.Tensor:
        if self.format is BlockFormat.Q4_1:
            return ops().q4_1_linear(rows, self.blocks)
        return ops().q8_0_linear(rows, self.blocks)


class CompactLinear(torch.nn.Module):
    """y = x @ W.T (+ bias) with W kept in `rows`, a form narrower than the model's dtype that the
    native experts read themselves (`moe_native.py`). This forward, the torch path's, makes the
    float32 `weight` per call (no copy is kept); subclasses say how."""

    format_label = ""

    def __init__(self, rows: torch.Tensor, in_features: int, out_features: int,
                 bias: Optional[torch.nn.Parameter] = None):
        super().__init__()
        self.register_buffer("rows", rows)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_label}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)


class Mxfp4Linear(CompactLinear):
    """W kept in MXFP4 (`Mxfp4Weight`); `weight` dequantizes it (exactly)."""

    format_label = "mxfp4"

    def __init__(self, weight: Mxfp4Weight, bias: Optional[torch.nn.Parameter] = None):
        super().__init__(weight.rows, weight.in_features, weight.out_features, bias)

    @property
    def packed(self) -> Mxfp4Weight:
        return Mxfp4Weight(self.rows, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.dequantize()


class Bfloat16Linear(CompactLinear):
    """W kept as the checkpoint's bfloat16 rows in a float32 model: every bfloat16 value widens to
    float32 exactly, so the native experts, which widen in registers, compute what float32 weights
    compute, from half the bytes; `weight` widens it."""

    format_label = "bfloat16"

    def __init__(self, rows: torch.Tensor, bias: Optional[torch.nn.Parameter] = None):
        if rows.dtype != torch.bfloat16 or rows.dim() != 2:
            raise ValueError(f"bfloat16 rows must be a bfloat16 matrix, not {rows.dtype} {tuple(rows.shape)}")
        super().__init__(rows.contiguous(), rows.shape[1], rows.shape[0], bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.rows.float()


class QuantizedEmbedding(torch.nn.Module):
    """Token rows looked up in blocks and dequantized on the fly (only the rows asked for)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("blocks", weight.blocks)
        self.format = weight.format
        self.embedding_dim = weight.in_features
        self.dtype = dtype
        self.native = _uses_native_kernels(weight.blocks)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.blocks, self.format, self.embedding_dim)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[token_ids.reshape(-1)]
        if self.native:
            values = ops().dequantize_blocks(rows, self.format.block_bytes)
        else:
            values = dequantize(PackedWeight(rows, self.format, self.embedding_dim))
        return values.to(self.dtype).reshape(*token_ids.shape, self.embedding_dim)
