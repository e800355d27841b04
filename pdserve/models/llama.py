"""The Llama family: Llama 2/3 and SmolLM2, Mistral, Qwen2/2.5 and Qwen3.

They share one decoder: pre-norm attention with GQA and RoPE, then a SiLU
gated MLP. What differs (q/k/v biases, per-head q/k RMSNorm, sliding windows)
is read from the config into `LlamaArgs`; the forward pass has no per-family
branches beyond the optional q/k norm. q/k/v and gate/up are fused at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from pdserve.kv.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec
from pdserve.models.base import QKV, CausalLM, DecoderLayer
from pdserve.models.decoder_args import DecoderArgs, decoder_fields
from pdserve.models.hf_config import (
    FULL_LAYER,
    SLIDING_LAYER,
    flat_rope,
    layer_specs_from_types,
    require,
)
from pdserve.models.layers import GatedMLP, activation_named, rms_norm
from pdserve.models.rope import RotaryTable, apply_rotary
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import Embedding, copy_rows, empty_linear, empty_param


@dataclass(frozen=True, slots=True)
class LlamaAttentionArgs(DecoderArgs):
    """What `LlamaAttention` and the Llama shell read beyond the decoder fields (gpt-oss shares them)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LlamaArgs(LlamaAttentionArgs):
    architecture: str
    hidden_act: str
    mlp_bias: bool


def _common_args(config: Mapping[str, Any], architecture: str, **family: Any) -> LlamaArgs:
    return LlamaArgs(
        **decoder_fields(config),
        architecture=architecture,
        hidden_act=str(config.get("hidden_act", "silu")),
        rope=flat_rope(config),
        **family,
    )


def _all_layers(config: Mapping[str, Any], spec: AttentionSpec) -> tuple[AttentionSpec, ...]:
    return (spec,) * int(require(config, "num_hidden_layers"))


def llama_args(config: Mapping[str, Any]) -> LlamaArgs:
    """Llama 2/3/3.x and SmolLM2: `attention_bias` covers q/k/v and o."""
    bias = bool(config.get("attention_bias", False))
    return _common_args(
        config, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=False, layer_specs=_all_layers(config, FullAttentionSpec()),
    )


def mistral_args(config: Mapping[str, Any]) -> LlamaArgs:
    """Mistral: every layer slides when the config names a window, else full attention."""
    window = config.get("sliding_window")
    spec: AttentionSpec = SlidingWindowSpec(int(window)) if window else FullAttentionSpec()
    return _common_args(
        config, "mistral", qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm=False, layer_specs=_all_layers(config, spec),
    )


QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' default when a Qwen config omits it


