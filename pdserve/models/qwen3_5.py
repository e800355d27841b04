"""Qwen3.5 (text: `Qwen3_5ForCausalLM`) and Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers
interleaved with gated full attention, dense MLPs (Qwen3.5) or mixtures of experts with a gated shared
expert (Qwen3-Next).

`layer_types` says what each layer mixes with: "linear_attention" is a Gated DeltaNet layer
(`gated_delta_net`, a recurrent state per sequence), "full_attention" a `DecoderLayer` whose attention
goes through the context: q_proj also yields a per-head output gate (rows [query | gate] per head,
split at load), q and k get per-head RMSNorms, and RoPE turns only the first `partial_rotary_factor`
of each head (0.25 when the config omits it, as transformers assumes). Every RMSNorm but the
DeltaNet's gated one is zero-centred (scale 1 + w, in float32). Both kinds hold a cache, so layer id
= layer index; `ModelSpec`'s heads and head_dim are the full-attention layers'.

Qwen3.5's text positions are one stream, so its multimodal RoPE sections all see the same position
and reduce to plain RoPE; the vision tower (`Qwen3_5ForConditionalGeneration`) is not served.
Multi-token-prediction weights (`mtp.*`) in a checkpoint are ignored. Tensor parallelism splits the
attention heads as other families do (q_proj's per-head [query | gate] rows move together), the
DeltaNet heads by `state_sharding`, and the MLPs: dense ones as other families do, Qwen3-Next's
routed and shared experts each sliced (`moe_sharding`), the mixture's whole output all-reduced once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from pdserve.kv.specs import FullAttentionSpec, LayerSpec, RecurrentStateSpec
from pdserve.models.base import QKV, CausalLM, DecoderLayer, RecurrentStateContext
from pdserve.models.decoder_args import DecoderArgs, decoder_fields
from pdserve.models.gated_delta_net import GatedDeltaNet, GatedDeltaNetShape, delta_net_rank_shape
from pdserve.models.hf_config import (
    FULL_LAYER, ModelLoadError, UnsupportedModelFeature, require, rotary_dim_of, standard_rope)
from pdserve.models.layers import GatedMLP, activation_named, rms_norm_fp32_scale
from pdserve.models.moe import Experts, ExpertWeights, SoftmaxThenTopK, SparseMoE, silu_and_mul
from pdserve.models.moe_sharding import ExpertShard, expert_width_per_rank, sharded_experts
from pdserve.models.qwen3_moe import qwen3_moe_expert_weights
from pdserve.models.rope import RotaryTable, apply_rotary
from pdserve.models.state_sharding import StateShard
from pdserve.models.tensor_parallel import ShardedWeights, TensorParallelShard, sharded_args
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import Embedding, copy_rows, empty_linear, empty_param

LINEAR_LAYER = "linear_attention"
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers' layer pattern when a config has no layer_types
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # transformers' default for both families


@dataclass(frozen=True, slots=True)
class SharedExpertMoEArgs:
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True, slots=True)
class Qwen3_5Args(DecoderArgs):
    architecture: str
    hidden_act: str
    attention_bias: bool
    rope: Mapping[str, Any]
    rotary_dim: int
    delta_net: GatedDeltaNetShape
    moe: Optional[SharedExpertMoEArgs] = None  # Qwen3-Next's experts; None: dense MLPs everywhere
    rank_shard: Optional[StateShard] = None  # under tensor parallelism: `delta_net` and experts are its share


def _layer_specs(config: Mapping[str, Any], num_layers: int, delta_net: GatedDeltaNetShape) -> tuple[LayerSpec, ...]:
    interval = int(config.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
    layer_types = config.get("layer_types") or [
        FULL_LAYER if (i + 1) % interval == 0 else LINEAR_LAYER for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"{len(layer_types)} layer_types for {num_layers} layers")
    specs: list[LayerSpec] = []
    for layer_id, layer_type in enumerate(layer_types):
        if layer_type == LINEAR_LAYER:
            specs.append(delta_net.state_spec())
        elif layer_type == FULL_LAYER:
            specs.append(FullAttentionSpec())
        else:
            raise UnsupportedModelFeature(f"layer {layer_id} has unsupported layer type {layer_type!r} "
                                          f"(known: {LINEAR_LAYER!r}, {FULL_LAYER!r})")
    return tuple(specs)


def _delta_net_shape(config: Mapping[str, Any]) -> GatedDeltaNetShape:
    shape = GatedDeltaNetShape(
        num_key_heads=int(require(config, "linear_num_key_heads")),
        num_value_heads=int(require(config, "linear_num_value_heads")),
        key_head_dim=int(require(config, "linear_key_head_dim")),
        value_head_dim=int(require(config, "linear_value_head_dim")),
        conv_kernel_tokens=int(config.get("linear_conv_kernel_dim") or 4),
    )
    if shape.num_value_heads % shape.num_key_heads:
        raise ModelLoadError(f"{shape.num_value_heads} linear value heads do not share "
                             f"{shape.num_key_heads} key heads evenly")
    return shape


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    return standard_rope(params, default_theta=theta, max_positions=int(require(config, "max_position_embeddings")),
                         partial_rotary=True)


def qwen3_5_args(config: Mapping[str, Any], architecture: str = "qwen3_5") -> Qwen3_5Args:
    fields = decoder_fields(config)
    delta_net = _delta_net_shape(config)
    rope = _rope(config)
    hidden_act = str(config.get("hidden_act", "silu"))
    activation_named(hidden_act)  # refuse an unknown activation at load
    return Qwen3_5Args(
        **fields, layer_specs=_layer_specs(config, fields["num_layers"], delta_net), architecture=architecture,
        hidden_act=hidden_act, attention_bias=bool(config.get("attention_bias", False)), rope=rope,
        rotary_dim=rotary_dim_of(rope, fields["head_dim"]), delta_net=delta_net,
    )


def qwen3_next_args(config: Mapping[str, Any]) -> Qwen3_5Args:
    """Qwen3.5's layers with Qwen3-MoE's choice of sparse layers (`mlp_only_layers`, `decoder_sparse_step`)."""
    args = qwen3_5_args(config, architecture="qwen3_next")
    num_experts = int(config.get("num_experts") or 0)
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = frozenset(i for i in range(args.num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    moe = SharedExpertMoEArgs(
        num_experts=num_experts,
        experts_per_token=int(require(config, "num_experts_per_tok")) if sparse else 0,
        moe_intermediate_size=int(require(config, "moe_intermediate_size")) if sparse else 0,
        shared_expert_intermediate_size=int(require(config, "shared_expert_intermediate_size")) if sparse else 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        sparse_layers=sparse,
    )
    return dataclasses.replace(args, moe=moe)


def qwen3_5_sharded_args(args: Qwen3_5Args, shard: TensorParallelShard) -> Qwen3_5Args:
    """A rank's args: its attention heads and MLP rows (`sharded_args`), its share of every DeltaNet's
    heads, whose state specs then declare the rank's share, and of every expert's units;
    UnsupportedModelFeature / ModelLoadError naming the counts when the size does not divide them."""
    delta_net = delta_net_rank_shape(args.delta_net, shard.size)
    specs = tuple(delta_net.state_spec() if isinstance(spec, RecurrentStateSpec) else spec
                  for spec in args.layer_specs)
    moe = args.moe
    if moe is not None and moe.sparse_layers:
        moe = dataclasses.replace(
            moe, moe_intermediate_size=expert_width_per_rank(moe.moe_intermediate_size, shard.size),
            shared_expert_intermediate_size=expert_width_per_rank(moe.shared_expert_intermediate_size, shard.size))
    return dataclasses.replace(sharded_args(args, shard), delta_net=delta_net, layer_specs=specs, moe=moe,
                               rank_shard=StateShard(shard.rank, shard.size))


class GatedQueryShardedWeights(ShardedWeights):
    """`ShardedWeights` for q_proj rows laid out [query | gate] per head (a rank's heads are twice as
    many rows as their queries alone); the shared expert passes whole (`SharedExpertMoE` cuts it)."""

    def _rule(self, name: str) -> tuple[Optional[str], Optional[slice]]:
        if ".shared_expert." in name:
            return None, None
        kind, span = super()._rule(name)
        if name.rsplit(".", 2)[-2:-1] == ["q_proj"] and span is not None:
            return kind, slice(2 * span.start, 2 * span.stop)
        return kind, span


def zero_centred_scale(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (1 + w) factor of a zero-centred RMSNorm, as the reference rounds it: w in the model dtype, then fp32."""
    return 1.0 + weight.to(dtype).float()


