"""Nemotron-H (`NemotronHForCausalLM`, model_type `nemotron_h`): a hybrid stack of Mamba2, attention,
MLP and mixture-of-experts blocks.

Every block is `h + mixer(RMSNorm(h))` with one mixer, named per block by `layers_block_type`
("linear_attention" = Mamba2, "full_attention", "mlp", "moe"; older configs spell them "mamba" /
"attention", or give a `hybrid_override_pattern` of M / * / - / E). Attention has no positional
encoding at all (the Mamba2 blocks carry order) and no biases; the MLP is up -> relu^2 -> down and
the mixture of experts is built from such MLPs (`nemotron_h_ffn`). Layer ids count only the blocks
that hold a cache (Mamba2 state or K/V), in order, so the MLP and MoE blocks take none.

Weights load from the layout transformers saves (`backbone.` prefix) or its in-memory one (`model.`);
multi-token-prediction layers (`mtp.*`) are not loaded. Tensor parallelism splits the attention
heads and the dense MLPs as other families do, the Mamba2 heads and groups by `state_sharding`, and
every expert of a mixture-of-experts block by its units (`nemotron_h_ffn`), the block's output
all-reduced once. The ranks' checkpoint slices by name: `NemotronHShardedWeights`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from pdserve.kv.specs import FullAttentionSpec, LayerSpec
from pdserve.models.base import QKV, CausalLM, DecoderLayer, ModelSpec, RecurrentStateContext
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature, require
from pdserve.models.layers import activation_named, rms_norm_fp32_scale
from pdserve.models.mamba2 import Mamba2Geometry, Mamba2Mixer, mamba2_rank_geometry
from pdserve.models.nemotron_h_ffn import DenseMLP, MoEGeometry, NemotronHMoE, ffn_activation
from pdserve.models.state_sharding import StateShard
from pdserve.models.moe_sharding import ExpertShard, expert_width_per_rank
from pdserve.models.tensor_parallel import ShardedWeights, TensorParallelShard, sharded_args
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import Embedding, copy_rows, empty_linear, empty_param

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
# Every spelling of a block type found in configs -> ours.
BLOCK_TYPES: Mapping[str, str] = {
    "linear_attention": MAMBA, "mamba": MAMBA, "M": MAMBA,
    "full_attention": ATTENTION, "attention": ATTENTION, "*": ATTENTION,
    "mlp": MLP, "-": MLP,
    "moe": MOE, "E": MOE,
}
CACHE_HOLDING = (MAMBA, ATTENTION)
STATE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class NemotronHArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP blocks' width
    block_types: tuple[str, ...]  # MAMBA, ATTENTION, MLP or MOE, one per block
    num_heads: int  # attention blocks'
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_activation: str
    mlp_bias: bool
    mamba_activation: str
    mamba: Mamba2Geometry
    moe: Optional[MoEGeometry]  # None when no block is a mixture of experts
    rank_shard: Optional[StateShard] = None  # under tensor parallelism: `mamba` and experts are its share

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """One per cache-holding block, in order: its layer id is its index here."""
        state = self.mamba.state_spec()
        return tuple(state if kind == MAMBA else FullAttentionSpec()
                     for kind in self.block_types if kind in CACHE_HOLDING)

    @property
    def num_layers(self) -> int:
        """Cache-holding layers (the blocks a layer id names)."""
        return len(self.layer_specs)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(architecture="nemotron_h", num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
                         layer_specs=self.layer_specs)


def _first(config: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The value under the first of `names` the config has (current name first, legacy ones after)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def nemotron_h_block_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Each block's mixer (MAMBA, ATTENTION, MLP or MOE); UnsupportedModelFeature naming a block type
    we do not serve."""
    raw = config.get("layers_block_type") or config.get("layer_types") or config.get("hybrid_override_pattern")
    if not raw:
        raise ModelLoadError("Nemotron-H config has neither layers_block_type nor hybrid_override_pattern")
    kinds = []
    for index, name in enumerate(raw):  # a pattern string iterates as its letters
        if name not in BLOCK_TYPES:
            raise UnsupportedModelFeature(f"Nemotron-H block {index} has unsupported block type {name!r}")
        kinds.append(BLOCK_TYPES[name])
    return tuple(kinds)


def _mamba_geometry(config: Mapping[str, Any], norm_eps: float) -> Mamba2Geometry:
    state_dtype = str(config.get("mamba_ssm_cache_dtype") or "float32")
    if state_dtype not in STATE_DTYPES:
        raise UnsupportedModelFeature(f"mamba_ssm_cache_dtype {state_dtype!r} is not supported (one of {STATE_DTYPES})")
    geometry = Mamba2Geometry(
        hidden_size=int(require(config, "hidden_size")),
        num_heads=int(require(config, "mamba_num_heads")),
        head_dim=int(require(config, "mamba_head_dim")),
        num_groups=int(_first(config, ("n_groups", "mamba_n_groups"), 8)),
        state_size=int(require(config, "ssm_state_size")),
        conv_kernel=int(_first(config, ("conv_kernel", "mamba_d_conv"), 4)),
        conv_bias=bool(_first(config, ("use_conv_bias", "mamba_conv_bias"), True)),
        proj_bias=bool(config.get("use_bias", False)),
        time_step_min=float(_first(config, ("time_step_min", "mamba_dt_min"), 0.001)),
        norm_eps=norm_eps,
        state_dtype=state_dtype,
    )
    if geometry.num_heads % geometry.num_groups or geometry.inner_size % geometry.num_groups:
        raise ModelLoadError(f"{geometry.num_heads} Mamba2 heads do not split into {geometry.num_groups} groups")
    return geometry


