"""gpt-oss (`GptOssForCausalLM`): attention sinks, alternating sliding-window and full layers, MoE.

Each layer: RMSNorm, attention with biased q/k/v/o projections, YaRN RoPE and one learned sink
logit per query head (it joins the softmax denominator and weighs no value), over a sliding window
or the full context as `layer_types` says; then RMSNorm and a top-k mixture of experts whose router
is biased and whose experts apply a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`).

Expert weights load from the layout `transformers` saves (fused [experts, in, out] tensors with
gate and up interleaved column by column, plus biases) or from the released checkpoints' MXFP4
`*_blocks` / `*_scales` (`quant/mxfp4.py`), whose rows are outputs:

    gate_up_proj        [E, hidden, 2I]  column 2i: gate i, column 2i+1: up i
    gate_up_proj_blocks [E, 2I, hidden/32, 16]  row 2i: gate i, row 2i+1: up i
    down_proj           [E, I, hidden]   down_proj_blocks [E, hidden, I/32, 16]

MXFP4 experts stay MXFP4 where the native experts run them (float32 on a CPU with the kernels),
which compute what they compute over the dequantized weights, bit for bit, from a seventh of
the bytes; elsewhere (GPUs, other dtypes, a checkpoint with a NaN scale) they are dequantized at
load. Either way they are never re-quantized (`--quantization int4/int8` leaves them as they are).

Under tensor parallelism (`gpt_oss_sharded_args`) each rank keeps its query heads' sinks and a
slice of every expert, cut by `moe_sharding` (an MXFP4 expert whose cut splits a 32-weight group
is dequantized first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from pdserve.models.base import QKV, DecoderLayer
from pdserve.models.decoder_args import decoder_fields
from pdserve.models.hf_config import ModelLoadError, flat_rope, layer_specs_from_types, require
from pdserve.models.layers import rms_norm_fp32_scale
from pdserve.models.llama import LlamaAttention, LlamaAttentionArgs, LlamaForCausalLM
from pdserve.models.moe import ClampedSwiGLU, Experts, ExpertWeights, SparseMoE, TopKThenSoftmax
from pdserve.models.moe_sharding import ExpertShard, sharded_experts
from pdserve.models.quant.mxfp4 import NAN_SCALE, Mxfp4Weight, dequantize_mxfp4
from pdserve.models.tensor_parallel import TensorParallelShard, sharded_args
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import copy_rows, empty_param

DEFAULT_SLIDING_PATTERN = 2  # sliding, full, sliding, full, ... when the config has no layer_types


@dataclass(frozen=True, slots=True)
class GptOssArgs(LlamaAttentionArgs):
    """Llama's attention fields (`LlamaAttention` reads them); `intermediate_size` is per expert."""

    num_experts: int
    experts_per_token: int
    swiglu_alpha: float
    swiglu_limit: float
    expert_shard: Optional[ExpertShard] = None  # this rank's slice of every expert; None: whole experts


def gpt_oss_args(config: Mapping[str, Any]) -> GptOssArgs:
    num_layers = int(require(config, "num_hidden_layers"))
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % DEFAULT_SLIDING_PATTERN else "full_attention" for i in range(num_layers)
    ]
    bias = bool(config.get("attention_bias", True))
    return GptOssArgs(
        **decoder_fields(config, default_rms_norm_eps=1e-5),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=False,
        num_experts=int(config.get("num_local_experts") or require(config, "num_experts")),
        experts_per_token=int(require(config, "num_experts_per_tok")),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        rope=flat_rope(config),
        layer_specs=layer_specs_from_types(layer_types, config.get("sliding_window")),
    )


def gpt_oss_sharded_args(args: GptOssArgs, shard: TensorParallelShard) -> GptOssArgs:
    """A rank's args: its heads (and their sinks), and `intermediate_size / size` units of every
    expert (`shard_for` has checked that the per-expert width divides)."""
    return dataclasses.replace(sharded_args(args, shard), expert_shard=ExpertShard(shard.rank, shard.size))


