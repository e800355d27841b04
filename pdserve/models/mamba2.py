"""The Mamba2 mixer over a flat batch: input projection, short causal convolution, selective scan
(`ssd_scan`), gated grouped RMSNorm and output projection, carrying each sequence's state through
the `RecurrentStateContext`.

Invariant: a sequence's output and final state do not depend on how its rows are cut into passes or
batched with other sequences (up to float32 rounding): every pass starts from the state the context
reads and writes back the state after the sequence's last row.

    in_proj row: | z (gate) : inner | x : inner | B : groups*N | C : groups*N | dt : heads |
                                    |<------- conv channels -------------->|
    state:       conv window [conv_channels, kernel - 1], ssm state [heads, head_dim, N]

Under tensor parallelism the geometry is one rank's share of the heads and groups and `load` cuts
the whole tensors to it (`state_sharding`); `out_proj` is then row parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.base import RecurrentStateContext
from pdserve.models.short_conv import causal_conv
from pdserve.models.state_sharding import StateShard, cut_rows, refuse_state_split
from pdserve.models.ssd_scan import ssd_chunked_scan, ssd_step
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import copy_rows, empty_linear, empty_param


@dataclass(frozen=True, slots=True)
class Mamba2Geometry:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int  # heads share B and C in groups; the gated norm also normalises per group
    state_size: int  # N
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    time_step_min: float  # dt is clamped from below after softplus
    norm_eps: float
    state_dtype: str  # a key of STATE_DTYPE_BYTES

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(kind="mamba2", conv_channels=self.conv_channels, conv_window=self.conv_kernel - 1,
                                  recurrent_shape=(self.num_heads, self.head_dim, self.state_size),
                                  dtype=self.state_dtype,
                                  conv_parts=(self.inner_size, self.num_groups * self.state_size,
                                              self.num_groups * self.state_size))


def mamba2_rank_geometry(geometry: Mamba2Geometry, size: int) -> Mamba2Geometry:
    """One rank's share of the heads and groups; UnsupportedModelFeature when `size` does not divide
    them (groups are not replicated: the grouped norm would span ranks)."""
    refuse_state_split(size, "Mamba2", [("heads", geometry.num_heads), ("groups", geometry.num_groups)])
    return dataclasses.replace(geometry, num_heads=geometry.num_heads // size,
                               num_groups=geometry.num_groups // size)


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, num_groups: int,
                         eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over each of `num_groups` equal slices of the last dim, in float32;
    cast to the weight's dtype before the scale."""
    gated = y.float() * F.silu(gate.float())
    grouped = gated.view(*gated.shape[:-1], num_groups, -1)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view_as(gated).to(weight.dtype)


