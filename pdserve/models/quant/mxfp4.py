"""MXFP4 (OCP microscaling FP4), the format gpt-oss checkpoints ship their expert weights in.

A weight row is cut into groups of 32 values; each group is 16 bytes of 4-bit E2M1 codes (two per
byte, the low nibble first) and one E8M0 scale byte, the power of two 2^(scale - 127) that
multiplies the group:

    <name>_blocks  uint8 [..., rows, groups, 16]    value 2j of a group: blocks[..., j] & 0xF
    <name>_scales  uint8 [..., rows, groups]        value 2j+1:          blocks[..., j] >> 4

E2M1 codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same values negated.
Invariant: dequantization is exact: every FP4 value times a power of two is a float32 (no
rounding happens), so any correct dequantizer gives these bits.

On the CPU, gpt-oss's experts stay in MXFP4 (`Mxfp4Weight`: a seventh of float32's bytes), each
row its groups one after another, a group its scale byte and then its 16 code bytes, which is
what the native experts (kernels/moe_experts.cpp) read:

    row j   | s | b0 b1 .. b15 | s | b0 .. b15 | ...        uint8 [rows, in / 32 * 17]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

BLOCK_VALUES = 32  # values per scale
BLOCK_BYTES = BLOCK_VALUES // 2
SCALE_BIAS = 127
NAN_SCALE = 255  # E8M0's one NaN
KEPT_GROUP_BYTES = 1 + BLOCK_BYTES  # a group as `Mxfp4Weight` keeps it: scale byte, then codes
# Magnitudes of the eight non-negative E2M1 codes; bit 3 of a code is its sign.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values the 4-bit codes stand for, indexed by code."""
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=dtype)
    return torch.cat([magnitudes, -magnitudes])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, groups * 32] from blocks uint8 [..., rows, groups, 16] and scales uint8
    [..., rows, groups]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = e2m1_table()
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., groups, 16, 2]: low nibble first
    values = table[codes].flatten(-2)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a float weight [..., rows, cols] (cols a multiple of 32), each group's
    scale the smallest power of two that keeps its largest magnitude within 6, each value rounded
    to the nearest E2M1 value. For fixtures and benchmarks: real checkpoints arrive quantized."""
    *lead, cols = weight.shape
    if cols % BLOCK_VALUES:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK_VALUES} values, not {cols}")
    groups = weight.float().reshape(*lead, cols // BLOCK_VALUES, BLOCK_VALUES)
    largest = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    table = e2m1_table()
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # nearest value (+0 before -0)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK_BYTES, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)


@dataclass(frozen=True, slots=True)
class Mxfp4Weight:
    """A [out_features, in_features] weight kept in MXFP4, laid out as the module docstring draws
    it: `rows` uint8 [out_features, in_features / 32 * 17]."""

    rows: torch.Tensor
    in_features: int

    @staticmethod
    def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> "Mxfp4Weight":
        """From a checkpoint's blocks uint8 [rows, groups, 16] and scales uint8 [rows, groups];
        ValueError on a NaN scale (no float stands for its values)."""
        if blocks.dim() != 3 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_BYTES:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
        if bool((scales == NAN_SCALE).any()):
            raise ValueError("an MXFP4 scale is NaN (255)")
        rows = torch.cat([scales.unsqueeze(-1), blocks], dim=-1).reshape(blocks.shape[0], -1).contiguous()
        return Mxfp4Weight(rows, blocks.shape[1] * BLOCK_VALUES)

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    def blocks_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self.rows.reshape(self.out_features, -1, KEPT_GROUP_BYTES)
        return groups[..., 1:], groups[..., 0]

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features], exactly (see the module docstring)."""
        return dequantize_mxfp4(*self.blocks_and_scales())

    def output_rows(self, units: slice) -> "Mxfp4Weight":
        return Mxfp4Weight(self.rows[units].contiguous(), self.in_features)

    def input_columns(self, units: slice) -> Optional["Mxfp4Weight"]:
        """The weight cut to input features `units`, or None where the cut splits a group."""
        start, stop = units.indices(self.in_features)[:2]
        if start % BLOCK_VALUES or stop % BLOCK_VALUES:
            return None
        groups = self.rows.reshape(self.out_features, -1, KEPT_GROUP_BYTES)
        kept = groups[:, start // BLOCK_VALUES : stop // BLOCK_VALUES]
        return Mxfp4Weight(kept.reshape(self.out_features, -1).contiguous(), stop - start)


def concat_output_rows(parts: Sequence[Mxfp4Weight]) -> Mxfp4Weight:
    """Stack weights of one input width along the output dimension (gate|up fusion)."""
    if len({part.in_features for part in parts}) != 1:
        raise ValueError("cannot fuse MXFP4 weights of different input widths")
    return Mxfp4Weight(torch.cat([part.rows for part in parts]), parts[0].in_features)
