"""The contract between model files and the runner.

A model computes a flat, variable-length batch of tokens (several requests'
tokens concatenated). It never sees blocks or requests: each attention layer
hands its new q/k/v to an `AttentionContext`, which stores k/v in the paged
pool and returns the attention output, applying causality, request boundaries
and the layer's sliding window itself.

A layer with recurrent state (Gated DeltaNet, Mamba2) instead reads each
sequence's state from the same context (`RecurrentStateContext`), runs its scan
over the sequence's rows of the flat batch and writes the state after its last
row back. Layer ids count only layers that hold a cache (K/V or state):
`ModelSpec.layer_specs[layer_id]` is the spec of the layer with that id, and a
block without any cache (Nemotron-H's MLP blocks) takes none. The runner's
context object implements both protocols, and `CausalLM.forward` hands that one
object to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from pdserve.kv.specs import LayerSpec, RecurrentStateSpec


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


class RecurrentStateContext(Protocol):
    """What a recurrent-state layer gets for one forward pass over a flat batch.

    The batch holds the rows of one or more sequences back to back; sequence i owns rows
    [sequence_starts[i], sequence_starts[i + 1]) at consecutive positions. Its state is the
    one left after its previous row (zeros for a sequence that starts at position 0).
    """

    def sequence_starts(self) -> list[int]:
        """cu_seqlens of the flat batch: len = number of sequences + 1, first 0, last the row count."""
        ...

    def read_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [num_sequences, conv_channels, conv_window], recurrent state
        [num_sequences, *recurrent_shape]) of every sequence before this pass, in the dtype of the
        layer's `RecurrentStateSpec`; fresh tensors the layer may update in place."""
        ...

    def write_state(self, layer_id: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store every sequence's state after its last row of this pass (same shapes as `read_state`)."""
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
    layer_specs: tuple[LayerSpec, ...]  # one per cache-holding layer, indexed by layer id
    # Ranks the model is split over; num_heads and num_kv_heads above are then one rank's.
    tensor_parallel_size: int = 1
    model_kv_heads: int = 0  # the whole model's KV heads when split (0: num_kv_heads, not split)

    @property
    def has_recurrent_state(self) -> bool:
        return any(isinstance(spec, RecurrentStateSpec) for spec in self.layer_specs)

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
