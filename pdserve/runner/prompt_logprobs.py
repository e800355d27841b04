"""Log-probabilities of prompt tokens, for completions' `echo` with `logprobs`: computed where the prompt is.

Invariant: the logprob of prompt token i comes from the logits at position
i - 1 of the same forward pass that writes the prompt's KV, so it is exact
whatever the chunking; token 0 has none. Requests that ask skip the prefix
cache (a cached position has no logits) — the scheduler sees to that.

    chunk rows  [s, e)          logits at positions s .. min(e, P - 1) - 1
    targets                      prompt tokens   s + 1 .. min(e, P - 1)
    packed per row (float64)     target logprob, k alternative ids, k alternative logprobs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pdserve.engine.schedule_types import PromptLogprobs, ScheduledChunk


@dataclass(slots=True)
class WantedRows:
    chunk: ScheduledChunk
    first_row: int  # in the flat batch of hidden states
    num_rows: int


def wanted_rows(chunks: Sequence[ScheduledChunk]) -> list[WantedRows]:
    """Chunks (in flat-batch order) whose prompt positions need logprobs, with their rows."""
    wanted, offset = [], 0
    for chunk in chunks:
        last_target = min(chunk.end_position, chunk.num_prompt_tokens - 1)
        num_rows = last_target - chunk.start_position
        if chunk.sampling.prompt_logprobs is not None and num_rows > 0:
            wanted.append(WantedRows(chunk, offset, num_rows))
        offset += chunk.num_tokens
    return wanted


def row_indices(wanted: list[WantedRows]) -> list[int]:
    """The flat-batch rows whose logits `compute_packed` computes, in its order."""
    return [r.first_row + i for r in wanted for i in range(r.num_rows)]


def compute_packed(hidden: torch.Tensor, wanted: list[WantedRows],
                   compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[sum rows, 1 + 2k] float64 on the device (k = the most alternatives any chunk asked for)."""
    device = hidden.device
    rows = torch.tensor(row_indices(wanted), dtype=torch.int64)
    targets = torch.tensor([t for r in wanted for t in _targets(r)], dtype=torch.int64)
    log_probs = compute_logits(hidden[rows.to(device, non_blocking=True)]).log_softmax(dim=-1)
    chosen = log_probs.gather(-1, targets.to(device, non_blocking=True).unsqueeze(-1))
    num_top = min(log_probs.shape[-1], max(r.chunk.sampling.prompt_logprobs or 0 for r in wanted))
    columns = [chosen.double()]
    if num_top:
        top = log_probs.topk(num_top, dim=-1)
        columns += [top.indices.double(), top.values.double()]
    return torch.cat(columns, dim=1)


def _targets(rows: WantedRows) -> Sequence[int]:
    start = rows.chunk.start_position + 1
    return rows.chunk.prompt_token_ids[start : start + rows.num_rows]


def unpack(values: list[list[float]], wanted: list[WantedRows]) -> list[PromptLogprobs]:
    results, cursor = [], 0
    for rows in wanted:
        targets = _targets(rows)
        entries = []
        for target, row in zip(targets, values[cursor : cursor + rows.num_rows]):
            num_top = (len(row) - 1) // 2
            wanted_top = min(rows.chunk.sampling.prompt_logprobs or 0, num_top)
            alternatives = tuple((int(row[1 + i]), row[1 + num_top + i]) for i in range(wanted_top))
            entries.append(((int(target), row[0]), *alternatives))
        cursor += rows.num_rows
        results.append(PromptLogprobs(rows.chunk.request_id, rows.chunk.start_position + 1, tuple(entries)))
    return results
