"""Turns the logits of each sampling row into one token.

Invariant: a request with a seed draws from its own generator, so its output
depends only on its seed and logits, never on what else shares the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdserve.engine.schedule_types import SampledToken, ScheduledChunk
from pdserve.request import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and the top-p nucleus of one row."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.shared_generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """logits: float32 [len(chunks), vocab], row i belongs to chunks[i]."""
        token_ids = torch.argmax(logits, dim=-1)
        for row, chunk in enumerate(chunks):
            if not chunk.sampling.greedy:
                token_ids[row] = self._sample_row(logits[row], chunk)
        token_list = token_ids.tolist()
        logprobs = [0.0] * len(chunks)
        wanted = [row for row, chunk in enumerate(chunks) if chunk.sampling.logprobs]
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            chosen = token_ids[rows].unsqueeze(-1)
            values = torch.log_softmax(logits[rows], dim=-1).gather(-1, chosen).squeeze(-1).tolist()
            for row, value in zip(wanted, values):
                logprobs[row] = value
        return [SampledToken(chunk.request_id, token_list[row], logprobs[row]) for row, chunk in enumerate(chunks)]

    def _sample_row(self, row_logits: torch.Tensor, chunk: ScheduledChunk) -> int:
        params: SamplingParams = chunk.sampling
        scaled = _filter_top_k_top_p(row_logits / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(chunk)).item())

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator:
        seed = chunk.sampling.seed
        if seed is None:
            return self.shared_generator
        generator = self.request_generators.get(chunk.request_id)
        if generator is None or chunk.num_sampled_so_far == 0:
            # Re-seed from scratch at the first token so a preempted-and-recomputed
            # request draws the same sequence again.
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.request_generators[chunk.request_id] = generator
        return generator
