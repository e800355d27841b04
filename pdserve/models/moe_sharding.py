"""Tensor-parallel slices of mixture-of-experts layers: every rank holds a slice of every expert.

Experts are split the way the dense MLP is (not handed out whole, which would be expert
parallelism): rank r of N keeps rows [r*I/N, (r+1)*I/N) of each expert's gate and up projections
and the same columns of its down projection. Gate unit i and up unit i stay on one rank, so the
gated activation (elementwise over the I units, gpt-oss's clamp included) never crosses ranks:

    expert e    gate, up rows   0 .. I/2-1 | I/2 .. I-1        N = 2
                gate, up bias   0 .. I/2-1 | I/2 .. I-1
                down columns    0 .. I/2-1 | I/2 .. I-1
                down bias       whole      | zeros             added once, after the sum
    router      replicated: every rank routes every token to the same k experts

Invariant: summed over the ranks, the sharded experts' outputs equal the whole experts' output,
so one all-reduce after the experts (`tensor_parallel.wrap_row_parallel`) completes the layer.
Slices are cut from the weights the model file produces: float (fused layouts taken apart), or
MXFP4 rows kept whole where the cut falls between 32-weight groups (rows of gate and up always;
down's columns when the slice is whole groups); an expert whose down cut would split a group is
dequantized first, so no quantization block decides where a cut falls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.models.hf_config import ModelLoadError
from pdserve.models.moe import ExpertWeights
from pdserve.models.quant.mxfp4 import Mxfp4Weight

ExpertSource = Callable[[int], ExpertWeights]  # expert index -> that expert's whole weights (float or MXFP4)


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """This rank's place among `size` ranks, as the experts see it."""

    rank: int
    size: int

    def units(self, intermediate_size: int) -> slice:
        """This rank's intermediate units of an expert `intermediate_size` wide (a multiple of size)."""
        width = intermediate_size // self.size
        return slice(self.rank * width, (self.rank + 1) * width)

    def cut(self, weights: ExpertWeights) -> ExpertWeights:
        """This rank's slice of one expert's whole weights (rows = outputs, as `ExpertWeights` holds them)."""
        if isinstance(weights.gate, Mxfp4Weight):
            units = self.units(weights.gate.out_features)
            down = weights.down.input_columns(units)
            if down is None:  # the cut splits a group: this expert's slice in float
                return self.cut(weights.dequantized())
            gate, up = weights.gate.output_rows(units), weights.up.output_rows(units)
        else:
            units = self.units(weights.gate.shape[0])
            gate, up, down = (weights.gate[units].contiguous(), weights.up[units].contiguous(),
                              weights.down[:, units].contiguous())
        return ExpertWeights(
            gate=gate,
            up=up,
            down=down,
            gate_bias=None if weights.gate_bias is None else weights.gate_bias[units].contiguous(),
            up_bias=None if weights.up_bias is None else weights.up_bias[units].contiguous(),
            down_bias=self._added_once(weights.down_bias),
        )

    def _added_once(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if bias is None or self.rank == 0:
            return bias
        return torch.zeros_like(bias)


def expert_split_problem(intermediate_size: int, size: int) -> Optional[str]:
    """Why `size` ranks cannot split experts `intermediate_size` wide (None when they can)."""
    if intermediate_size % size:
        return f"--tensor-parallel-size {size} does not divide the model's expert width {intermediate_size}"
    return None


def expert_width_per_rank(intermediate_size: int, size: int) -> int:
    """A rank's share of experts `intermediate_size` wide; ModelLoadError when `size` does not divide it."""
    problem = expert_split_problem(intermediate_size, size)
    if problem is not None:
        raise ModelLoadError(problem)
    return intermediate_size // size


def sharded_experts(source: ExpertSource, shard: Optional[ExpertShard]) -> ExpertSource:
    """`source` cut to this rank's slices; `source` itself on one rank (shard None)."""
    if shard is None:
        return source
    return lambda expert: shard.cut(source(expert))
