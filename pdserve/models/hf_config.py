"""Reading Hugging Face `config.json` dictionaries into plain values.

Every model file parses its config through these helpers, so a missing or
unsupported field always surfaces as one typed `ModelLoadError` at load time,
never as a KeyError deep inside a forward pass.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pdserve.kv.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

SLIDING_LAYER = "sliding_attention"
FULL_LAYER = "full_attention"


class ModelLoadError(ValueError):
    """A checkpoint cannot be served: unknown architecture, missing file or
    tensor, or a configuration option this server does not implement."""


class UnsupportedModelFeature(ModelLoadError, NotImplementedError):
    """The checkpoint is well formed but uses an option this server does not
    implement (e.g. attention logit soft-capping)."""


def require(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]`, or a ModelLoadError naming the missing key."""
    value = config.get(key)
    if value is None:
        raise ModelLoadError(f"model config has no {key!r}")
    return value


def head_dim_of(config: Mapping[str, Any]) -> int:
    """Explicit `head_dim` when the config has one (Qwen3, Gemma 3), else hidden / heads."""
    explicit = config.get("head_dim")
    if explicit:
        return int(explicit)
    return int(require(config, "hidden_size")) // int(require(config, "num_attention_heads"))


def standard_rope(params: Mapping[str, Any] | None, *, default_theta: float, max_positions: int,
                  partial_rotary: bool = False) -> dict[str, Any]:
    """One flat rope dict with `rope_type` and `rope_theta` always present.

    Accepts both spellings found on the Hub: the legacy `rope_scaling` dict
    (`type` or `rope_type`, theta kept outside) and transformers 5's
    `rope_parameters` (theta inside). A `partial_rotary_factor` below 1 is
    refused unless the caller rotates part of each head (`partial_rotary`,
    `rotary_dim_of`).
    """
    rope = dict(params or {})
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    rope.pop("type", None)
    rope.setdefault("rope_theta", default_theta)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", max_positions)
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0) and not partial_rotary:
        raise UnsupportedModelFeature(f"partial rotary embeddings (partial_rotary_factor={factor}) are not supported")
    return rope


def rotary_dim_of(rope: Mapping[str, Any], head_dim: int) -> int:
    """How many leading dims of each head rotate: head_dim * `partial_rotary_factor` (all by default)."""
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor") or 1.0))
    if rotary_dim < 2 or rotary_dim % 2:
        raise ModelLoadError(f"partial rotary embeddings over {rotary_dim} of {head_dim} head dims: need an even count")
    return rotary_dim


def flat_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """The single rope dict of a model whose layers all share one RoPE (Llama family)."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    theta = float((params or {}).get("rope_theta") or config.get("rope_theta") or 10000.0)
    return standard_rope(params, default_theta=theta, max_positions=int(require(config, "max_position_embeddings")))


def layer_specs_from_types(
    layer_types: Sequence[str], sliding_window: int | None
) -> tuple[AttentionSpec, ...]:
    """Map HF `layer_types` strings to KV specs; sliding layers need a window."""
    specs: list[AttentionSpec] = []
    for layer_id, layer_type in enumerate(layer_types):
        if layer_type == FULL_LAYER:
            specs.append(FullAttentionSpec())
        elif layer_type == SLIDING_LAYER:
            if not sliding_window:
                raise ModelLoadError(f"layer {layer_id} is a sliding-window layer but the config has no sliding_window")
            specs.append(SlidingWindowSpec(int(sliding_window)))
        else:
            raise UnsupportedModelFeature(f"layer {layer_id} has unsupported layer type {layer_type!r}")
    return tuple(specs)


def eos_ids_of(config: Mapping[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` of a config or generation config, as a tuple (it may be an int or a list)."""
    value = config.get("eos_token_id")
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
