"""Adaptive disaggregation: per request, prefill on a prefill worker (P/D) or on the decode worker
itself (decode-only), whichever keeps the request, and the streams already decoding, within the SLO.

Invariant: the choice changes where a prompt is computed, never what is computed (the answer is the
same either way); without enough measurements it is the static rule (`--disagg-min-prompt-tokens`).

The estimates, per request (s/token: seconds per computed prompt token, learned from this proxy's own
legs: a prefill leg's cached prefix, as its worker reports it, is left out of the count, and so is the
decode worker's predicted one; samples age, see `PrefillSpeed`):

    budget    = slo.ttft_ms + slo.ttft_ms_per_token * prompt tokens
    ttft(P/D) = (tokens queued on the least-busy prefill worker + prompt) * s/token(P)
    ttft(D)   = (tokens the decode worker is prefilling already + uncached prompt) * s/token(D)
    stall(D)  = uncached prompt * s/token(D)      extra time the decode worker's running streams wait

    uncached <= what D prefills within one TPOT       -> decode   ("short": nobody notices)
    ttft(P/D) <= budget                               -> P/D      ("prefill_fits")
    ttft(D) <= budget and stall(D) <= stall allowance -> decode   ("prefill_busy": P's queue would miss it)
    otherwise the smaller TTFT, P/D on a tie          -> P/D or decode ("best_effort")

The stall allowance is `stall_tpots` TPOT budgets when the decode worker is running streams (their
per-token average absorbs a short stall). An idle decode worker does not stay idle: a stall longer
than the allowance is taken only while the requests expected to arrive during it (this proxy's
arrival rate per decode worker, `ArrivalRate`) stay under IDLE_STALL_ARRIVALS. Otherwise a long
prompt computed on an idle D held every stream and handoff arriving meanwhile for seconds (measured
at 0.3 req/s on two cores: D's first step after a pull p99 4.7 s, TPOT p99 107 ms; docs/benchmarks.md
"Goodput"). Torch-free.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

DECODE = "decode"
PREFILL = "prefill"
_MIN_SAMPLES = 3
_EWMA_WEIGHT = 0.25  # of a new sample, back to back
SPEED_HALF_LIFE_S = 60.0  # an estimate's weight halves per minute without a sample
IDLE_STALL_ARRIVALS = 0.5  # an idle decode worker's stall may expect to meet this many arrivals
ARRIVAL_WINDOW_S = 60.0
ARRIVAL_MIN_SPAN_S = 30.0


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    ttft_ms_per_token: float
    tpot_ms: float

    def ttft_budget_s(self, num_prompt_tokens: int) -> float:
        return (self.ttft_ms + self.ttft_ms_per_token * num_prompt_tokens) / 1000.0

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000.0


class PrefillSpeed:
    """Seconds per computed prompt token of one role's prefill, an exponentially weighted mean of clean
    samples (a leg that had its worker to itself: no queueing in the figure; its cached prefix not
    counted). Samples age: the estimate's weight halves every `half_life_s` without a sample, so after a
    quiet spell the next sample counts for more than the old ones (a worker restarted, or now shared)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, half_life_s: float = SPEED_HALF_LIFE_S):
        self.num_samples = 0
        self._s_per_token = 0.0
        self._clock = clock
        self._half_life_s = half_life_s
        self._last_sample_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens`: the prompt tokens the leg computed (its cached prefix left out)."""
        if num_tokens < 1 or seconds <= 0:
            return
        sample = seconds / num_tokens
        now_s = self._clock()
        if self.num_samples == 0:
            self._s_per_token = sample
        else:
            age_s = max(0.0, now_s - self._last_sample_s)
            kept = (1 - _EWMA_WEIGHT) * 0.5 ** (age_s / self._half_life_s)
            self._s_per_token = kept * self._s_per_token + (1 - kept) * sample
        self._last_sample_s = now_s
        self.num_samples += 1

    @property
    def s_per_token(self) -> Optional[float]:
        return self._s_per_token if self.num_samples >= _MIN_SAMPLES else None


class ArrivalRate:
    """Requests per second this proxy routed over the last `window_s` (over the time since the first
    one while younger than the window, once it has seen three, and never over less than `min_span_s`:
    a proxy's first few requests, sent back to back, are no evidence of a sustained rate)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = ARRIVAL_WINDOW_S,
                 min_span_s: float = ARRIVAL_MIN_SPAN_S):
        self._clock = clock
        self._window_s = window_s
        self._min_span_s = min_span_s
        self._arrivals_s: collections.deque[float] = collections.deque()
        self._first_s: Optional[float] = None

    def observe(self) -> None:
        now_s = self._clock()
        self._first_s = now_s if self._first_s is None else self._first_s
        self._arrivals_s.append(now_s)
        self._forget(now_s)

    def _forget(self, now_s: float) -> None:
        while self._arrivals_s and self._arrivals_s[0] < now_s - self._window_s:
            self._arrivals_s.popleft()

    @property
    def per_s(self) -> float:
        now_s = self._clock()
        self._forget(now_s)
        if self._first_s is None or len(self._arrivals_s) < 3:
            return len(self._arrivals_s) / self._window_s
        return len(self._arrivals_s) / max(self._min_span_s, min(self._window_s, now_s - self._first_s))


@dataclass(frozen=True, slots=True)
class Signals:
    """What the proxy knows of one request and its candidates when it decides."""

    num_prompt_tokens: int
    decode_cached_tokens: int  # the KV index's prediction for the chosen decode worker (0 if unknown)
    prefill_backlog_tokens: int  # prompt tokens in flight on the least-busy available prefill worker
    decode_backlog_tokens: int  # prompt tokens the chosen decode worker is computing itself now
    decode_running: int  # requests the chosen decode worker is serving
    decode_arrivals_per_s: float = 0.0  # requests expected to reach the chosen decode worker, per second


@dataclass(frozen=True, slots=True)
class Decision:
    where: str  # PREFILL (P/D) or DECODE (decode-only)
    reason: str
    ttft_prefill_s: Optional[float] = None
    ttft_decode_s: Optional[float] = None


def decide(signals: Signals, slo: Slo, prefill_s_per_token: Optional[float], decode_s_per_token: Optional[float],
           static_min_tokens: int, stall_tpots: float) -> Decision:
    """Where this request's prompt is computed (see the module docstring)."""
    uncached = max(0, signals.num_prompt_tokens - signals.decode_cached_tokens)
    if prefill_s_per_token is None:  # not measured yet: the static rule
        if uncached < static_min_tokens:
            return Decision(DECODE, "static_short")
        return Decision(PREFILL, "static")
    decode_rate = decode_s_per_token if decode_s_per_token is not None else prefill_s_per_token
    if uncached * decode_rate <= slo.tpot_s:
        return Decision(DECODE, "short")
    budget = slo.ttft_budget_s(signals.num_prompt_tokens)
    ttft_prefill = (signals.prefill_backlog_tokens + signals.num_prompt_tokens) * prefill_s_per_token
    ttft_decode = (signals.decode_backlog_tokens + uncached) * decode_rate
    if ttft_prefill <= budget:
        return Decision(PREFILL, "prefill_fits", ttft_prefill, ttft_decode)
    stall_s = uncached * decode_rate
    stays_idle = signals.decode_running == 0 and stall_s * signals.decode_arrivals_per_s < IDLE_STALL_ARRIVALS
    allowance = float("inf") if stays_idle else stall_tpots * slo.tpot_s
    if ttft_decode <= budget and stall_s <= allowance:
        return Decision(DECODE, "prefill_busy", ttft_prefill, ttft_decode)
    if ttft_decode < ttft_prefill and stays_idle:
        return Decision(DECODE, "best_effort", ttft_prefill, ttft_decode)
    return Decision(PREFILL, "best_effort", ttft_prefill, ttft_decode)
