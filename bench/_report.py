"""Results of the engine benchmark: per-phase summaries, ratios, targets, table and JSON.

Invariant: a ratio always compares systems at the same concurrency, and a
system that failed to run shows up as a row with its reason, never as zero.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

SUBJECT = "pdserve"
TARGET_C1_VS_GENERATE = 1.0  # at concurrency 1: at least as fast as `transformers generate`
TARGET_C16_VS_BEST_PEER = 2.5  # at concurrency 16: at least 2.5x the better peer


@dataclass(slots=True)
class RequestSample:
    """One request as the client saw it."""

    ttft_s: float
    e2e_s: float
    num_output_tokens: int

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first; None for one-token answers, and where TTFT
        came from a separate run (`generate`) that noise made slower than the whole answer."""
        if self.num_output_tokens < 2 or self.e2e_s < self.ttft_s:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class PhaseResult:
    """One system at one concurrency: throughput over the phase's wall time."""

    system: str
    concurrency: int
    num_requests: int = 0
    num_output_tokens: int = 0
    wall_s: float = 0.0
    ttft_p50_s: Optional[float] = None
    ttft_p90_s: Optional[float] = None
    tpot_p50_s: Optional[float] = None
    foreign_cpu_fraction: Optional[float] = None  # share of all cores other processes took meanwhile
    num_attempts: int = 1  # a phase on a busy machine runs again; the quieter attempt is kept
    error: Optional[str] = None

    @property
    def output_tokens_per_s(self) -> Optional[float]:
        if self.error is not None or self.wall_s <= 0:
            return None
        return self.num_output_tokens / self.wall_s


@dataclass(slots=True)
class Roofline:
    """Ceilings from measured machine speed: bandwidth bounds c=1, matmul FLOP/s bounds c=16."""

    weight_bytes: int
    read_bandwidth_bytes_per_s: float
    matmul_params: int
    matmul_concurrency: int
    matmul_flops_per_s: float
    matvec_flops_per_s: float = 0.0

    @property
    def bandwidth_tokens_per_s(self) -> float:
        return self.read_bandwidth_bytes_per_s / self.weight_bytes

    @property
    def matmul_tokens_per_s(self) -> float:
        return self.matmul_flops_per_s / (2 * self.matmul_params)

    @property
    def matvec_tokens_per_s(self) -> float:
        """What the matmul kernels reach at one token per step; below the bandwidth ceiling when
        the BLAS streams a matrix-vector product on fewer cores than the memory needs."""
        return self.matvec_flops_per_s / (2 * self.matmul_params)


@dataclass(slots=True)
class TargetCheck:
    name: str
    required_ratio: float
    measured_ratio: Optional[float]

    @property
    def met(self) -> bool:
        return self.measured_ratio is not None and self.measured_ratio >= self.required_ratio


def percentile(values: Sequence[float], fraction: float) -> Optional[float]:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(system: str, concurrency: int, samples: Sequence[RequestSample], wall_s: float) -> PhaseResult:
    ttfts = [sample.ttft_s for sample in samples]
    tpots = [t for t in (sample.tpot_s for sample in samples) if t is not None]
    return PhaseResult(
        system=system, concurrency=concurrency, num_requests=len(samples),
        num_output_tokens=sum(sample.num_output_tokens for sample in samples), wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p90_s=percentile(ttfts, 0.9), tpot_p50_s=percentile(tpots, 0.5),
    )


def best_peer(results: Iterable[PhaseResult], concurrency: int) -> Optional[PhaseResult]:
    peers = [r for r in results if r.system != SUBJECT and r.concurrency == concurrency and r.output_tokens_per_s]
    return max(peers, key=lambda r: r.output_tokens_per_s, default=None)


def ratio_vs_best_peer(results: Sequence[PhaseResult], result: PhaseResult) -> Optional[float]:
    best = best_peer(results, result.concurrency)
    if best is None or result.output_tokens_per_s is None:
        return None
    return result.output_tokens_per_s / best.output_tokens_per_s


def _throughput(results: Sequence[PhaseResult], system_prefix: str, concurrency: int) -> Optional[float]:
    for result in results:
        if result.system.startswith(system_prefix) and result.concurrency == concurrency:
            return result.output_tokens_per_s
    return None