def _moe_geometry(config: Mapping[str, Any]) -> MoEGeometry:
    geometry = MoEGeometry(
        num_experts=int(_first(config, ("n_routed_experts", "num_local_experts"), None) or
                        require(config, "n_routed_experts")),
        experts_per_token=int(require(config, "num_experts_per_tok")),
        intermediate_size=int(require(config, "moe_intermediate_size")),
        shared_intermediate_size=int(require(config, "moe_shared_expert_intermediate_size")),
        latent_size=int(config.get("moe_latent_size") or 0),
        num_groups=int(config.get("n_group") or 1),
        top_groups=int(config.get("topk_group") or 1),
        renormalize=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
    )
    if geometry.num_experts % geometry.num_groups or geometry.num_experts // geometry.num_groups < 2:
        raise ModelLoadError(f"{geometry.num_experts} experts do not make {geometry.num_groups} groups of two or more")
    return geometry


def nemotron_h_args(config: Mapping[str, Any]) -> NemotronHArgs:
    if config.get("sliding_window"):
        raise UnsupportedModelFeature("Nemotron-H with a sliding window is not supported")
    num_heads = int(require(config, "num_attention_heads"))
    hidden_size = int(require(config, "hidden_size"))
    norm_eps = float(_first(config, ("layer_norm_epsilon", "rms_norm_eps"), 1e-5))
    block_types = nemotron_h_block_types(config)
    return NemotronHArgs(
        vocab_size=int(require(config, "vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(require(config, "intermediate_size")),
        block_types=block_types,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(_first(config, ("head_dim", "attention_head_dim"), hidden_size // num_heads)),
        norm_eps=norm_eps,
        max_position_embeddings=int(require(config, "max_position_embeddings")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        mlp_activation=str(config.get("mlp_hidden_act", "relu2")),
        mlp_bias=bool(config.get("mlp_bias", False)),
        mamba_activation=str(config.get("mamba_hidden_act", "silu")),
        mamba=_mamba_geometry(config, norm_eps),
        moe=_moe_geometry(config) if MOE in block_types else None,
    )


def nemotron_h_sharded_args(args: NemotronHArgs, shard: TensorParallelShard) -> NemotronHArgs:
    """A rank's args: its attention heads and MLP rows (`sharded_args`), its share of every Mamba2
    mixer's heads and groups, whose state specs then declare the rank's share, and of every expert's
    units; UnsupportedModelFeature / ModelLoadError naming the counts when the size does not divide them."""
    moe = args.moe
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=expert_width_per_rank(moe.intermediate_size, shard.size),
                                  shared_intermediate_size=expert_width_per_rank(moe.shared_intermediate_size,
                                                                                 shard.size))
    return dataclasses.replace(sharded_args(args, shard), mamba=mamba2_rank_geometry(args.mamba, shard.size),
                               moe=moe, rank_shard=StateShard(shard.rank, shard.size))


class NemotronHShardedWeights(ShardedWeights):
    """`ShardedWeights` that passes the mixture-of-experts blocks' tensors whole (the routed and the
    shared experts' up_proj / down_proj would otherwise meet the dense MLP's rule): `NemotronHMoE`
    cuts each expert by its own width."""

    def _rule(self, name: str) -> tuple[Optional[str], Optional[slice]]:
        if ".mixer.experts." in name or ".mixer.shared_experts." in name:
            return None, None
        return super()._rule(name)


class _PreNormBlock(torch.nn.Module):
    """The block's RMSNorm (weight multiplied in float32, then cast back)."""

    def __init__(self, args: NemotronHArgs, device: torch.device):
        super().__init__()
        self.eps = args.norm_eps
        self.norm = empty_param((args.hidden_size,), torch.float32, device)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.norm, self.eps)

    def load_norm(self, weights: WeightLoader, prefix: str) -> None:
        copy_rows(self.norm, [weights.get(prefix + "norm.weight")], prefix + "norm")


class MambaBlock(_PreNormBlock):
    def __init__(self, args: NemotronHArgs, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(args, device)
        self.layer_id = layer_id
        self.mixer = Mamba2Mixer(args.mamba, layer_id, activation_named(args.mamba_activation), dtype, device,
                                 args.rank_shard)

    def forward(self, h: torch.Tensor, rope: Any, context: RecurrentStateContext) -> torch.Tensor:  # type: ignore[override]
        return h + self.mixer(self.normed(h), context)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        self.load_norm(weights, prefix)
        self.mixer.load(weights, prefix + "mixer.")


class FeedForwardBlock(_PreNormBlock):
    """A dense MLP or a mixture of experts; holds no cache and takes no layer id."""

    def __init__(self, args: NemotronHArgs, kind: str, dtype: torch.dtype, device: torch.device):
        super().__init__(args, device)
        activation = ffn_activation(args.mlp_activation)
        self.mixer: torch.nn.Module
        if kind == MOE and args.moe is not None:
            shard = None if args.rank_shard is None else ExpertShard(args.rank_shard.rank, args.rank_shard.size)
            self.mixer = NemotronHMoE(args.hidden_size, args.moe, activation, args.mlp_bias, dtype, device, shard)
        else:
            self.mixer = DenseMLP(args.hidden_size, args.intermediate_size, activation, args.mlp_bias, dtype)

    def forward(self, h: torch.Tensor, rope: Any, context: Any) -> torch.Tensor:  # type: ignore[override]
        return h + self.mixer(self.normed(h))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        self.load_norm(weights, prefix)
        self.mixer.load(weights, prefix + "mixer.")


class AttentionBlock(DecoderLayer):
    """Pre-norm attention without positional encoding or biases; q/k/v fused at load."""

    def __init__(self, args: NemotronHArgs, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layer_id, args.head_dim**-0.5)
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.eps = args.norm_eps
        self.norm = empty_param((args.hidden_size,), torch.float32, device)
        qkv_rows = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = empty_linear(args.hidden_size, qkv_rows, False, dtype)
        self.o_proj = empty_linear(args.num_heads * args.head_dim, args.hidden_size, False, dtype)

    def attention_inputs(self, h: torch.Tensor, rope: Any) -> QKV:
        qkv = self.qkv_proj(rms_norm_fp32_scale(h, self.norm, self.eps))
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        rows = h.shape[0]
        return (q.reshape(rows, self.num_heads, self.head_dim), k.reshape(rows, self.num_kv_heads, self.head_dim),
                v.reshape(rows, self.num_kv_heads, self.head_dim))

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return h + self.o_proj(attended.reshape(attended.shape[0], -1))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        copy_rows(self.norm, [weights.get(prefix + "norm.weight")], prefix + "norm")
        mixer = prefix + "mixer."
        names = [f"{mixer}{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = weights.linear(self.qkv_proj, names, mixer + "qkv")
        self.o_proj = weights.linear(self.o_proj, [mixer + "o_proj.weight"], mixer + "o_proj")


class NemotronHForCausalLM(CausalLM):
    def __init__(self, args: NemotronHArgs, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.args = args
        self.spec = args.model_spec()
        self.embed_tokens: torch.nn.Module = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(self._blocks(args, dtype, device))
        self.norm = empty_param((args.hidden_size,), torch.float32, device)
        self.lm_head: torch.nn.Module = empty_linear(args.hidden_size, args.vocab_size, False, dtype)

    @staticmethod
    def _blocks(args: NemotronHArgs, dtype: torch.dtype, device: torch.device) -> list[torch.nn.Module]:
        blocks: list[torch.nn.Module] = []
        layer_id = 0
        for kind in args.block_types:
            if kind not in CACHE_HOLDING:
                blocks.append(FeedForwardBlock(args, kind, dtype, device))
                continue
            block = MambaBlock if kind == MAMBA else AttentionBlock
            blocks.append(block(args, layer_id, dtype, device))
            layer_id += 1
        return blocks

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.embed_tokens(input_ids), None  # no positional encoding anywhere

    def row_parallel_slots(self) -> list[tuple[torch.nn.Module, str]]:
        """(module, attribute) of every row-parallel projection: attention o_proj, Mamba2 out_proj, MLP down."""
        slots: list[tuple[torch.nn.Module, str]] = []
        for block in self.layers:
            if isinstance(block, AttentionBlock):
                slots.append((block, "o_proj"))
            elif isinstance(block, MambaBlock):
                slots.append((block.mixer, "out_proj"))
            elif isinstance(block.mixer, DenseMLP):
                slots.append((block.mixer, "down_proj"))
            else:  # a mixture of experts sums its routed and shared partials first: one all-reduce for both
                slots.append((block, "mixer"))
        return slots

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.norm, self.args.norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: WeightLoader) -> None:
        root = _root_prefix(weights)
        self.embed_tokens = weights.embedding(self.embed_tokens, root + "embeddings.weight")
        for index, block in enumerate(self.layers):
            block.load(weights, f"{root}layers.{index}.")
        copy_rows(self.norm, [weights.get(root + "norm_f.weight")], "norm_f")
        if self.args.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens, self.lm_head)
        else:
            self.lm_head = weights.output_head(self.lm_head, "lm_head.weight")


def _root_prefix(weights: WeightLoader) -> str:
    """`backbone.` (how checkpoints, transformers' saves included, name the trunk) or `model.`."""
    for root in ("backbone.", "model."):
        if weights.source.has(root + "embeddings.weight"):
            return root
    raise ModelLoadError("Nemotron-H checkpoint has neither backbone.embeddings.weight nor model.embeddings.weight")

