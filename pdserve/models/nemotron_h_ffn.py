"""Nemotron-H's feed-forward mixers: the dense MLP (up -> activation -> down, no gate; relu^2 by default)
and the mixture of experts built from such MLPs.

The mixture routes each token by sigmoid scores: a per-expert correction bias shifts the scores used
to choose (never the weights), experts come in `num_groups` groups of which the `top_groups` whose
two best shifted scores sum highest stay eligible, and the k best eligible experts are kept; their
unshifted scores, optionally renormalised to sum to one, times `routed_scaling_factor`, weigh them.
Experts may run in a narrower latent space (`latent_size`: down-project before, up-project after).
A shared expert (one dense MLP) always runs on the block's input and is added.

Under tensor parallelism (`shard`) each rank holds a slice of every expert and of the shared expert
(`moe_sharding`: up rows and down columns of its units; a down or latent-output bias added by rank 0
only) and a whole router, so its output is a partial sum the caller all-reduces once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pdserve.models.layers import activation_named
from pdserve.models.moe import Routing, run_by_expert
from pdserve.models.moe_sharding import ExpertShard
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import copy_rows, empty_linear, empty_param

Activation = Callable[[torch.Tensor], torch.Tensor]


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def ffn_activation(name: str) -> Activation:
    return relu_squared if name == "relu2" else activation_named(name)


def _load_linear(weights: WeightLoader, layer: torch.nn.Module, name: str) -> torch.nn.Module:
    """`layer` filled from `{name}.weight` (and `.bias` when it has one)."""
    layer = weights.linear(layer, [name + ".weight"], name)
    if layer.bias is not None:
        copy_rows(layer.bias, [weights.get(name + ".bias")], name + " bias")
    return layer


def _load_part(weights: WeightLoader, layer: torch.nn.Module, name: str, shard: Optional[ExpertShard],
               rows: bool) -> torch.nn.Module:
    """One projection, whole or (`shard`) this rank's units of it."""
    return _load_linear(weights, layer, name) if shard is None else _load_slice(weights, layer, name, shard, rows)


def _load_slice(weights: WeightLoader, layer: torch.nn.Module, name: str, shard: ExpertShard,
                rows: bool) -> torch.nn.Module:
    """`layer` filled from this rank's units of `{name}.weight`: its rows (an up projection, its bias
    too) or its columns (a down projection, whose bias rank 0 adds)."""
    weight = weights.get(name + ".weight")
    units = shard.units(weight.shape[0 if rows else 1])
    layer = weights.linear_from_tensors(layer, [weight[units] if rows else weight[:, units].contiguous()], name)
    if layer.bias is not None:
        bias = weights.get(name + ".bias")
        copy_rows(layer.bias, [bias[units] if rows else _added_once(bias, shard)], name + " bias")
    return layer


def _added_once(bias: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    return bias if shard.rank == 0 else torch.zeros_like(bias)


class DenseMLP(torch.nn.Module):
    def __init__(self, input_size: int, intermediate_size: int, activation: Activation, bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.activation = activation
        self.up_proj = empty_linear(input_size, intermediate_size, bias, dtype)
        self.down_proj = empty_linear(intermediate_size, input_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.up_proj(x)))

    def load(self, weights: WeightLoader, prefix: str, shard: Optional[ExpertShard] = None) -> None:
        """Whole, or this rank's units (`shard`: then the caller sums the ranks' outputs)."""
        self.up_proj = _load_part(weights, self.up_proj, prefix + "up_proj", shard, rows=True)
        self.down_proj = _load_part(weights, self.down_proj, prefix + "down_proj", shard, rows=False)


@dataclass(frozen=True, slots=True)
class MoEGeometry:
    num_experts: int
    experts_per_token: int
    intermediate_size: int  # per routed expert
    shared_intermediate_size: int
    latent_size: int  # 0: the experts run at the hidden size
    num_groups: int
    top_groups: int
    renormalize: bool
    routed_scaling_factor: float


def sigmoid_group_top_k(logits: torch.Tensor, correction_bias: torch.Tensor, geometry: MoEGeometry) -> Routing:
    """Router logits [n, experts] -> (weights [n, k] float32, expert ids [n, k]); see the module docstring."""
    g = geometry
    scores = torch.sigmoid(logits.float())
    choice = scores + correction_bias
    grouped = choice.view(-1, g.num_groups, g.num_experts // g.num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [n, groups]
    kept_groups = group_scores.topk(g.top_groups, dim=-1).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    choice = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view(-1, g.num_experts)
    ids = choice.topk(g.experts_per_token, dim=-1).indices
    weights = scores.gather(1, ids)
    if g.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * g.routed_scaling_factor, ids


class NemotronHMoE(torch.nn.Module):
    def __init__(self, hidden_size: int, geometry: MoEGeometry, activation: Activation, bias: bool,
                 dtype: torch.dtype, device: torch.device, shard: Optional[ExpertShard] = None):
        super().__init__()
        g = self.geometry = geometry  # under tensor parallelism: widths are this rank's share
        self.shard = shard
        self.activation = activation
        # The router runs in float32 whatever the model dtype (its scores are compared across experts).
        self.router_weight = empty_param((g.num_experts, hidden_size), torch.float32, device)
        self.correction_bias = empty_param((g.num_experts,), torch.float32, device)
        expert_input = g.latent_size or hidden_size
        self.up = torch.nn.ModuleList(empty_linear(expert_input, g.intermediate_size, False, dtype)
                                      for _ in range(g.num_experts))
        self.down = torch.nn.ModuleList(empty_linear(g.intermediate_size, expert_input, False, dtype)
                                        for _ in range(g.num_experts))
        self.to_latent = empty_linear(hidden_size, g.latent_size, bias, dtype) if g.latent_size else None
        self.from_latent = empty_linear(g.latent_size, hidden_size, bias, dtype) if g.latent_size else None
        self.shared = DenseMLP(hidden_size, g.shared_intermediate_size, activation, bias, dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.down[expert](self.activation(self.up[expert](x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sigmoid_group_top_k(F.linear(x.float(), self.router_weight), self.correction_bias,
                                           self.geometry)
        routed_input = x if self.to_latent is None else self.to_latent(x)
        routed = run_by_expert(routed_input, (weights, ids), self.geometry.num_experts, self._expert)
        if self.from_latent is not None:
            routed = self.from_latent(routed)
        return routed + self.shared(x)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        """`{prefix}` is the block's mixer; experts as transformers saves them (`experts.<e>.up_proj.weight`)."""
        copy_rows(self.router_weight, [weights.get(prefix + "gate.weight")], prefix + "gate")
        copy_rows(self.correction_bias, [weights.get(prefix + "gate.e_score_correction_bias")], prefix + "gate bias")
        for e in range(self.geometry.num_experts):
            expert = f"{prefix}experts.{e}."
            self.up[e] = _load_part(weights, self.up[e], expert + "up_proj", self.shard, rows=True)
            self.down[e] = _load_part(weights, self.down[e], expert + "down_proj", self.shard, rows=False)
        if self.to_latent is not None:
            self.to_latent = _load_linear(weights, self.to_latent, prefix + "fc1_latent_proj")
            self.from_latent = _load_linear(weights, self.from_latent, prefix + "fc2_latent_proj")
            if self.shard is not None and self.from_latent.bias is not None:  # after the routed partial sum
                self.from_latent.bias.copy_(_added_once(self.from_latent.bias, self.shard))
        self.shared.load(weights, prefix + "shared_experts.", self.shard)
