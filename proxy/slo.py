"""SLO attainment as the proxy sees it: each streamed answer met or missed its TTFT and TPOT bounds.

Invariant: a request is judged once, when its stream ends, and only when both figures are
measurable at the proxy: streamed answers (TTFT is the first byte; TPOT is the mean gap between
the answer's events after the first, as a client reading the stream sees it). A non-streamed
answer arrives whole, so its time to first token is not observable here: it is not judged.
Attainment is the share of met requests among the last `window` judged ones, of which one client
(API key, else address) holds at most `MAX_CLIENT_SHARE`. Torch-free.
"""

from __future__ import annotations

import collections
import hashlib
from collections import deque
from typing import Optional

from prometheus_client import Counter, Gauge

from proxy.routing.disaggregation import Slo

MET, TTFT_MISSED, TPOT_MISSED = "met", "ttft_missed", "tpot_missed"
MAX_CLIENT_SHARE = 0.1  # of the window, per client: one client moves attainment by 10 points at most


def judge(slo: Slo, num_prompt_tokens: int, ttft_s: float, tpot_s: Optional[float]) -> str:
    """MET, or which bound was missed (TTFT first)."""
    if ttft_s > slo.ttft_budget_s(num_prompt_tokens):
        return TTFT_MISSED
    if tpot_s is not None and tpot_s > slo.tpot_s:
        return TPOT_MISSED
    return MET


def client_key(authorization: Optional[str], address: Optional[str]) -> str:
    """Who a request counts for in the window: its API key (a digest of it, never the key), else its
    client address; behind a gateway that hides addresses, the API key still tells clients apart."""
    if authorization:
        return "key:" + hashlib.blake2b(authorization.encode(), digest_size=8).hexdigest()
    return "addr:" + (address or "")


class SloTracker:
    """Judges requests and keeps the two metrics (`ProxyMetrics.slo_requests`, `.slo_attainment`).

    The window holds at most `max_client_share` of its entries per client (`client_key`): a client's
    request beyond that replaces that client's own oldest entry, so one client, however many requests
    it sends (met or missed on purpose), moves attainment by at most its share. The counter counts
    every judged request."""

    def __init__(self, slo: Slo, requests: Counter, attainment: Gauge, window: int = 200,
                 max_client_share: float = MAX_CLIENT_SHARE):
        self.slo = slo
        self._window = window
        self._max_per_client = max(1, int(window * max_client_share))
        self._recent: deque[tuple[str, bool]] = deque()  # (client, met), oldest first
        self._per_client: collections.Counter[str] = collections.Counter()
        self._requests = requests
        self._attainment = attainment

    def observe(self, num_prompt_tokens: int, ttft_s: float, tpot_s: Optional[float], client_key: str = "") -> str:
        result = judge(self.slo, num_prompt_tokens, ttft_s, tpot_s)
        self._requests.labels(result).inc()
        self._admit(client_key, result == MET)
        self._attainment.set(self.attainment)
        return result

    def _admit(self, client: str, met: bool) -> None:
        if self._per_client[client] >= self._max_per_client:
            self._drop_oldest_of(client)
        elif len(self._recent) >= self._window:
            oldest, _ = self._recent.popleft()
            self._forget(oldest)
        self._recent.append((client, met))
        self._per_client[client] += 1

    def _drop_oldest_of(self, client: str) -> None:
        for index, (owner, _) in enumerate(self._recent):
            if owner == client:
                del self._recent[index]
                self._forget(client)
                return

    def _forget(self, client: str) -> None:
        self._per_client[client] -= 1
        if self._per_client[client] == 0:
            del self._per_client[client]  # bounded by the window, not by every client ever seen

    @property
    def attainment(self) -> float:
        return sum(met for _, met in self._recent) / len(self._recent) if self._recent else 1.0
