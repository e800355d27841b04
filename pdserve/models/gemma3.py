"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type `gemma3_text`).

Differences from Llama, each kept explicit here: the embedding is scaled by
sqrt(hidden); every RMSNorm multiplies by (1 + w) in fp32; attention and MLP
outputs are normed before the residual add; q and k get per-head norms; the
query scale is `query_pre_attn_scalar ** -0.5`; the MLP uses tanh-GELU; layers
alternate sliding (local RoPE base) and full (global RoPE base) attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch

from pdserve.kv.specs import SlidingWindowSpec
from pdserve.models.base import QKV, CausalLM, DecoderLayer
from pdserve.models.decoder_args import DecoderArgs, decoder_fields
from pdserve.models.hf_config import (
    FULL_LAYER,
    SLIDING_LAYER,
    UnsupportedModelFeature,
    layer_specs_from_types,
    require,
    standard_rope,
)
from pdserve.models.layers import GatedMLP, activation_named, rms_norm_fp32_scale
from pdserve.models.rope import RotaryTable, apply_rotary
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import Embedding, copy_rows, empty_linear, empty_param

DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_SLIDING_PATTERN = 6  # five sliding layers, then one full layer


@dataclass(frozen=True, slots=True)
class Gemma3Args(DecoderArgs):
    hidden_activation: str
    attention_bias: bool
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    rope_full: Mapping[str, Any]
    rope_sliding: Mapping[str, Any]


def _gemma3_ropes(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-layer rope, sliding-layer rope). Accepts the nested transformers-5
    `rope_parameters` and the legacy `rope_theta` / `rope_local_base_freq` /
    `rope_scaling` keys (scaling applies to full layers only)."""
    max_positions = int(require(config, "max_position_embeddings"))
    params = config.get("rope_parameters") or {}
    if FULL_LAYER in params or SLIDING_LAYER in params:
        full, sliding = params.get(FULL_LAYER) or {}, params.get(SLIDING_LAYER) or {}
    else:
        full, sliding = dict(config.get("rope_scaling") or params), {}
    full_theta = float(full.get("rope_theta") or config.get("rope_theta") or DEFAULT_GLOBAL_THETA)
    local_theta = float(sliding.get("rope_theta") or config.get("rope_local_base_freq") or DEFAULT_LOCAL_THETA)
    return (
        standard_rope(full, default_theta=full_theta, max_positions=max_positions),
        standard_rope(sliding, default_theta=local_theta, max_positions=max_positions),
    )


def gemma3_args(config: Mapping[str, Any]) -> Gemma3Args:
    if config.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelFeature(
            "attn_logit_softcapping is set, but the attention backend has no logit soft-capping; "
            "Gemma 3 checkpoints leave it None"
        )
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelFeature("bidirectional Gemma 3 attention is not supported")
    num_layers = int(require(config, "num_hidden_layers"))
    pattern = int(config.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN)
    layer_types = config.get("layer_types") or [
        SLIDING_LAYER if (i + 1) % pattern else FULL_LAYER for i in range(num_layers)
    ]
    rope_full, rope_sliding = _gemma3_ropes(config)
    softcap = config.get("final_logit_softcapping")
    return Gemma3Args(
        **decoder_fields(config, default_tie_word_embeddings=True),
        hidden_activation=str(config.get("hidden_activation") or "gelu_pytorch_tanh"),
        attention_bias=bool(config.get("attention_bias", False)),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(softcap) if softcap is not None else None,
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        layer_specs=layer_specs_from_types(layer_types, config.get("sliding_window")),
    )


def _one_plus(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (1 + w) factor, computed like the reference: w rounded to the model dtype, then fp32."""
    return 1.0 + weight.to(dtype).float()


