"""Per-row logit adjustments before the choice of a token: penalties, logit bias, min_tokens, batched.

Invariant: a row that asks for none of these is left exactly as it was, and no
Python loop runs over the vocabulary: the host builds one padded index tensor
of the asking rows' token ids per step, and everything else is a handful of
batched kernels on the device.

    counts[r, v]  = occurrences of token v among row r's generated tokens
    seen[r, v]    = v occurs in row r's prompt or generated tokens
    logits       -= frequency_penalty * counts + presence_penalty * (counts > 0)      (OpenAI)
    logits[seen]  = logits / repetition_penalty  where > 0, * repetition_penalty else  (HF / CTRL)
    logits[r, v] += logit_bias[v]
    logits[r, v]  = -inf   for v in EOS and stop_token_ids while row r has < min_tokens outputs  (vLLM)
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdserve.engine.schedule_types import ScheduledChunk


def needs_adjustment(chunks: Sequence[ScheduledChunk]) -> bool:
    return any(chunk.sampling.has_penalties or chunk.sampling.logit_bias or chunk.suppressed_stop_ids
               for chunk in chunks)


def adjust_logits(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """A copy of `logits` [rows, vocab] with every row's penalties, bias and stop suppression applied (the
    input is kept intact: logprobs are reported under the model's own distribution)."""
    adjusted = logits.clone()
    penalized = [row for row, chunk in enumerate(chunks) if chunk.sampling.has_penalties]
    if penalized:
        _apply_penalties(adjusted, [chunks[row] for row in penalized], _rows(penalized, logits.device))
    _apply_bias(adjusted, chunks)
    _suppress_stops(adjusted, chunks)
    return adjusted


def _rows(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def _padded_ids(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), longest] int64, short rows filled with `pad_id` (a scratch column past the vocabulary)."""
    width = max(1, max((len(ids) for ids in sequences), default=0))
    padded = [list(ids) + [pad_id] * (width - len(ids)) for ids in sequences]
    return torch.tensor(padded, dtype=torch.int64).to(device, non_blocking=True)


def token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab_size] float32: how often each token occurs in each sequence."""
    ids = _padded_ids(sequences, vocab_size, device)
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, chunks: list[ScheduledChunk], rows: torch.Tensor) -> None:
    vocab_size = logits.shape[-1]
    device = logits.device
    counts = token_counts([chunk.output_token_ids for chunk in chunks], vocab_size, device)
    params = [chunk.sampling for chunk in chunks]
    selected = logits.index_select(0, rows)
    selected -= _column([p.frequency_penalty for p in params], device) * counts
    selected -= _column([p.presence_penalty for p in params], device) * (counts > 0).to(counts.dtype)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (counts > 0) | (token_counts([chunk.prompt_token_ids for chunk in chunks], vocab_size, device) > 0)
        penalty = _column([p.repetition_penalty for p in params], device)
        repeated = torch.where(selected > 0, selected / penalty, selected * penalty)
        selected = torch.where(seen, repeated, selected)
    logits.index_copy_(0, rows, selected)


def _apply_bias(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    entries = [(row, token_id, bias) for row, chunk in enumerate(chunks) for token_id, bias in chunk.sampling.logit_bias
               if token_id < logits.shape[-1]]
    if entries:
        rows, token_ids, biases = zip(*entries)
        logits.index_put_(_cells(rows, token_ids, logits.device),
                          torch.tensor(biases, dtype=logits.dtype).to(logits.device, non_blocking=True),
                          accumulate=True)


def _suppress_stops(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    entries = [(row, token_id) for row, chunk in enumerate(chunks) for token_id in chunk.suppressed_stop_ids
               if token_id < logits.shape[-1]]
    if entries:
        rows, token_ids = zip(*entries)
        logits.index_put_(_cells(rows, token_ids, logits.device),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def _cells(rows: Sequence[int], token_ids: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column index) tensors for `index_put_`, copied to the device asynchronously."""
    return (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True))
