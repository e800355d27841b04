"""The contract between model files and the runner.

A model computes a flat, variable-length batch of tokens (several requests'
tokens concatenated). It never sees blocks or requests: each attention layer
hands its new q/k/v to an `AttentionContext`, which stores k/v in the paged
pool and returns the attention output, applying causality, request boundaries
and the layer's sliding window itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from pdserve.kv.specs import AttentionSpec


class AttentionContext(Protocol):
    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Store k/v of the new tokens and attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (positional encoding and norms already applied). Returns
        [num_tokens, num_heads, head_dim]. `scale` multiplies q.k. `sinks` (float32
        [num_heads] or None): a logit per head that joins the softmax denominator and
        weighs no value (gpt-oss's learned attention sinks).
        """
        ...


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Geometry the KV pool and the scheduler need from a model."""

    architecture: str  # e.g. "llama", "qwen3", "gemma3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    layer_specs: tuple[AttentionSpec, ...]  # one per layer
    # Ranks the model is split over; num_heads and num_kv_heads above are then one rank's.
    tensor_parallel_size: int = 1
    model_kv_heads: int = 0  # the whole model's KV heads when split (0: num_kv_heads, not split)

    @property
    def total_kv_heads(self) -> int:
        """KV heads of the whole model, whatever share of them this rank holds."""
        return self.model_kv_heads or self.num_kv_heads


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DecoderLayer(torch.nn.Module):
    """One transformer block, split at its attention so that callers can run the parts apart
    (the compiled decode step compiles the two halves once and reuses them for every layer)."""

    def __init__(self, layer_id: int, attention_scale: float):
        super().__init__()
        self.layer_id = layer_id
        self.attention_scale = attention_scale  # multiplies q.k
        # float32 [num_heads] learned sink logits (gpt-oss), or None: no sinks. Models with
        # sinks replace it with a parameter before loading.
        self.attention_sinks: Optional[torch.Tensor] = None

    def attention_inputs(self, h: torch.Tensor, rope: Any) -> QKV:
        """Residual stream [n, hidden] -> q [n, heads, dim], k and v [n, kv_heads, dim], ready to attend."""
        raise NotImplementedError

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual stream and attention output [n, heads, dim] -> the block's output [n, hidden]."""
        raise NotImplementedError

    def forward(self, h: torch.Tensor, rope: Any, attention: AttentionContext) -> torch.Tensor:  # type: ignore[override]
        q, k, v = self.attention_inputs(h, rope)
        attended = attention.attend(self.layer_id, q, k, v, self.attention_scale, sinks=self.attention_sinks)
        return self.attention_output(h, attended)


class CausalLM(torch.nn.Module):
    """Base of every model file: forward over a flat batch, logits on demand."""

    spec: ModelSpec
    layers: torch.nn.ModuleList  # of DecoderLayer

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Token ids and positions [n] -> (residual stream [n, hidden], what layers need for RoPE)."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionContext,
        between_layers: Optional[Callable[[], None]] = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final-normed hidden states [num_tokens, hidden].
        `between_layers` runs after each layer but the last (it may raise to abandon the pass)."""
        h, rope = self.embed(input_ids, positions)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            h = layer(h, rope, attention)
            if between_layers is not None and index < last:
                between_layers()
        return self.final_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head (and any logit soft-capping): [n, hidden] -> float32 logits [n, vocab_size]."""
        raise NotImplementedError