class Mamba2Mixer(torch.nn.Module):
    """One Mamba2 mixer; `forward` takes the normed residual stream and returns its contribution."""

    def __init__(self, geometry: Mamba2Geometry, layer_id: int, activation: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, device: torch.device, shard: Optional[StateShard] = None):
        super().__init__()
        self.geometry = g = geometry
        self.shard = shard  # None: the whole mixer; else `geometry` is this rank's share
        self.layer_id = layer_id
        self.activation = activation
        projection_rows = g.inner_size + g.conv_channels + g.num_heads
        self.in_proj = empty_linear(g.hidden_size, projection_rows, g.proj_bias, dtype)
        self.out_proj = empty_linear(g.inner_size, g.hidden_size, g.proj_bias, dtype)
        self.conv_weight = empty_param((g.conv_channels, g.conv_kernel), dtype, device)
        self.conv_bias = empty_param((g.conv_channels,), dtype, device) if g.conv_bias else None
        # The scan runs in float32 whatever the model dtype; these per-head constants stay float32.
        self.A_log = empty_param((g.num_heads,), torch.float32, device)
        self.dt_bias = empty_param((g.num_heads,), torch.float32, device)
        self.D = empty_param((g.num_heads,), torch.float32, device)
        self.norm_weight = empty_param((g.inner_size,), dtype, device)

    def forward(self, h: torch.Tensor, context: RecurrentStateContext) -> torch.Tensor:  # type: ignore[override]
        g = self.geometry
        num_rows = h.shape[0]
        gate, xBC, dt = self.in_proj(h).split([g.inner_size, g.conv_channels, g.num_heads], dim=-1)
        starts = context.sequence_starts()
        window, ssm_state = context.read_state(self.layer_id)
        xBC, window = causal_conv(xBC, starts, window, self.conv_weight, self.conv_bias)
        group_width = g.num_groups * g.state_size
        x, B, C = self.activation(xBC).split([g.inner_size, group_width, group_width], dim=-1)
        x = x.reshape(num_rows, g.num_heads, g.head_dim)
        B = B.reshape(num_rows, g.num_groups, g.state_size)
        C = C.reshape(num_rows, g.num_groups, g.state_size)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(min=g.time_step_min)
        A = -torch.exp(self.A_log)
        if num_rows == len(starts) - 1:  # one row per sequence: decode
            y, new_state = ssd_step(ssm_state, x, dt, A, B, C)
        else:
            y, new_state = ssd_chunked_scan(x, dt, A, B, C, starts, ssm_state)
        context.write_state(self.layer_id, window, new_state.to(ssm_state.dtype))
        y = y + x.float() * self.D.unsqueeze(-1)
        y = gated_group_rms_norm(y.reshape(num_rows, g.inner_size), gate, self.norm_weight, g.num_groups, g.norm_eps)
        return self.out_proj(y.to(h.dtype))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        """`{prefix}` is the block's mixer (`...layers.<i>.mixer.`), names as transformers saves them; a
        rank keeps its heads' and groups' rows."""
        shard = self.shard
        spans = None if shard is None else _rank_spans(self.geometry, shard)

        def get(name: str, kind: str = "") -> torch.Tensor:
            """The whole tensor, or this rank's rows of it by the `kind` of its row blocks."""
            whole = weights.get(prefix + name)
            if shard is None or spans is None or not kind:
                return whole
            return _cut(whole, spans[kind], shard.size)

        if spans is None:
            self.in_proj = weights.linear(self.in_proj, [prefix + "in_proj.weight"], prefix + "in_proj")
            self.out_proj = weights.linear(self.out_proj, [prefix + "out_proj.weight"], prefix + "out_proj")
        else:
            out_proj = weights.get(prefix + "out_proj.weight")[:, spans["inner"][0]].contiguous()
            self.in_proj = weights.linear_from_tensors(self.in_proj, [get("in_proj.weight", "in_proj")],
                                                       prefix + "in_proj")
            self.out_proj = weights.linear_from_tensors(self.out_proj, [out_proj], prefix + "out_proj")
        if self.in_proj.bias is not None:
            copy_rows(self.in_proj.bias, [get("in_proj.bias", "in_proj")], prefix + "in_proj bias")
        if self.out_proj.bias is not None:
            bias = get("out_proj.bias")
            copy_rows(self.out_proj.bias, [bias if shard is None else shard.added_once(bias)],
                      prefix + "out_proj bias")
        conv = get("conv1d.weight", "conv")  # [channels, 1, kernel]
        copy_rows(self.conv_weight, [conv.reshape(conv.shape[0], -1)], prefix + "conv1d")
        if self.conv_bias is not None:
            copy_rows(self.conv_bias, [get("conv1d.bias", "conv")], prefix + "conv1d bias")
        for param, name, kind in ((self.A_log, "A_log", "heads"), (self.dt_bias, "dt_bias", "heads"),
                                  (self.D, "D", "heads"), (self.norm_weight, "norm.weight", "inner")):
            copy_rows(param, [get(name, kind)], prefix + name)


def _rank_spans(geometry: Mamba2Geometry, shard: StateShard) -> dict[str, list[slice]]:
    """A rank's rows of each row block of each kind of tensor (`geometry` is the rank's share):
    in_proj [z | x | B | C | dt], conv [x | B | C], per head, per inner channel (x, z, norm)."""
    g, size = geometry, shard.size
    inner = shard.rows(g.num_heads * size, g.head_dim)
    groups = shard.rows(g.num_groups * size, g.state_size)
    heads = shard.share(g.num_heads * size)
    return {"in_proj": [inner, inner, groups, groups, heads], "conv": [inner, groups, groups],
            "heads": [heads], "inner": [inner]}


def _cut(whole: torch.Tensor, spans: list[slice], size: int) -> torch.Tensor:
    """`whole`'s row blocks (each `size` times its span's width) cut to the spans, concatenated."""
    parts = whole.split([(span.stop - span.start) * size for span in spans])
    return torch.cat(cut_rows(parts, spans))
