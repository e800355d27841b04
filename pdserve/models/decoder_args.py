"""The config fields every decoder-only family reads, parsed once.

Each family's args (`LlamaArgs`, `Gemma3Args`, `GptOssArgs`, `Qwen3MoeArgs`) subclass `DecoderArgs`
and add only their own fields, so the geometry the KV pool sees (`model_spec`) is read from the
config by one function and checked against the layer specs in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from pdserve.kv.specs import AttentionSpec
from pdserve.models.base import ModelSpec
from pdserve.models.hf_config import ModelLoadError, head_dim_of, require


@dataclass(frozen=True, slots=True)
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP width (per expert where every layer is a mixture of experts)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_specs: tuple[AttentionSpec, ...]  # one per layer

    def model_spec(self, architecture: str) -> ModelSpec:
        """The geometry the KV pool and scheduler need; ModelLoadError when the layer specs do not
        cover the layers one to one."""
        if len(self.layer_specs) != self.num_layers:
            raise ModelLoadError(f"{len(self.layer_specs)} layer specs for {self.num_layers} layers")
        return ModelSpec(
            architecture=architecture,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            layer_specs=self.layer_specs,
        )


def decoder_fields(
    config: Mapping[str, Any], *, default_rms_norm_eps: float = 1e-6, default_tie_word_embeddings: bool = False,
) -> dict[str, Any]:
    """`DecoderArgs`' fields but `layer_specs` (each family reads its own layer types), from an HF
    config; the defaults are the ones a family's config omits."""
    num_heads = int(require(config, "num_attention_heads"))
    return dict(
        vocab_size=int(require(config, "vocab_size")),
        hidden_size=int(require(config, "hidden_size")),
        intermediate_size=int(require(config, "intermediate_size")),
        num_layers=int(require(config, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim_of(config),
        rms_norm_eps=float(config.get("rms_norm_eps", default_rms_norm_eps)),
        max_position_embeddings=int(require(config, "max_position_embeddings")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", default_tie_word_embeddings)),
    )


def fields_of(args: DecoderArgs) -> dict[str, Any]:
    """A family's args as keyword arguments, values as they are (`dataclasses.asdict` would turn the
    layer specs into dicts), for a subclass that extends a parsed family."""
    return {field.name: getattr(args, field.name) for field in fields(args)}
