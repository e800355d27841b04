"""Reference attention context for model tests: dense causal attention per
sequence, K/V kept in plain growing tensors, sliding windows by position.

It stands in for the paged pool so model files can be checked against
transformers on their own; a flat batch may hold several sequences
(`cu_seqlens` order) and a sequence may arrive in successive chunks. Layers
with recurrent state (`RecurrentStateContext`) keep one conv window and one
recurrent tensor per (sequence, layer), zeros before the sequence's first chunk.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from pdserve.kv.specs import LayerSpec, RecurrentStateSpec, SlidingWindowSpec
from pdserve.models.base import CausalLM


class ContiguousAttention:
    def __init__(self, layer_specs: Sequence[LayerSpec], device: torch.device | str = "cpu"):
        self.layer_specs = tuple(layer_specs)
        self.device = torch.device(device)
        self._keys: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._values: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._states: dict[tuple[Hashable, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._positions: dict[Hashable, int] = {}  # tokens of each sequence before the current batch
        self._seq_ids: list[Hashable] = []
        self._cu_seqlens: list[int] = [0]
        self._pending: dict[Hashable, int] = {}  # tokens of each sequence in the current batch
        self._ran = False  # whether a layer has run the current batch

    def set_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Declare the layout of the next forward: seq_ids[i] owns num_tokens[i] consecutive tokens."""
        for seq_id in self._seq_ids:  # the previous batch is done
            self._positions[seq_id] = self.num_cached(seq_id)
        self._ran = False
        self._seq_ids = list(seq_ids)
        self._cu_seqlens = [0]
        for n in num_tokens:
            self._cu_seqlens.append(self._cu_seqlens[-1] + n)
        self._pending = dict(zip(self._seq_ids, num_tokens))

    def num_cached(self, seq_id: Hashable) -> int:
        """Tokens of the sequence computed so far (the current batch's included once it ran)."""
        return self._positions.get(seq_id, 0) + (self._pending.get(seq_id, 0) if self._ran else 0)

    # ---- RecurrentStateContext ---------------------------------------------------

    def sequence_starts(self) -> list[int]:
        return list(self._cu_seqlens)

    def read_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self._state_spec(layer_id)
        dtype = getattr(torch, spec.dtype)
        convs, recurrents = [], []
        for seq_id in self._seq_ids:
            stored = self._states.get((seq_id, layer_id))
            if stored is None:
                stored = (torch.zeros(spec.conv_channels, spec.conv_window, dtype=dtype, device=self.device),
                          torch.zeros(spec.recurrent_shape, dtype=dtype, device=self.device))
            convs.append(stored[0].clone())
            recurrents.append(stored[1].clone())
        return torch.stack(convs), torch.stack(recurrents)

    def write_state(self, layer_id: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        spec = self._state_spec(layer_id)
        expected = ((len(self._seq_ids), spec.conv_channels, spec.conv_window),
                    (len(self._seq_ids), *spec.recurrent_shape))
        if (tuple(conv.shape), tuple(recurrent.shape)) != expected:
            raise ValueError(f"layer {layer_id}: state shapes {tuple(conv.shape)}, {tuple(recurrent.shape)} "
                             f"are not {expected}")
        for index, seq_id in enumerate(self._seq_ids):
            self._states[(seq_id, layer_id)] = (conv[index].clone(), recurrent[index].clone())
        self._ran = True

    def _state_spec(self, layer_id: int) -> RecurrentStateSpec:
        spec = self.layer_specs[layer_id]
        if not isinstance(spec, RecurrentStateSpec):
            raise ValueError(f"layer {layer_id} holds no recurrent state ({spec})")
        return spec

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] != self._cu_seqlens[-1]:
            raise ValueError(f"batch has {q.shape[0]} tokens, set_batch declared {self._cu_seqlens[-1]}")
        self._ran = True
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
    attention = ContiguousAttention(model.spec.layer_specs, next(model.parameters()).device)
    chunk = chunk_tokens or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        logits = forward_chunk(model, attention, "seq", prompt_ids[start : start + chunk])
    generated: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(logits[-1].argmax())
        generated.append(next_id)
        logits = forward_chunk(model, attention, "seq", [next_id])
    return generated
