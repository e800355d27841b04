"""Block-quantized weight formats: GGUF's Q4_1 and Q8_0, packed, converted and dequantized with torch.

Invariant: a `PackedWeight` holds exactly the bytes the native kernels read, one row of blocks
per output feature, and `dequantize` reproduces the weights those bytes stand for (the
reference every kernel is tested against). Q4_0 is stored as Q4_1 (an exact rewrite).

    one output row, 32 weights per block along the input dimension (d, m: IEEE half):

    Q4_1 block, 20 bytes  | d | m | qs[16] |  w[j] = d*(qs[j] & 15) + m, w[j+16] = d*(qs[j] >> 4) + m
    Q8_0 block, 34 bytes  | d | qs[32]     |  w[j] = d*qs[j]  (qs signed)
    Q4_0 block, 18 bytes  | d | qs[16]     |  w[j] = d*((qs[j] & 15) - 8): as Q4_1 with m = -8d
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch

GROUP_SIZE = 32


class BlockFormat(enum.Enum):
    Q4_1 = ("q4_1", 20)
    Q8_0 = ("q8_0", 34)

    def __init__(self, label: str, block_bytes: int):
        self.label = label
        self.block_bytes = block_bytes


Q4_0_BLOCK_BYTES = 18


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [out_features, in_features] weight as rows of blocks: uint8 [out_features, in/32 * block_bytes]."""

    blocks: torch.Tensor
    format: BlockFormat
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def rows(self, index: torch.Tensor) -> "PackedWeight":
        """The weight with its output rows reordered or selected by `index`."""
        return PackedWeight(self.blocks[index], self.format, self.in_features)


def concat_rows(parts: Sequence[PackedWeight]) -> PackedWeight:
    """Stack weights along the output dimension (q|k|v or gate|up fusion)."""
    formats = {part.format for part in parts}
    widths = {part.in_features for part in parts}
    if len(formats) != 1 or len(widths) != 1:
        raise ValueError(f"cannot fuse packed weights of formats {formats} and widths {widths}")
    return PackedWeight(torch.cat([part.blocks for part in parts]), parts[0].format, parts[0].in_features)


def _halves(blocks: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """`count` IEEE half floats per block starting at byte `offset`, as float32 [rows, blocks, count]."""
    rows, num_blocks = blocks.shape[0], blocks.shape[1]
    raw = blocks[:, :, offset : offset + 2 * count].contiguous()
    return raw.view(torch.float16).reshape(rows, num_blocks, count).float()


def dequantize(weight: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weights [out_features, in_features] the blocks stand for."""
    rows = weight.out_features
    blocks = weight.blocks.reshape(rows, -1, weight.format.block_bytes)
    d = _halves(blocks, 0, 1)
    if weight.format is BlockFormat.Q4_1:
        m = _halves(blocks, 2, 1)
        qs = blocks[:, :, 4:]
        codes = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        values = d * codes + m
    else:
        values = d * blocks[:, :, 2:].contiguous().view(torch.int8).float()
    return values.reshape(rows, weight.in_features).to(dtype)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float [..., n] -> the IEEE half encodings as uint8 [..., 2n]."""
    halves = values.to(torch.float16).contiguous()
    return halves.view(torch.uint8).reshape(*values.shape[:-1], 2 * values.shape[-1])


def _grouped(weight: torch.Tensor) -> torch.Tensor:
    rows, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"in_features {in_features} is not a multiple of {GROUP_SIZE}")
    return weight.float().reshape(rows, in_features // GROUP_SIZE, GROUP_SIZE)


def quantize_q4_1(weight: torch.Tensor) -> PackedWeight:
    """Asymmetric 4-bit blocks: each block spans its own [min, max] in 15 steps."""
    groups = _grouped(weight)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / 15).to(torch.float16).float()  # round the scale first: codes use what is stored
    m = low.to(torch.float16).float()
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round((groups - m) * inverse).clamp_(0, 15).to(torch.uint8)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    blocks = torch.cat([_half_bytes(d), _half_bytes(m), qs], dim=-1)
    return PackedWeight(blocks.reshape(weight.shape[0], -1).contiguous(), BlockFormat.Q4_1, weight.shape[1])


def quantize_q8_0(weight: torch.Tensor) -> PackedWeight:
    """Symmetric 8-bit blocks: scale max|w| / 127."""
    groups = _grouped(weight)
    d = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(groups * inverse).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat([_half_bytes(d), codes.view(torch.uint8)], dim=-1)
    return PackedWeight(blocks.reshape(weight.shape[0], -1).contiguous(), BlockFormat.Q8_0, weight.shape[1])


def q4_0_as_q4_1(raw: torch.Tensor, in_features: int) -> PackedWeight:
    """GGUF Q4_0 rows (uint8 [rows, in/32 * 18]) rewritten as Q4_1 with m = -8d (exact in half)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_0_BLOCK_BYTES)
    d = _halves(blocks, 0, 1)
    q4_1 = torch.cat([blocks[:, :, :2], _half_bytes(-8 * d), blocks[:, :, 2:]], dim=-1)
    return PackedWeight(q4_1.reshape(rows, -1).contiguous(), BlockFormat.Q4_1, in_features)