class SharedExpertMoE(torch.nn.Module):
    """Qwen3-Next's sparse MLP: softmax top-k routed experts plus a shared expert scaled by a sigmoid gate."""

    def __init__(self, args: Qwen3_5Args, moe: SharedExpertMoEArgs, dtype: torch.dtype, device: torch.device):
        super().__init__()
        act = activation_named(args.hidden_act)
        k, renormalize = moe.experts_per_token, moe.norm_topk_prob
        activation = silu_and_mul if act is F.silu else (lambda gate, up: act(gate) * up)
        experts = Experts(moe.num_experts, args.hidden_size, moe.moe_intermediate_size, activation, False, dtype)
        self.routed = SparseMoE(args.hidden_size, moe.num_experts, SoftmaxThenTopK(k, renormalize), experts, False,
                                dtype, device)
        self.shared = GatedMLP(args.hidden_size, moe.shared_expert_intermediate_size, act, False, dtype)
        self.shared_gate = empty_param((1, args.hidden_size), dtype, device)  # one logit per token, kept float
        shard = args.rank_shard  # a rank holds a slice of every expert; its output is a partial sum
        self.expert_shard = None if shard is None else ExpertShard(shard.rank, shard.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        self.routed.load_router(weights.get(prefix + "gate.weight"), None, prefix)
        experts = qwen3_moe_expert_weights(weights, prefix + "experts.")
        self.routed.experts.load(weights, sharded_experts(experts, self.expert_shard), prefix)
        self._load_shared(weights, prefix + "shared_expert.")
        copy_rows(self.shared_gate, [weights.get(prefix + "shared_expert_gate.weight")], prefix + "shared_expert_gate")


    def _load_shared(self, weights: WeightLoader, prefix: str) -> None:
        if self.expert_shard is None:
            self.shared.load(weights, prefix)
            return
        whole = ExpertWeights(*(weights.get(f"{prefix}{name}_proj.weight") for name in ("gate", "up", "down")))
        part = self.expert_shard.cut(whole)
        self.shared.gate_up_proj = weights.linear_from_tensors(self.shared.gate_up_proj, [part.gate, part.up],
                                                               prefix + "gate_up")
        self.shared.down_proj = weights.linear_from_tensors(self.shared.down_proj, [part.down], prefix + "down")


Mlp = Union[GatedMLP, SharedExpertMoE]


class _NormsAndMlp(torch.nn.Module):
    """What both layer kinds share: the zero-centred pre-norms and the MLP half of the block."""

    def __init__(self, args: Qwen3_5Args, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype, self.eps = dtype, args.rms_norm_eps
        self.input_scale = empty_param((args.hidden_size,), torch.float32, device)
        self.post_scale = empty_param((args.hidden_size,), torch.float32, device)
        if args.moe is not None and layer_id in args.moe.sparse_layers:
            self.mlp: Mlp = SharedExpertMoE(args, args.moe, dtype, device)
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation_named(args.hidden_act), False,
                                dtype)

    def input_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.input_scale, self.eps)

    def mlp_half(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(rms_norm_fp32_scale(h, self.post_scale, self.eps))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        copy_rows(self.input_scale, [zero_centred_scale(weights.get(prefix + "input_layernorm.weight"), self.dtype)],
                  prefix + "input_layernorm")
        post = prefix + "post_attention_layernorm"
        copy_rows(self.post_scale, [zero_centred_scale(weights.get(post + ".weight"), self.dtype)], post)
        self.mlp.load(weights, prefix + "mlp.")


class GatedAttentionLayer(DecoderLayer):
    """A full-attention layer: q/k/v with per-head zero-centred norms and partial RoPE, the attended
    heads scaled by sigmoid(gate) before o_proj. The gate is its own projection of the normed input,
    so `attention_output` needs only the residual stream."""

    def __init__(self, args: Qwen3_5Args, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layer_id, args.head_dim**-0.5)
        self.block = _NormsAndMlp(args, layer_id, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_width = args.num_heads * args.head_dim
        self.qkv_proj = empty_linear(args.hidden_size, q_width + 2 * args.num_kv_heads * args.head_dim,
                                     args.attention_bias, dtype)
        self.gate_proj = empty_linear(args.hidden_size, q_width, args.attention_bias, dtype)
        self.qk_scale = empty_param((args.num_heads + args.num_kv_heads, args.head_dim), torch.float32, device)
        self.o_proj = empty_linear(q_width, args.hidden_size, args.attention_bias, dtype)

    def attention_inputs(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> QKV:
        cos, sin = rope
        num_tokens, qk_heads = h.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(self.block.input_norm(h))
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(rms_norm_fp32_scale(qk, self.qk_scale, self.block.eps), cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(self.block.input_norm(h))
        h = h + self.o_proj(attended.reshape(attended.shape[0], -1) * torch.sigmoid(gate))
        return self.block.mlp_half(h)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        self.block.load(weights, prefix)
        attn, get = prefix + "self_attn.", weights.get
        heads = self.num_heads
        query_gate = get(attn + "q_proj.weight").reshape(heads, 2, self.head_dim, -1)  # per head: query rows, gate rows
        query, gate = (query_gate[:, i].reshape(heads * self.head_dim, -1) for i in (0, 1))
        self.qkv_proj = weights.linear_from_tensors(
            self.qkv_proj, [query, get(attn + "k_proj.weight"), get(attn + "v_proj.weight")], attn + "qkv")
        self.gate_proj = weights.linear_from_tensors(self.gate_proj, [gate], attn + "gate")
        self.o_proj = weights.linear(self.o_proj, [attn + "o_proj.weight"], attn + "o_proj")
        if self.qkv_proj.bias is not None:
            query_gate_bias = get(attn + "q_proj.bias").reshape(heads, 2, self.head_dim)
            copy_rows(self.qkv_proj.bias, [query_gate_bias[:, 0].reshape(-1), get(attn + "k_proj.bias"),
                                           get(attn + "v_proj.bias")], attn + "qkv bias")
            copy_rows(self.gate_proj.bias, [query_gate_bias[:, 1].reshape(-1)], attn + "gate bias")
            copy_rows(self.o_proj.bias, [get(attn + "o_proj.bias")], attn + "o_proj bias")
        dtype = self.block.dtype
        q_scale = zero_centred_scale(get(attn + "q_norm.weight"), dtype)
        k_scale = zero_centred_scale(get(attn + "k_norm.weight"), dtype)
        copy_rows(self.qk_scale, [q_scale.expand(self.num_heads, -1), k_scale.expand(self.num_kv_heads, -1)],
                  attn + "q/k norm")


def delta_net_projection_parts(weights: WeightLoader, prefix: str, shape: GatedDeltaNetShape) -> list[torch.Tensor]:
    """Row blocks q, k, v, z, b, a of a DeltaNet's input projection. Qwen3.5 stores `in_proj_qkv`,
    `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next fuses them per key head
    (`in_proj_qkvz`: [q | k | v | z] of each key head's group, `in_proj_ba`: [b | a] likewise)."""
    get = weights.get
    if not weights.source.has(prefix + "in_proj_qkvz.weight"):
        qkv = get(prefix + "in_proj_qkv.weight").split(
            [shape.key_dim_total, shape.key_dim_total, shape.value_dim_total])
        return [*qkv, *(get(prefix + name + ".weight") for name in ("in_proj_z", "in_proj_b", "in_proj_a"))]
    group = shape.num_value_heads // shape.num_key_heads
    fused = get(prefix + "in_proj_qkvz.weight")
    qkvz = fused.reshape(shape.num_key_heads, -1, fused.shape[-1])
    widths = [shape.key_head_dim, shape.key_head_dim, group * shape.value_head_dim, group * shape.value_head_dim]
    ba = get(prefix + "in_proj_ba.weight").reshape(shape.num_key_heads, 2 * group, -1)
    parts = list(qkvz.split(widths, dim=1)) + list(ba.split([group, group], dim=1))
    return [part.reshape(-1, part.shape[-1]) for part in parts]


class GatedDeltaNetLayer(torch.nn.Module):
    """A linear-attention layer: pre-norm, Gated DeltaNet over each sequence's state, then the MLP."""

    def __init__(self, args: Qwen3_5Args, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer_id = layer_id
        self.block = _NormsAndMlp(args, layer_id, dtype, device)
        self.mixer = GatedDeltaNet(args.delta_net, layer_id, args.hidden_size, activation_named(args.hidden_act),
                                   args.rms_norm_eps, dtype, device, args.rank_shard)

    def forward(self, h: torch.Tensor, rope: Any, context: RecurrentStateContext) -> torch.Tensor:
        return self.block.mlp_half(h + self.mixer(self.block.input_norm(h), context))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        self.block.load(weights, prefix)
        mixer = prefix + "linear_attn."
        self.mixer.load(weights, mixer, delta_net_projection_parts(weights, mixer, self.mixer.whole_shape()))


class Qwen3_5ForCausalLM(CausalLM):
    """Embedding, the interleaved layers, zero-centred final norm, output head."""

    def __init__(self, args: Qwen3_5Args, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.spec = args.model_spec(args.architecture)
        self.embed_tokens: torch.nn.Module = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(
            (GatedAttentionLayer if isinstance(spec, FullAttentionSpec) else GatedDeltaNetLayer)(args, i, dtype, device)
            for i, spec in enumerate(args.layer_specs))
        self.norm_scale = empty_param((args.hidden_size,), torch.float32, device)
        self.lm_head: torch.nn.Module = empty_linear(args.hidden_size, args.vocab_size, False, dtype)
        self.rotary = RotaryTable(args.rope, args.rotary_dim, args.max_position_embeddings, dtype, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.embed_tokens(input_ids), self.rotary.lookup(positions)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.norm_scale, self.args.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def row_parallel_slots(self) -> list[tuple[torch.nn.Module, str]]:
        """(module, attribute) of every row-parallel projection: attention o_proj, DeltaNet out_proj, MLP down."""
        slots: list[tuple[torch.nn.Module, str]] = []
        for layer in self.layers:
            mixer = (layer, "o_proj") if isinstance(layer, GatedAttentionLayer) else (layer.mixer, "out_proj")
            # A mixture of experts sums its routed and shared partials first: one all-reduce for both.
            mlp = layer.block.mlp
            slots += [mixer, (layer.block, "mlp") if isinstance(mlp, SharedExpertMoE) else (mlp, "down_proj")]
        return slots

    @torch.no_grad()
    def load_weights(self, weights: WeightLoader) -> None:
        self.embed_tokens = weights.embedding(self.embed_tokens, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(weights, f"model.layers.{i}.")
        copy_rows(self.norm_scale, [zero_centred_scale(weights.get("model.norm.weight"), self.dtype)], "norm")
        if self.args.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens, self.lm_head)
        else:
            self.lm_head = weights.output_head(self.lm_head, "lm_head.weight")


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's layers with `SharedExpertMoE` in the sparse layers (`qwen3_next_args`)."""