def _qwen_layer_specs(config: Mapping[str, Any]) -> tuple[AttentionSpec, ...]:
    """Qwen slides only with `use_sliding_window`, and then only from `max_window_layers` on."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    num_layers = int(require(config, "num_hidden_layers"))
    if not window:
        return _all_layers(config, FullAttentionSpec())
    layer_types = config.get("layer_types") or [
        SLIDING_LAYER if i >= int(config.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)) else FULL_LAYER
        for i in range(num_layers)
    ]
    return layer_specs_from_types(layer_types, window)


def qwen2_args(config: Mapping[str, Any]) -> LlamaArgs:
    """Qwen2/2.5: q/k/v always carry a bias, o never does."""
    return _common_args(
        config, "qwen2", qkv_bias=True, o_bias=False, mlp_bias=False,
        qk_norm=False, layer_specs=_qwen_layer_specs(config),
    )


def qwen3_args(config: Mapping[str, Any]) -> LlamaArgs:
    """Qwen3: per-head RMSNorm on q and k before RoPE; explicit head_dim."""
    bias = bool(config.get("attention_bias", False))
    return _common_args(
        config, "qwen3", qkv_bias=bias, o_bias=bias, mlp_bias=False,
        qk_norm=True, layer_specs=_qwen_layer_specs(config),
    )


class LlamaAttention(torch.nn.Module):
    """Fused q/k/v projection, optional q/k norm, RoPE on q and k in one pass; o_proj after attending."""

    def __init__(self, args: LlamaAttentionArgs, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.eps = args.rms_norm_eps
        qkv_rows = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = empty_linear(args.hidden_size, qkv_rows, args.qkv_bias, dtype)
        self.o_proj = empty_linear(args.num_heads * args.head_dim, args.hidden_size, args.o_bias, dtype)
        # q_norm and k_norm weights stacked per head, so q and k normalise in one op.
        qk_shape = (args.num_heads + args.num_kv_heads, args.head_dim)
        self.qk_norm = empty_param(qk_shape, dtype, device) if args.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
        num_tokens = x.shape[0]
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, :qk_width].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = apply_rotary(qk, cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def load(self, weights: WeightLoader, prefix: str) -> None:
        get = weights.get
        names = [prefix + p for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = weights.linear(self.qkv_proj, [n + ".weight" for n in names], prefix + "qkv")
        if self.qkv_proj.bias is not None:
            copy_rows(self.qkv_proj.bias, [get(n + ".bias") for n in names], prefix + "qkv bias")
        self.o_proj = weights.linear(self.o_proj, [prefix + "o_proj.weight"], prefix + "o_proj")
        if self.o_proj.bias is not None:
            copy_rows(self.o_proj.bias, [get(prefix + "o_proj.bias")], prefix + "o_proj bias")
        if self.qk_norm is not None:
            q_norm, k_norm = get(prefix + "q_norm.weight"), get(prefix + "k_norm.weight")
            parts = [q_norm.expand(self.num_heads, -1), k_norm.expand(self.num_kv_heads, -1)]
            copy_rows(self.qk_norm, parts, prefix + "q/k norm")


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, args: LlamaArgs, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layer_id, args.head_dim**-0.5)
        self.eps = args.rms_norm_eps
        self.input_norm = empty_param((args.hidden_size,), dtype, device)
        self.self_attn = LlamaAttention(args, dtype, device)
        self.post_attention_norm = empty_param((args.hidden_size,), dtype, device)
        act = activation_named(args.hidden_act)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, act, args.mlp_bias, dtype)

    def attention_inputs(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> QKV:
        cos, sin = rope
        return self.self_attn.project(rms_norm(h, self.input_norm, self.eps), cos, sin)

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
        return h + self.mlp(rms_norm(h, self.post_attention_norm, self.eps))

    def load(self, weights: WeightLoader, prefix: str) -> None:
        copy_rows(self.input_norm, [weights.get(prefix + "input_layernorm.weight")], prefix + "input_layernorm")
        post_name = prefix + "post_attention_layernorm"
        copy_rows(self.post_attention_norm, [weights.get(post_name + ".weight")], post_name)
        self.self_attn.load(weights, prefix + "self_attn.")
        self.mlp.load(weights, prefix + "mlp.")


class LlamaForCausalLM(CausalLM):
    """The shell every Llama-shaped family shares: embedding, rotary table, decoder layers, final
    norm and output head. A family that differs only in its layers (Qwen3-MoE, gpt-oss) passes its
    own `make_layer`, architecture name and final-norm dtype instead of building a second shell."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device, *,
                 architecture: Optional[str] = None, make_layer: Optional[Callable[[int], DecoderLayer]] = None,
                 norm_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.args = args
        self.spec = args.model_spec(architecture or args.architecture)
        make_layer = make_layer or (lambda i: LlamaDecoderLayer(args, i, dtype, device))
        self.embed_tokens: torch.nn.Module = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(make_layer(i) for i in range(args.num_layers))
        self.norm = empty_param((args.hidden_size,), norm_dtype or dtype, device)
        self.lm_head: torch.nn.Module = empty_linear(args.hidden_size, args.vocab_size, False, dtype)
        self.rotary = RotaryTable(args.rope, args.head_dim, args.max_position_embeddings, dtype, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.embed_tokens(input_ids), self.rotary.lookup(positions)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.args.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: WeightLoader) -> None:
        self.embed_tokens = weights.embedding(self.embed_tokens, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(weights, f"model.layers.{i}.")
        copy_rows(self.norm, [weights.get("model.norm.weight")], "norm")
        if self.args.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens, self.lm_head)
        else:
            self.lm_head = weights.output_head(self.lm_head, "lm_head.weight")
