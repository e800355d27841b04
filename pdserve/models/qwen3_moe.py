"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, a softmax-routed mixture of experts in most layers.

A layer is sparse unless `mlp_only_layers` lists it or it falls between `decoder_sparse_step`
strides (layer i is sparse when (i + 1) % step == 0); dense layers keep Qwen3's gated MLP of
`intermediate_size`. The router takes the softmax over all experts, keeps the top k and, with
`norm_topk_prob`, renormalises them. Experts load from the hub's per-expert tensors
(`experts.<e>.gate_proj.weight`, ...) or from the fused layout of `transformers` 5
(`experts.gate_up_proj` [E, 2I, hidden], gate rows first, and `experts.down_proj` [E, hidden, I]).
Under tensor parallelism (`qwen3_moe_sharded_args`) dense layers split as Qwen3's do and each rank
keeps a slice of every expert (`moe_sharding`), whichever layout the experts came in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from pdserve.models.decoder_args import fields_of
from pdserve.models.hf_config import require
from pdserve.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM, qwen3_args
from pdserve.models.moe import Experts, ExpertWeights, SoftmaxThenTopK, SparseMoE, silu_and_mul
from pdserve.models.moe_sharding import ExpertShard, expert_width_per_rank, sharded_experts
from pdserve.models.tensor_parallel import TensorParallelShard, sharded_args
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import copy_rows


@dataclass(frozen=True, slots=True)
class Qwen3MoeArgs(LlamaArgs):
    """Qwen3's args (attention, norms, embeddings; `intermediate_size` is the dense layers' MLP width)
    and the experts'."""

    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    expert_shard: Optional[ExpertShard] = None  # this rank's slice of every expert; None: whole experts


def qwen3_moe_args(config: Mapping[str, Any]) -> Qwen3MoeArgs:
    qwen3 = qwen3_args(config)
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = frozenset(i for i in range(qwen3.num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return Qwen3MoeArgs(
        **fields_of(qwen3),
        num_experts=num_experts,
        experts_per_token=int(require(config, "num_experts_per_tok")),
        moe_intermediate_size=int(require(config, "moe_intermediate_size")),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def qwen3_moe_sharded_args(args: Qwen3MoeArgs, shard: TensorParallelShard) -> Qwen3MoeArgs:
    """A rank's args: Qwen3's split of attention and dense MLP, and `moe_intermediate_size / size`
    units of every expert; ModelLoadError when the ranks do not divide the expert width."""
    return dataclasses.replace(sharded_args(args, shard),
                               moe_intermediate_size=expert_width_per_rank(args.moe_intermediate_size, shard.size),
                               expert_shard=ExpertShard(shard.rank, shard.size))


def qwen3_moe_expert_weights(weights: WeightLoader, prefix: str):
    """Per-expert float weights under `{prefix}` (`...mlp.experts.`), per-expert or fused layout."""
    get = weights.get
    if weights.source.has(prefix + "gate_up_proj"):
        gate_up, down = get(prefix + "gate_up_proj"), get(prefix + "down_proj")
        half = gate_up.shape[1] // 2
        return lambda e: ExpertWeights(gate=gate_up[e, :half], up=gate_up[e, half:], down=down[e])
    return lambda e: ExpertWeights(gate=get(f"{prefix}{e}.gate_proj.weight"), up=get(f"{prefix}{e}.up_proj.weight"),
                                   down=get(f"{prefix}{e}.down_proj.weight"))


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Qwen3's layer with a sparse MoE in place of the dense MLP where the config says so."""

    def __init__(self, args: Qwen3MoeArgs, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(args, layer_id, dtype, device)
        self.is_sparse = layer_id in args.sparse_layers
        self.expert_shard = args.expert_shard
        if self.is_sparse:
            k, renormalize = args.experts_per_token, args.norm_topk_prob
            experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size, silu_and_mul,
                              False, dtype)
            self.mlp = SparseMoE(args.hidden_size, args.num_experts,
                                 SoftmaxThenTopK(k, renormalize), experts, False, dtype,
                                 device)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        if not self.is_sparse:
            super().load(weights, prefix)
            return
        copy_rows(self.input_norm, [weights.get(prefix + "input_layernorm.weight")], prefix + "input_layernorm")
        post_name = prefix + "post_attention_layernorm"
        copy_rows(self.post_attention_norm, [weights.get(post_name + ".weight")], post_name)
        self.self_attn.load(weights, prefix + "self_attn.")
        mlp = prefix + "mlp."
        self.mlp.load_router(weights.get(mlp + "gate.weight"), None, mlp)
        experts = sharded_experts(qwen3_moe_expert_weights(weights, mlp + "experts."), self.expert_shard)
        self.mlp.experts.load(weights, experts, mlp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, args: Qwen3MoeArgs, dtype: torch.dtype, device: torch.device):
        super().__init__(args, dtype, device, architecture="qwen3_moe",
                         make_layer=lambda i: Qwen3MoeDecoderLayer(args, i, dtype, device))
