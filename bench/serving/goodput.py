"""SLO attainment and goodput (DistServe's definition) from the client's own request records.

Invariant: a request meets the SLO when it succeeded, its TTFT is within `ttft_ms +
ttft_ms_per_token * prompt tokens` and its TPOT (mean time per output token after the first)
within `tpot_ms`; a failed request misses it. The judging rule is the proxy's own
(`proxy.slo.judge`), applied to what the client measured. A system's goodput rate is the highest
request rate tried at which at least `target` of the requests met the SLO, every lower rate tried
included (a rate that only passes above a failing one is noise, not capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from bench.serving.client import RequestRecord
from bench.serving.stats import tpot_s, ttft_s
from proxy.routing.disaggregation import Slo
from proxy.slo import MET, judge

DEFAULT_SLO = Slo(ttft_ms=1000.0, ttft_ms_per_token=2.0, tpot_ms=20.0)  # issue 27's objective
TARGET_ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class Attainment:
    num_met: int
    num_requests: int
    num_ttft_missed: int
    num_tpot_missed: int
    num_failed: int

    @property
    def ratio(self) -> Optional[float]:
        return self.num_met / self.num_requests if self.num_requests else None


def attainment(records: Sequence[RequestRecord], slo: Slo) -> Attainment:
    met = ttft_missed = tpot_missed = failed = 0
    for record in records:
        if not record.ok:
            failed += 1
            continue
        result = judge(slo, record.num_prompt_tokens, ttft_s(record), tpot_s(record))
        met += result == MET
        ttft_missed += result == "ttft_missed"
        tpot_missed += result == "tpot_missed"
    return Attainment(met, len(records), ttft_missed, tpot_missed, failed)


def goodput_rate(points: Sequence[tuple[float, float]], target: float = TARGET_ATTAINMENT) -> Optional[float]:
    """The highest rate of (rate, attainment ratio) points meeting `target` with every lower rate
    meeting it too; None when even the lowest misses."""
    best = None
    for rate, ratio in sorted(points):
        if ratio < target:
            break
        best = rate
    return best
