"""The contract between model files and the runner.

A model computes a flat, variable-length batch of tokens (several requests'
tokens concatenated). It never sees blocks or requests: each attention layer
hands its new q/k/v to an `AttentionContext`, which stores k/v in the paged
pool and returns the attention output, applying causality, request boundaries
and the layer's sliding window itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kv.specs import AttentionSpec


class AttentionContext(Protocol):
    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store k/v of the new tokens and attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (positional encoding and norms already applied). Returns
        [num_tokens, num_heads, head_dim]. `scale` multiplies q.k.
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


class CausalLM(torch.nn.Module):
    """Base of every model file: forward over a flat batch, logits on demand."""

    spec: ModelSpec

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionContext
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final-normed hidden states [num_tokens, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head (and any logit soft-capping): [n, hidden] -> float32 logits [n, vocab_size]."""
        raise NotImplementedError
