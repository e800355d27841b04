"""Metrics from request records: the one percentile helper, TTFT, TPOT, inter-token gaps, end-to-end,
throughput, inter-token gaps split by whether a long prompt was being prefilled meanwhile, and SLO
attainment and goodput (DistServe's definition, judged by the proxy's own rule `proxy.slo.judge`).

Invariant: only successful requests feed latency statistics (a failed request
is counted, never averaged in as a fast one), and every gap is measured between
two chunks of the same request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from bench.lib.stream import RequestRecord
from proxy.routing.disaggregation import Slo
from proxy.slo import MET, judge

PERCENTILES = (50, 90, 99)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> Optional[float]:
    """The q-quantile (0-1) of a Prometheus histogram from its cumulative (upper edge, count) buckets, the
    last one +Inf: linear within the bucket the rank falls in, as PromQL's histogram_quantile; None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    below_edge, below_count = 0.0, 0.0
    for edge, count in buckets:
        if count >= rank and count > below_count:
            if math.isinf(edge):
                return below_edge  # past the last finite edge: all that can be said
            return below_edge + (edge - below_edge) * (rank - below_count) / (count - below_count)
        below_edge, below_count = edge, count
    return below_edge


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@dataclass(slots=True)
class Distribution:
    """Summary of one latency in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def describe(values: Sequence[float]) -> Optional[Distribution]:
    if not values:
        return None
    return Distribution(len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 90),
                        percentile(values, 99), max(values))


def ttft_s(record: RequestRecord) -> float:
    return record.chunk_times_s[0] - record.sent_s


def e2e_s(record: RequestRecord) -> float:
    return record.done_s - record.sent_s


def tpot_s(record: RequestRecord) -> Optional[float]:
    """Mean time per output token after the first: (e2e - ttft) / (tokens - 1); None for one token."""
    if record.num_output_tokens < 2:
        return None
    return (e2e_s(record) - ttft_s(record)) / (record.num_output_tokens - 1)


def itl_gaps(record: RequestRecord) -> list[tuple[float, float]]:
    """(start_s, end_s) of every wait between two consecutive chunks of one request."""
    times = record.chunk_times_s
    return list(zip(times, times[1:]))


def prefill_windows(records: Sequence[RequestRecord], class_name: str) -> list[tuple[float, float]]:
    """(sent_s, first token) of every request of `class_name`: while its prompt waits and is prefilled."""
    return [(r.sent_s, r.chunk_times_s[0]) for r in records if r.class_name == class_name and r.ok]


def _overlaps(gap: tuple[float, float], windows: Sequence[tuple[float, float]]) -> bool:
    return any(gap[0] < end and start < gap[1] for start, end in windows)


def split_gaps_by_windows(records: Sequence[RequestRecord], windows: Sequence[tuple[float, float]],
                          exclude_class: Optional[str] = None) -> tuple[list[float], list[float]]:
    """Gap lengths of requests not of `exclude_class`, split into (overlapping a window, not overlapping)."""
    during, outside = [], []
    for record in records:
        if not record.ok or record.class_name == exclude_class:
            continue
        for gap in itl_gaps(record):
            (during if _overlaps(gap, windows) else outside).append(gap[1] - gap[0])
    return during, outside


@dataclass(slots=True)
class LatencySet:
    """TTFT, TPOT, inter-token and end-to-end latency of a set of requests."""

    num_requests: int
    ttft: Optional[Distribution]
    tpot: Optional[Distribution]
    itl: Optional[Distribution]
    e2e: Optional[Distribution]


def latency_set(records: Sequence[RequestRecord]) -> LatencySet:
    ok = [r for r in records if r.ok]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    gaps = [end - start for r in ok for start, end in itl_gaps(r)]
    return LatencySet(len(ok), describe([ttft_s(r) for r in ok]), describe(tpots), describe(gaps),
                      describe([e2e_s(r) for r in ok]))


@dataclass(slots=True)
class RunSummary:
    """Everything the table and the JSON report about one system's run."""

    label: str
    duration_s: float
    num_requests: int
    num_failed: int
    num_input_tokens: int
    num_output_tokens: int
    overall: LatencySet
    by_class: dict[str, LatencySet] = field(default_factory=dict)
    long_class: Optional[str] = None
    itl_during_long_prefill: Optional[Distribution] = None
    itl_outside_long_prefill: Optional[Distribution] = None
    foreign_cpu_fraction: Optional[float] = None  # share of all cores other processes used meanwhile
    # The proxy's handoff components over the run: component -> {"n", "p50_ms", "p99_ms"} (P/D only).
    handoff_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def request_throughput(self) -> float:
        return (self.num_requests - self.num_failed) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        tokens = self.num_input_tokens + self.num_output_tokens
        return tokens / self.duration_s if self.duration_s > 0 else 0.0


def summarize_run(label: str, records: Sequence[RequestRecord], duration_s: float,
                  long_class: Optional[str] = None) -> RunSummary:
    """Throughput counts successful requests only; gaps of long requests themselves stay out of the
    during/outside split, which asks how a long prefill treats *other* requests' streams."""
    ok = [r for r in records if r.ok]
    summary = RunSummary(
        label=label, duration_s=duration_s, num_requests=len(records), num_failed=len(records) - len(ok),
        num_input_tokens=sum(r.num_prompt_tokens for r in ok), num_output_tokens=sum(r.num_output_tokens for r in ok),
        overall=latency_set(records), long_class=long_class,
    )
    for name in sorted({r.class_name for r in records}):
        summary.by_class[name] = latency_set([r for r in records if r.class_name == name])
    if long_class is not None:
        during, outside = split_gaps_by_windows(records, prefill_windows(records, long_class), long_class)
        summary.itl_during_long_prefill = describe(during)
        summary.itl_outside_long_prefill = describe(outside)
    return summary


# ---- SLO attainment and goodput: a failed request misses the SLO; a system's goodput rate is the
# highest rate tried at which at least `target` met it, every lower rate included.

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


# ---- An MLPerf-style run constraint: a run passes when the p99 TTFT and the p99 TPOT over all its
# requests meet fixed bounds (MLPerf Inference's server and interactive scenarios); a failed request
# counts as infinitely late, so more than 1% failed fails the run.

@dataclass(frozen=True, slots=True)
class TailBound:
    ttft_ms: float
    tpot_ms: float
    quantile: float = 99.0


@dataclass(frozen=True, slots=True)
class TailCheck:
    ttft_ms: float  # the run's TTFT at the bound's quantile (inf: too many failed)
    tpot_ms: float
    passed: bool


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank (no interpolation, so infinite values stay meaningful)."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def tail_check(records: Sequence[RequestRecord], bound: TailBound) -> TailCheck:
    ttfts_ms = [ttft_s(r) * 1000 if r.ok else math.inf for r in records]
    tpots_ms = [(tpot_s(r) or 0.0) * 1000 if r.ok else math.inf for r in records]
    ttft_ms, tpot_ms = nearest_rank(ttfts_ms, bound.quantile), nearest_rank(tpots_ms, bound.quantile)
    return TailCheck(ttft_ms, tpot_ms, ttft_ms <= bound.ttft_ms and tpot_ms <= bound.tpot_ms)