def gpt_oss_expert_weights(weights: WeightLoader, prefix: str, keep_mxfp4: bool = False):
    """Per-expert weights of one layer's `{prefix}experts.` tensors: fused float, MXFP4
    dequantized, or (keep_mxfp4, and no scale is NaN) MXFP4 kept as `Mxfp4Weight`s."""
    get, has = weights.get, weights.source.has
    gate_up_bias, down_bias = get(prefix + "gate_up_proj_bias"), get(prefix + "down_proj_bias")
    if has(prefix + "gate_up_proj_blocks"):
        # MXFP4: rows are outputs already.
        gate_up_mx = (get(prefix + "gate_up_proj_blocks"), get(prefix + "gate_up_proj_scales"))
        down_mx = (get(prefix + "down_proj_blocks"), get(prefix + "down_proj_scales"))
        if keep_mxfp4 and not any(bool((scales == NAN_SCALE).any()) for _, scales in (gate_up_mx, down_mx)):
            (gate_up_blocks, gate_up_scales), (down_blocks, down_scales) = gate_up_mx, down_mx

            def kept(e: int) -> ExpertWeights:
                return ExpertWeights(
                    gate=Mxfp4Weight.from_blocks(gate_up_blocks[e, 0::2], gate_up_scales[e, 0::2]),
                    up=Mxfp4Weight.from_blocks(gate_up_blocks[e, 1::2], gate_up_scales[e, 1::2]),
                    down=Mxfp4Weight.from_blocks(down_blocks[e], down_scales[e]),
                    gate_bias=gate_up_bias[e, 0::2], up_bias=gate_up_bias[e, 1::2], down_bias=down_bias[e])

            return kept
        gate_up, down = dequantize_mxfp4(*gate_up_mx), dequantize_mxfp4(*down_mx)
    elif has(prefix + "gate_up_proj"):
        gate_up = get(prefix + "gate_up_proj").transpose(1, 2)  # [E, 2I, hidden]
        down = get(prefix + "down_proj").transpose(1, 2)  # [E, hidden, I]
    else:
        raise ModelLoadError(f"checkpoint has neither {prefix}gate_up_proj nor its MXFP4 blocks")

    def expert(e: int) -> ExpertWeights:
        return ExpertWeights(gate=gate_up[e, 0::2], up=gate_up[e, 1::2], down=down[e],
                             gate_bias=gate_up_bias[e, 0::2], up_bias=gate_up_bias[e, 1::2], down_bias=down_bias[e])

    return expert


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, args: GptOssArgs, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layer_id, args.head_dim**-0.5)
        self.eps = args.rms_norm_eps
        self.norms = empty_param((2, args.hidden_size), torch.float32, device)  # input, post-attention
        self.self_attn = LlamaAttention(args, dtype, device)
        self.attention_sinks = empty_param((args.num_heads,), torch.float32, device)
        self.expert_shard = args.expert_shard
        self.expert_dtype = dtype
        k = args.experts_per_token
        experts = Experts(args.num_experts, args.hidden_size, args.intermediate_size,
                          ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit), True, dtype)
        self.mlp = SparseMoE(args.hidden_size, args.num_experts, TopKThenSoftmax(k),
                             experts, True, dtype, device)

    def attention_inputs(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> QKV:
        cos, sin = rope
        return self.self_attn.project(rms_norm_fp32_scale(h, self.norms[0], self.eps), cos, sin)

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
        return h + self.mlp(rms_norm_fp32_scale(h, self.norms[1], self.eps))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        norms = [weights.get(prefix + name + ".weight").unsqueeze(0)
                 for name in ("input_layernorm", "post_attention_layernorm")]
        copy_rows(self.norms, norms, prefix + "norms")
        self.self_attn.load(weights, prefix + "self_attn.")
        copy_rows(self.attention_sinks, [weights.get(prefix + "self_attn.sinks")], prefix + "self_attn.sinks")
        mlp = prefix + "mlp."
        self.mlp.load_router(weights.get(mlp + "router.weight"), weights.get(mlp + "router.bias"), mlp)
        keep_mxfp4 = weights.native_experts_read_compact(self.expert_dtype)
        experts = sharded_experts(gpt_oss_expert_weights(weights, mlp + "experts.", keep_mxfp4), self.expert_shard)
        self.mlp.experts.load(weights, experts, mlp)


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's shell (`GptOssArgs` carries the fields it reads) with gpt-oss layers and a float32
    final norm applied at float32 scale."""

    def __init__(self, args: GptOssArgs, dtype: torch.dtype, device: torch.device):
        super().__init__(args, dtype, device, architecture="gpt_oss",  # type: ignore[arg-type]
                         make_layer=lambda i: GptOssDecoderLayer(args, i, dtype, device), norm_dtype=torch.float32)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.norm, self.args.rms_norm_eps)