class Gemma3Attention(torch.nn.Module):
    def __init__(self, args: Gemma3Args, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype = dtype
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.eps = args.rms_norm_eps
        qkv_rows = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = empty_linear(args.hidden_size, qkv_rows, args.attention_bias, dtype)
        self.o_proj = empty_linear(args.num_heads * args.head_dim, args.hidden_size, args.attention_bias, dtype)
        # (1 + q_norm) and (1 + k_norm) stacked per head: one norm op covers q and k.
        self.qk_scale = empty_param((args.num_heads + args.num_kv_heads, args.head_dim), torch.float32, device)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
        num_tokens = x.shape[0]
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, :qk_width].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(rms_norm_fp32_scale(qk, self.qk_scale, self.eps), cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def load(self, weights: WeightLoader, prefix: str) -> None:
        get = weights.get
        names = [prefix + p for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = weights.linear(self.qkv_proj, [n + ".weight" for n in names], prefix + "qkv")
        self.o_proj = weights.linear(self.o_proj, [prefix + "o_proj.weight"], prefix + "o_proj")
        if self.qkv_proj.bias is not None:
            copy_rows(self.qkv_proj.bias, [get(n + ".bias") for n in names], prefix + "qkv bias")
            copy_rows(self.o_proj.bias, [get(prefix + "o_proj.bias")], prefix + "o_proj bias")
        q_scale = _one_plus(get(prefix + "q_norm.weight"), self.dtype)
        k_scale = _one_plus(get(prefix + "k_norm.weight"), self.dtype)
        parts = [q_scale.expand(self.num_heads, -1), k_scale.expand(self.num_kv_heads, -1)]
        copy_rows(self.qk_scale, parts, prefix + "q/k norm")


class GemmaRope(NamedTuple):
    """cos/sin of the positions for full-attention layers (global base) and sliding ones (local base)."""

    full: tuple[torch.Tensor, torch.Tensor]
    local: tuple[torch.Tensor, torch.Tensor]


NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, args: Gemma3Args, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layer_id, args.query_pre_attn_scalar**-0.5)
        self.dtype, self.eps = dtype, args.rms_norm_eps
        self.is_sliding = isinstance(args.layer_specs[layer_id], SlidingWindowSpec)
        # Rows: input, post-attention, pre-feedforward, post-feedforward (1 + w) scales.
        self.norm_scales = empty_param((len(NORM_NAMES), args.hidden_size), torch.float32, device)
        self.self_attn = Gemma3Attention(args, dtype, device)
        act = activation_named(args.hidden_activation)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, act, False, dtype)

    def attention_inputs(self, h: torch.Tensor, rope: GemmaRope) -> QKV:
        cos, sin = rope.local if self.is_sliding else rope.full
        return self.self_attn.project(rms_norm_fp32_scale(h, self.norm_scales[0], self.eps), cos, sin)

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        s, eps = self.norm_scales, self.eps
        attn = self.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
        h = h + rms_norm_fp32_scale(attn, s[1], eps)
        mlp = self.mlp(rms_norm_fp32_scale(h, s[2], eps))
        return h + rms_norm_fp32_scale(mlp, s[3], eps)

    def load(self, weights: WeightLoader, prefix: str) -> None:
        scales = [_one_plus(weights.get(f"{prefix}{name}.weight"), self.dtype).unsqueeze(0) for name in NORM_NAMES]
        copy_rows(self.norm_scales, scales, prefix + "norms")
        self.self_attn.load(weights, prefix + "self_attn.")
        self.mlp.load(weights, prefix + "mlp.")


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, args: Gemma3Args, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.spec = args.model_spec("gemma3")
        self.embed_tokens: torch.nn.Module = Embedding(args.vocab_size, args.hidden_size, dtype)
        # sqrt(hidden) rounded to the model dtype, as the reference does (55.4256 -> 55.5 in bf16).
        embed_scale = torch.tensor(args.hidden_size**0.5, dtype=torch.float32).to(device=device, dtype=dtype)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        self.layers = torch.nn.ModuleList(Gemma3DecoderLayer(args, i, dtype, device) for i in range(args.num_layers))
        self.norm_scale = empty_param((args.hidden_size,), torch.float32, device)
        self.lm_head: torch.nn.Module = empty_linear(args.hidden_size, args.vocab_size, False, dtype)
        max_pos = args.max_position_embeddings
        self.rotary_full = RotaryTable(args.rope_full, args.head_dim, max_pos, dtype, device)
        self.rotary_sliding = RotaryTable(args.rope_sliding, args.head_dim, max_pos, dtype, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, GemmaRope]:
        h = self.embed_tokens(input_ids) * self.embed_scale
        return h, GemmaRope(self.rotary_full.lookup(positions), self.rotary_sliding.lookup(positions))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_scale(h, self.norm_scale, self.args.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: WeightLoader) -> None:
        self.embed_tokens = weights.embedding(self.embed_tokens, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(weights, f"model.layers.{i}.")
        copy_rows(self.norm_scale, [_one_plus(weights.get("model.norm.weight"), self.dtype)], "norm")
        if self.args.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens, self.lm_head)
        else:
            self.lm_head = weights.output_head(self.lm_head, "lm_head.weight")
