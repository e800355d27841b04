"""Turns the logits of each sampling row into one token: on the device, for the whole batch.

Invariants: one device-to-host transfer per step (the sampled ids, with their
logprobs and top alternatives when asked); a request with a seed draws from its own generator, so its
tokens depend only on its seed, its logits and how many tokens it sampled before,
never on what else shares the batch, on a preemption, or on which worker drew
its earlier tokens. Every parameter the API accepts gives a token of the
filtered distribution (a temperature that underflows float32 is the limit
T -> 0, the argmax; a top_p that rounds to 0 keeps the top token; a top_k past
the vocabulary keeps all; penalties and bias stay finite); a row whose logits
are not finite, or that its grammar leaves no token, comes back `failed`,
failing its request alone.

    logits ─ penalties, bias ─ grammar mask ─┬─argmax──────────────────────────────▶ greedy ids ─┐
    [rows, vocab]  (logits_processors)        │ random rows only (index_select)                   ├─ ids
                                              └─ / temperature ─ top-k/top-p ─ softmax ─ / Exp(1) ─ argmax ─┘
    logits ─ log_softmax ─ gather(ids), topk(k) ─▶ logprobs (the model's own distribution)
    packed [rows, 2 + 2k] float64 ─ .tolist() ─▶ SampledToken (the one transfer)

Sampling is an exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) picks
token i with probability p_i, so a whole batch samples with a handful of
kernels and no host round trip. Logprobs are reported under the unadjusted
distribution (vLLM's default), so penalties, bias and grammars never change them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pdserve.runner.logits_processors import adjust_logits, needs_adjustment
from pdserve.engine.schedule_types import SampledToken, ScheduledChunk
from pdserve.kernels.native import ops


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of one step; tensors live on the sampler's device."""

    random_rows: Optional[torch.Tensor]  # [r] int64 rows that sample; None: all greedy
    temperatures: Optional[torch.Tensor]  # [r, 1] float32, for the random rows
    top_k: Optional[torch.Tensor]  # [r, 1] int64 (vocab when off); None: no row filters
    top_p: Optional[torch.Tensor]  # [r, 1] float32 (inf when off)
    seeded: list[tuple[int, int]]  # (index among the random rows, the seed of its draw: `draw_seed`)
    wants_logprobs: bool
    num_top_logprobs: int = 0  # the most alternatives any row asked for


_MASK_64 = (1 << 64) - 1


