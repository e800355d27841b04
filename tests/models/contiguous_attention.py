"""Reference attention context for model tests: dense causal attention per
sequence, K/V kept in plain growing tensors, sliding windows by position.

It stands in for the paged pool so model files can be checked against
transformers on their own; a flat batch may hold several sequences
(`cu_seqlens` order) and a sequence may arrive in successive chunks.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from pdserve.kv.specs import AttentionSpec, SlidingWindowSpec
from pdserve.models.base import CausalLM


class ContiguousAttention:
    def __init__(self, layer_specs: Sequence[AttentionSpec]):
        self.layer_specs = tuple(layer_specs)
        self._keys: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._values: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._seq_ids: list[Hashable] = []
        self._cu_seqlens: list[int] = [0]

    def set_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Declare the layout of the next forward: seq_ids[i] owns num_tokens[i] consecutive tokens."""
        self._seq_ids = list(seq_ids)
        self._cu_seqlens = [0]
        for n in num_tokens:
            self._cu_seqlens.append(self._cu_seqlens[-1] + n)

    def num_cached(self, seq_id: Hashable) -> int:
        keys = self._keys.get((seq_id, 0))
        return 0 if keys is None else keys.shape[0]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] != self._cu_seqlens[-1]:
            raise ValueError(f"batch has {q.shape[0]} tokens, set_batch declared {self._cu_seqlens[-1]}")
        out = torch.empty_like(q)
        for i, seq_id in enumerate(self._seq_ids):
            start, end = self._cu_seqlens[i], self._cu_seqlens[i + 1]
            out[start:end] = self._attend_one(layer_id, seq_id, q[start:end], k[start:end], v[start:end], scale, sinks)
        return out

    def _attend_one(self, layer_id, seq_id, q, k, v, scale, sinks=None) -> torch.Tensor:
        key = (seq_id, layer_id)
        past_k, past_v = self._keys.get(key), self._values.get(key)
        all_k = k.clone() if past_k is None else torch.cat([past_k, k])
        all_v = v.clone() if past_v is None else torch.cat([past_v, v])
        self._keys[key], self._values[key] = all_k, all_v
        num_new, total = q.shape[0], all_k.shape[0]
        q_pos = torch.arange(total - num_new, total, device=q.device).unsqueeze(1)
        k_pos = torch.arange(total, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        spec = self.layer_specs[layer_id]
        if isinstance(spec, SlidingWindowSpec):
            allowed &= k_pos > q_pos - spec.window_tokens
        group = q.shape[1] // all_k.shape[1]
        keys = all_k.float().repeat_interleave(group, dim=1)
        values = all_v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # the sink is one more logit per head that weighs no value
            sink_column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)


def forward_chunk(
    model: CausalLM, attention: ContiguousAttention, seq_id: Hashable, token_ids: Sequence[int]
) -> torch.Tensor:
    """Run one chunk of one sequence (positions continue from its cache); fp32 logits [n, vocab]."""
    start = attention.num_cached(seq_id)
    device = next(model.parameters()).device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(token_ids), dtype=torch.long, device=device)
    attention.set_batch([seq_id], [len(token_ids)])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, attention)).cpu()


def greedy_generate(
    model: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int, chunk_tokens: int | None = None
) -> list[int]:
    """Greedy decode with a fresh reference context; the prompt goes in chunks of `chunk_tokens`."""
    attention = ContiguousAttention(model.spec.layer_specs)
    chunk = chunk_tokens or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        logits = forward_chunk(model, attention, "seq", prompt_ids[start : start + chunk])
    generated: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(logits[-1].argmax())
        generated.append(next_id)
        logits = forward_chunk(model, attention, "seq", [next_id])
    return generated
