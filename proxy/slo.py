"""SLO attainment as the proxy sees it: each streamed answer met or missed its TTFT and TPOT bounds.

Invariant: a request is judged once, when its stream ends, and only when both figures are
measurable at the proxy: streamed answers (TTFT is the first byte; TPOT is the mean gap between
the answer's events after the first, as a client reading the stream sees it). A non-streamed
answer arrives whole, so its time to first token is not observable here: it is not judged.
Attainment is the share of met requests among the last `window` judged ones. Torch-free.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from prometheus_client import Counter, Gauge

from proxy.routing.disaggregation import Slo

MET, TTFT_MISSED, TPOT_MISSED = "met", "ttft_missed", "tpot_missed"


def judge(slo: Slo, num_prompt_tokens: int, ttft_s: float, tpot_s: Optional[float]) -> str:
    """MET, or which bound was missed (TTFT first)."""
    if ttft_s > slo.ttft_budget_s(num_prompt_tokens):
        return TTFT_MISSED
    if tpot_s is not None and tpot_s > slo.tpot_s:
        return TPOT_MISSED
    return MET


class SloTracker:
    """Judges requests and keeps the two metrics (`ProxyMetrics.slo_requests`, `.slo_attainment`)."""

    def __init__(self, slo: Slo, requests: Counter, attainment: Gauge, window: int = 200):
        self.slo = slo
        self._recent: deque[bool] = deque(maxlen=window)
        self._requests = requests
        self._attainment = attainment

    def observe(self, num_prompt_tokens: int, ttft_s: float, tpot_s: Optional[float]) -> str:
        result = judge(self.slo, num_prompt_tokens, ttft_s, tpot_s)
        self._requests.labels(result).inc()
        self._recent.append(result == MET)
        self._attainment.set(sum(self._recent) / len(self._recent))
        return result

    @property
    def attainment(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else 1.0
