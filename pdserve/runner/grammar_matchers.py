"""Per-request grammar state on the engine thread, and the token masks of each step.

Invariants: a request's matcher has consumed exactly the tokens the request
sampled (rebuilt and replayed when the counts disagree: after a preemption on
another path, or on a decode worker that did not draw the earlier tokens); a
step's masks are computed on a helper thread while the model runs (llguidance
releases the GIL), so the grammar adds to the step only what the forward pass
does not hide. A matcher in an error state allows only end-of-sequence.

    bitmask [rows, ceil(vocab / 32)] int32 (host)  ──bits──▶  allowed [rows, vocab] bool (device)
    rows without a grammar are all ones (-1), so one masked_fill serves the batch
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance
import llguidance.numpy as llguidance_numpy  # not llguidance.torch: it runs torch.compile at import (seconds a start)
import torch

from pdserve.engine.schedule_types import SampledToken, ScheduledChunk
from pdserve.grammar.errors import GrammarTokenizerUnavailable
from pdserve.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GrammarTokenizer:
    """The llguidance view of the model's vocabulary: built once, on first use (about a second),
    which the HTTP edge triggers off the event loop before the first grammar reaches the engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        self._built: Optional[llguidance.LLTokenizer] = None
        self._failure: Optional[str] = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        """`GrammarTokenizerUnavailable` when llguidance cannot read this tokenizer (a request fault, a 400)."""
        with self._lock:
            if self._built is None and self._failure is None:
                try:
                    self._built = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
                except Exception as exc:  # noqa: BLE001 - whatever llguidance says, the answer is the same
                    logger.warning("structured outputs are unavailable: llguidance cannot read the tokenizer: %s", exc)
                    self._failure = f"its tokenizer cannot be used for grammars ({exc})"
            if self._built is None:
                raise GrammarTokenizerUnavailable(self._failure)
            return self._built


@dataclass(slots=True)
class _Matcher:
    matcher: llguidance.LLMatcher
    num_consumed: int


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask allowing every token, in host memory a GPU copies from fast (as llguidance.torch's)."""
    shape = llguidance_numpy.get_bitmask_shape(num_rows, vocab_size)
    try:
        return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    except RuntimeError:  # no memory can be pinned here
        return torch.full(shape, -1, dtype=torch.int32)


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, words] int32 bits (bit j of word w = token 32w + j) -> [rows, vocab_size] bool on `device`."""
    bits = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = (words.unsqueeze(-1) >> bits) & 1
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allow_only(words: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Set one row of an int32 bitmask to allow exactly `token_ids`. Bit 31 of a word is its sign bit:
    torch stores `1 << 31` there as -2**31, and `bitmask_to_allowed` reads it back as set."""
    words.zero_()
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)


MASK_TIMEOUT_S = 5.0  # a step waits this long for its grammar masks, then fails the grammar rows


class GrammarMatchers:
    def __init__(self, tokenizer: GrammarTokenizer, mask_timeout_s: float = MASK_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.mask_timeout_s = mask_timeout_s
        self.vocab_size = tokenizer.vocab_size
        self._matchers: dict[str, _Matcher] = {}
        self._executor: Optional[llguidance.LLExecutor] = None
        self._pool: Optional[ThreadPoolExecutor] = None

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def start_masks(self, chunks: Sequence[ScheduledChunk]) -> Optional[Future]:
        """Begin computing the masks of the sampling rows `chunks` (None: no row has a grammar)."""
        rows = [(self._matcher(chunk), row) for row, chunk in enumerate(chunks) if chunk.sampling.grammar]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
            self._executor = llguidance.LLExecutor()
        return self._pool.submit(self._fill, rows, len(chunks))

    def result(self, masks: Future, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """(the step's bitmask, the rows whose grammar gave no mask in time). Never waits more than
        `mask_timeout_s`: a grammar stuck on its helper thread fails its own rows (none allowed)
        and is abandoned with its thread; the other rows sample unconstrained as usual."""
        try:
            return masks.result(timeout=self.mask_timeout_s), []
        except FutureTimeout:
            pass
        late = [row for row, chunk in enumerate(chunks) if chunk.sampling.grammar]
        logger.error("grammar masks for requests %s took over %.1f s; failing those requests",
                     [chunks[row].request_id for row in late], self.mask_timeout_s)
        self.forget([chunks[row].request_id for row in late])
        if self._pool is not None:  # its thread may stay busy: later steps get a fresh one
            self._pool.shutdown(wait=False)
        self._pool = self._executor = None
        bitmask = allocate_token_bitmask(len(chunks), self.vocab_size)
        for row in late:
            bitmask[row].zero_()
        return bitmask, late

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], num_rows: int) -> torch.Tensor:
        bitmask = allocate_token_bitmask(num_rows, self.vocab_size)
        llguidance_numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask.numpy())  # fills it in place
        for matcher, row in rows:
            if matcher.is_error():  # only EOS: end the answer rather than sample garbage
                allow_only(bitmask[row], self.tokenizer.eos_token_ids)
        return bitmask

    def consume(self, chunks: Sequence[ScheduledChunk], sampled: Sequence[SampledToken]) -> None:
        """Advance each grammar row's matcher by the token it sampled."""
        for chunk, token in zip(chunks, sampled):
            if not chunk.sampling.grammar or token.failed:  # a failed row's request ends here
                continue
            state = self._matchers.get(chunk.request_id)
            if state is None:
                continue
            if not state.matcher.consume_token(token.token_id):
                logger.warning("request %s: grammar refused token %d: %s", chunk.request_id, token.token_id,
                               state.matcher.get_error())
            state.num_consumed += 1

    def _matcher(self, chunk: ScheduledChunk) -> llguidance.LLMatcher:
        state = self._matchers.get(chunk.request_id)
        if state is None or state.num_consumed != chunk.num_sampled_so_far:
            matcher = llguidance.LLMatcher(self.tokenizer.get(), chunk.sampling.grammar, log_level=0)
            earlier = list(chunk.output_token_ids[: chunk.num_sampled_so_far])
            if earlier and not matcher.consume_tokens(earlier):
                logger.warning("request %s: replaying %d tokens into its grammar failed", chunk.request_id, len(earlier))
            state = _Matcher(matcher, chunk.num_sampled_so_far)
            self._matchers[chunk.request_id] = state
        return state.matcher

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