def _mix_64(value: int) -> int:
    """SplitMix64's finaliser: a 64-bit bijection that scatters neighbouring inputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


def draw_seed(seed: int, draw_index: int) -> int:
    """The seed of a request's `draw_index`-th draw: a function of its seed and that index alone, so any
    draw is reached at once (no replay of the earlier ones), whichever worker or step makes it."""
    return _mix_64((seed & _MASK_64) ^ _mix_64(draw_index)) >> 1  # 63 bits: any torch generator takes it


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
    def __init__(self, device: torch.device, seed: int = 0, native_greedy: bool = False):
        """native_greedy: plain greedy steps (no penalties, bias, grammar or logprobs) take the
        native kernels' one-call greedy choice; the caller says whether they are loaded."""
        self.device = device
        self.native_greedy = native_greedy and device.type == "cpu"
        self.shared_generator = torch.Generator(device=device).manual_seed(seed)
        self._draw_generator = torch.Generator(device=device)  # re-seeded for each seeded row's draw

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
               allowed: Optional[torch.Tensor] = None) -> list[SampledToken]:
        """logits: float32 [len(chunks), vocab], row i belongs to chunks[i]; allowed: grammar mask or None."""
        return unpack_sampled(self.sample_packed(logits, chunks, allowed).tolist(), chunks)

    def sample_packed(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                      allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[rows, 1] (ids) or [rows, 2 + 2k] (ids, logprobs, k top ids, k top logprobs) float64 on the
        device: ids are exact in float64, so one transfer carries everything."""
        token_ids, logprobs, top = self.sample_on_device(logits, chunks, allowed)
        if logprobs is None:
            return token_ids.double().unsqueeze(1)
        columns = [token_ids.double().unsqueeze(1), logprobs.double().unsqueeze(1)]
        if top is not None:
            columns += [top[0].double(), top[1].double()]
        return torch.cat(columns, dim=1)

    def sample_on_device(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                         allowed: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """(token ids [rows] int64, logprobs [rows] or None, (top ids, top logprobs) [rows, k] or None)
        without waiting for the device."""
        if self.native_greedy and allowed is None and logits.dtype == torch.float32 and _plain_greedy(chunks):
            # The same ids and failed rows (FAILED_TOKEN_ID) as below, in one native call.
            return ops().greedy_tokens(logits).squeeze(1).long(), None, None
        batch = self.batch(chunks, logits.shape[-1])
        choosing = _choosing_logits(logits, chunks, allowed)
        token_ids = choosing.argmax(dim=-1)
        if batch.random_rows is not None:
            drawn = self._draw(choosing.index_select(0, batch.random_rows), batch)
            token_ids.index_copy_(0, batch.random_rows, drawn)
        # A row the model computed nan/inf logits for (or with no token left to choose) has no
        # meaningful token: fail it alone.
        failed = ~logits.isfinite().all(dim=-1) | (choosing.amax(dim=-1) == float("-inf"))
        if not batch.wants_logprobs:
            return token_ids.masked_fill(failed, FAILED_TOKEN_ID), None, None
        log_probs = logits.log_softmax(dim=-1)  # of the model's own distribution
        logprobs = log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        top = log_probs.topk(batch.num_top_logprobs, dim=-1) if batch.num_top_logprobs else None
        token_ids = token_ids.masked_fill(failed, FAILED_TOKEN_ID)
        return token_ids, logprobs, (top.indices, top.values) if top is not None else None

    def batch(self, chunks: Sequence[ScheduledChunk], vocab_size: int) -> SamplingBatch:
        """Gather the rows' parameters into device tensors (asynchronous host-to-device copies)."""
        random = [(row, chunk) for row, chunk in enumerate(chunks) if not chunk.sampling.greedy]
        wants_logprobs = any(chunk.sampling.logprobs for chunk in chunks)
        num_top = min(vocab_size, max((chunk.sampling.top_logprobs for chunk in chunks if chunk.sampling.logprobs),
                                      default=0))
        if not random:
            return SamplingBatch(None, None, None, None, [], wants_logprobs, num_top)
        params = [chunk.sampling for _, chunk in random]
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        # A seeded row's draw is seeded for that draw alone, by its seed and its index: the same after a
        # preemption, a recompute or on another worker, and the 10,000th draw costs what the first does.
        seeded = [(index, draw_seed(chunk.sampling.seed, chunk.num_sampled_so_far))
                  for index, (_, chunk) in enumerate(random) if chunk.sampling.seed is not None]
        return SamplingBatch(
            random_rows=self._on_device([row for row, _ in random], torch.int64),
            temperatures=self._on_device([[max(p.temperature, MIN_TEMPERATURE)] for p in params], torch.float32),
            top_k=self._on_device([[min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size] for p in params],
                                  torch.int64) if filtered else None,
            top_p=self._on_device([[p.top_p if p.top_p < 1.0 else float("inf")] for p in params], torch.float32)
            if filtered else None,
            seeded=seeded, wants_logprobs=wants_logprobs, num_top_logprobs=num_top,
        )

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Shifted so the top logit is 0: however small the temperature, nothing overflows to +inf.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / batch.temperatures
        if batch.top_k is not None:
            scaled = _top_k_top_p_mask(scaled, batch.top_k, batch.top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.shared_generator)
        for index, seed in batch.seeded:
            noise[index].exponential_(generator=self._draw_generator.manual_seed(seed))
        # A zero draw would turn p/E into 0/0 for a masked token.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


def _plain_greedy(chunks: Sequence[ScheduledChunk]) -> bool:
    """Every row takes its argmax as is: greedy, nothing adjusting the logits, no logprobs."""
    return all(chunk.sampling.greedy and not chunk.sampling.logprobs for chunk in chunks) and not needs_adjustment(chunks)


def _choosing_logits(logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                     allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """The logits a token is chosen from: penalties, bias and min_tokens applied, then the grammar mask
    (min_tokens never hides the EOS a grammar row may need: see `ScheduledChunk.suppressed_stop_ids`)."""
    adjusted = adjust_logits(logits, chunks) if needs_adjustment(chunks) else logits
    return adjusted if allowed is None else adjusted.masked_fill(~allowed, float("-inf"))


def unpack_sampled(rows: list[list[float]], chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
    """The host side of `sample_packed`: one `SampledToken` per row, alternatives trimmed to what each asked."""
    sampled = []
    for chunk, values in zip(chunks, rows):
        token_id = int(values[0])
        if token_id == FAILED_TOKEN_ID:
            sampled.append(SampledToken(chunk.request_id, token_id, 0.0, failed=True))
            continue
        if not chunk.sampling.logprobs or len(values) == 1:
            sampled.append(SampledToken(chunk.request_id, token_id, 0.0))
            continue
        num_top = (len(values) - 2) // 2
        wanted = chunk.sampling.top_logprobs
        top = tuple((int(values[2 + i]), values[2 + num_top + i]) for i in range(min(wanted, num_top)))
        sampled.append(SampledToken(chunk.request_id, token_id, values[1], top))
    return sampled
