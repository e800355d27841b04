"""Turns the logits of each sampling row into one token: on the device, for the whole batch.

Invariants: one device-to-host transfer per step (the sampled ids, with their
logprobs when asked); a request with a seed draws from its own generator, so its
tokens depend only on its seed, its logits and how many tokens it sampled before,
never on what else shares the batch, on a preemption, or on which worker drew
its earlier tokens. Every parameter the API accepts gives a token of the
filtered distribution (a temperature that underflows float32 is the limit
T -> 0, the argmax; a top_p that rounds to 0 keeps the top token; a top_k past
the vocabulary keeps all); a row whose logits are not finite comes back
`failed`, failing its request alone.

    logits [rows, vocab] ──argmax──────────────────────────────────▶ greedy ids ─┐
        │ random rows only (index_select)                                         ├─ where(greedy) ─▶ ids
        └─ / temperature ─ top-k/top-p mask ─ softmax ─ / Exp(1) noise ─ argmax ──┘
                                                         (seeded rows: their own generator)

Sampling is an exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) picks
token i with probability p_i, so a whole batch samples with a handful of
kernels and no host round trip. Later per-row features slot in as batched steps
over `SamplingBatch` tensors: logit bias and penalties adjust `logits` before
the choice, grammar masks are a masked_fill, top logprobs one topk packed into
the same transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pdserve.engine.schedule_types import SampledToken, ScheduledChunk


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of one step; tensors live on the sampler's device."""

    random_rows: Optional[torch.Tensor]  # [r] int64 rows that sample; None: all greedy
    temperatures: Optional[torch.Tensor]  # [r, 1] float32, for the random rows
    top_k: Optional[torch.Tensor]  # [r, 1] int64 (vocab when off); None: no row filters
    top_p: Optional[torch.Tensor]  # [r, 1] float32 (inf when off)
    seeded: list[tuple[int, torch.Generator]]  # (index among the random rows, its generator)
    wants_logprobs: bool


@dataclass(slots=True)
class _SeededState:
    generator: torch.Generator
    num_draws: int  # rows of noise drawn so far = tokens the request sampled


# Temperatures are floored here: dividing by a smaller float32 (or by a float64 that
# rounds to 0) would turn logits into inf/nan; at this floor the distribution is
# already the argmax's one-hot (ties shared), which is the limit T -> 0.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)
FAILED_TOKEN_ID = -1  # marks a row whose logits were not finite (see `SampledToken.failed`)


def _top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k and, within those, its top-p nucleus (always >= 1 token:
    the top one is kept even when top_p rounds to 0)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p) & (ranks > 0)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.shared_generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, _SeededState] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._seeded.pop(request_id, None)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """logits: float32 [len(chunks), vocab], row i belongs to chunks[i]."""
        token_ids, logprobs = self.sample_on_device(logits, chunks)
        if logprobs is None:
            ids, values = token_ids.tolist(), [0.0] * len(chunks)
        else:  # one transfer for both: ids are exact in float64
            ids, values = torch.stack([token_ids.double(), logprobs.double()]).tolist()
        return [SampledToken(chunk.request_id, int(token_id), value if chunk.sampling.logprobs else 0.0,
                             failed=token_id == FAILED_TOKEN_ID)
                for chunk, token_id, value in zip(chunks, ids, values)]

    def sample_on_device(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(token ids [rows] int64, logprobs [rows] or None) without waiting for the device."""
        batch = self.batch(chunks, logits.shape[-1])
        token_ids = logits.argmax(dim=-1)
        if batch.random_rows is not None:
            token_ids.index_copy_(0, batch.random_rows, self._draw(logits.index_select(0, batch.random_rows), batch))
        logprobs = None
        if batch.wants_logprobs:  # of the chosen token under the unscaled distribution
            chosen = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
            logprobs = chosen - logits.logsumexp(dim=-1)
        # A row the model computed nan/inf logits for has no meaningful token: fail it alone.
        token_ids = token_ids.masked_fill(~logits.isfinite().all(dim=-1), FAILED_TOKEN_ID)
        return token_ids, logprobs

    def batch(self, chunks: Sequence[ScheduledChunk], vocab_size: int) -> SamplingBatch:
        """Gather the rows' parameters into device tensors (asynchronous host-to-device copies)."""
        random = [(row, chunk) for row, chunk in enumerate(chunks) if not chunk.sampling.greedy]
        wants_logprobs = any(chunk.sampling.logprobs for chunk in chunks)
        if not random:
            return SamplingBatch(None, None, None, None, [], wants_logprobs)
        params = [chunk.sampling for _, chunk in random]
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        seeded = [(index, self._generator(chunk, vocab_size)) for index, (_, chunk) in enumerate(random)
                  if chunk.sampling.seed is not None]
        return SamplingBatch(
            random_rows=self._on_device([row for row, _ in random], torch.int64),
            temperatures=self._on_device([[max(p.temperature, MIN_TEMPERATURE)] for p in params], torch.float32),
            top_k=self._on_device([[min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size] for p in params],
                                  torch.int64) if filtered else None,
            top_p=self._on_device([[p.top_p if p.top_p < 1.0 else float("inf")] for p in params], torch.float32)
            if filtered else None,
            seeded=seeded, wants_logprobs=wants_logprobs,
        )

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Shifted so the top logit is 0: however small the temperature, nothing overflows to +inf.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / batch.temperatures
        if batch.top_k is not None:
            scaled = _top_k_top_p_mask(scaled, batch.top_k, batch.top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.shared_generator)
        for index, generator in batch.seeded:
            noise[index].exponential_(generator=generator)
        # A zero draw would turn p/E into 0/0 for a masked token.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _generator(self, chunk: ScheduledChunk, vocab_size: int) -> torch.Generator:
        """The request's own generator, positioned at its `num_sampled_so_far`-th draw.

        Kept across steps and preemptions; rebuilt from the seed (and advanced) when
        the count disagrees: a request recomputed before its first token, or one
        whose earlier tokens another worker drew."""
        state = self._seeded.get(chunk.request_id)
        if state is None or state.num_draws != chunk.num_sampled_so_far:
            generator = torch.Generator(device=self.device).manual_seed(chunk.sampling.seed)
            skipped = torch.empty(vocab_size, device=self.device)
            for _ in range(chunk.num_sampled_so_far):
                skipped.exponential_(generator=generator)
            state = _SeededState(generator, chunk.num_sampled_so_far)
            self._seeded[chunk.request_id] = state
        state.num_draws += 1
        return state.generator

    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