def check_targets(results: Sequence[PhaseResult]) -> list[TargetCheck]:
    subject_c1 = _throughput(results, SUBJECT, 1)
    generate_c1 = _throughput(results, "transformers generate", 1)
    c1_ratio = subject_c1 / generate_c1 if subject_c1 and generate_c1 else None
    subject_c16 = next((r for r in results if r.system == SUBJECT and r.concurrency == 16), None)
    c16_ratio = ratio_vs_best_peer(results, subject_c16) if subject_c16 else None
    return [
        TargetCheck("c=1 tokens/s vs transformers generate", TARGET_C1_VS_GENERATE, c1_ratio),
        TargetCheck("c=16 tokens/s vs best peer", TARGET_C16_VS_BEST_PEER, c16_ratio),
    ]


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_table(results: Sequence[PhaseResult], roofline: Optional[Roofline] = None) -> str:
    """Markdown table, rows grouped by concurrency; also fine on a terminal."""
    header = "| concurrency | system | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | vs best peer | other CPU |"
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|"]
    for concurrency in sorted({r.concurrency for r in results}):
        for result in (r for r in results if r.concurrency == concurrency):
            if result.error is not None:
                lines.append(f"| {concurrency} | {result.system} | not run: {result.error} | - | - | - | - |")
                continue
            ratio = ratio_vs_best_peer(results, result)
            lines.append(
                f"| {concurrency} | {result.system} | {result.output_tokens_per_s:.1f} | {_ms(result.ttft_p50_s)} "
                f"| {_ms(result.tpot_p50_s)} | {'-' if ratio is None else f'{ratio:.2f}x'} "
                f"| {_percent(result.foreign_cpu_fraction)} |"
            )
        lines += _ceiling_rows(roofline, concurrency)
    return "\n".join(lines)


def _ceiling_rows(roofline: Optional[Roofline], concurrency: int) -> list[str]:
    if roofline is None:
        return []
    rows = []
    if concurrency == 1:
        rows.append(("ceiling: weight bytes / read bandwidth", roofline.bandwidth_tokens_per_s))
        rows.append(("ceiling: measured matmul FLOP/s at M=1", roofline.matvec_tokens_per_s))
    if concurrency == roofline.matmul_concurrency:
        rows.append((f"ceiling: measured matmul FLOP/s at M={concurrency}", roofline.matmul_tokens_per_s))
    return [f"| {concurrency} | {name} | {tokens_per_s:.1f} | - | - | - | - |" for name, tokens_per_s in rows]


def format_roofline(roofline: Roofline) -> str:
    return (
        f"weights read per decode step: {roofline.weight_bytes / 1e6:.0f} MB; "
        f"read bandwidth: {roofline.read_bandwidth_bytes_per_s / 1e9:.1f} GB/s "
        f"-> c=1 ceiling {roofline.bandwidth_tokens_per_s:.1f} tok/s; "
        f"matmul at M={roofline.matmul_concurrency}: {roofline.matmul_flops_per_s / 1e9:.1f} GFLOP/s over "
        f"{roofline.matmul_params / 1e6:.1f} M params -> ceiling {roofline.matmul_tokens_per_s:.1f} tok/s; "
        f"matmul at M=1: {roofline.matvec_flops_per_s / 1e9:.1f} GFLOP/s -> {roofline.matvec_tokens_per_s:.1f} tok/s"
    )


def format_targets(checks: Sequence[TargetCheck]) -> str:
    lines = []
    for check in checks:
        measured = "n/a" if check.measured_ratio is None else f"{check.measured_ratio:.2f}x"
        verdict = "met" if check.met else "MISSED"
        lines.append(f"target {check.name} >= {check.required_ratio:g}x: {measured} ({verdict})")
    return "\n".join(lines)


@dataclass(slots=True)
class BenchReport:
    command: str
    machine: dict
    workload: dict
    results: list[PhaseResult] = field(default_factory=list)
    roofline: Optional[Roofline] = None

    def to_dict(self) -> dict:
        rows = []
        for result in self.results:
            row = asdict(result)
            row["output_tokens_per_s"] = result.output_tokens_per_s
            row["ratio_vs_best_peer"] = ratio_vs_best_peer(self.results, result)
            rows.append(row)
        roofline = None
        if self.roofline is not None:
            roofline = asdict(self.roofline) | {
                "bandwidth_tokens_per_s": self.roofline.bandwidth_tokens_per_s,
                "matmul_tokens_per_s": self.roofline.matmul_tokens_per_s,
                "matvec_tokens_per_s": self.roofline.matvec_tokens_per_s,
            }
        targets = [asdict(check) | {"met": check.met} for check in check_targets(self.results)]
        return {"command": self.command, "machine": self.machine, "workload": self.workload,
                "results": rows, "roofline": roofline, "targets": targets}


def write_json(report: BenchReport, path: str) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2)
        f.write("\n")
