"""Results of the engine benchmark: per-phase summaries, ratios, targets, table and JSON.

Invariant: a ratio always compares systems at the same concurrency, and a
system that failed to run shows up as a row with its reason, never as zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

from bench.lib.report import cell, markdown_table, write_document
from bench.lib.stats import percentile

SUBJECT = "pdserve"  # quantized weights: its default for a quantized GGUF
SUBJECT_FP32 = "pdserve --dtype float32"  # the exact mode
SUBJECT_COMPILED = "pdserve --compile"  # quantized, decode step compiled (opt-in on the CPU)
SUBJECTS = (SUBJECT, SUBJECT_FP32, SUBJECT_COMPILED)
LLAMA_SERVER = "llama-server"
LLAMA_BENCH = "llama-bench (raw decode)"  # no HTTP, one sequence: a bound, not a peer server
# The same without repacked weights: the layout llama-server runs where repacking crashes it.
LLAMA_BENCH_NO_REPACK = "llama-bench --repack 0 (raw decode)"
RAW_DECODE_SYSTEMS = (LLAMA_BENCH, LLAMA_BENCH_NO_REPACK)
GENERATE = "transformers generate"
SERVE = "transformers serve --continuous-batching"
SYSTEM_ORDER = (GENERATE, SERVE, LLAMA_BENCH, LLAMA_BENCH_NO_REPACK, LLAMA_SERVER, SUBJECT_FP32, SUBJECT,
                SUBJECT_COMPILED)

# (system, baseline, concurrency, required ratio, rate compared): issue 40's targets. "output" is
# output tokens over the phase's wall time (TTFT included); "decode" is one stream's token rate after its
# first token (1 / TPOT p50), what llama-bench's raw generation test measures (it has no prompt).
TARGETS = (
    (SUBJECT, LLAMA_SERVER, 1, 1.5, "output"),
    (SUBJECT, LLAMA_SERVER, 16, 2.5, "output"),
    (SUBJECT, LLAMA_BENCH, 1, 0.9, "decode"),
    (SUBJECT_FP32, GENERATE, 1, 1.5, "output"),
)


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
    dropped_connection: bool = False  # the error: the server closed a connection without answering

    @property
    def output_tokens_per_s(self) -> Optional[float]:
        if self.error is not None or self.wall_s <= 0:
            return None
        return self.num_output_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """One stream's rate after its first token: 1 / TPOT p50."""
        if self.error is not None or not self.tpot_p50_s:
            return None
        return 1.0 / self.tpot_p50_s


@dataclass(slots=True)
class LongPromptResult:
    """Time to first token of prompts of about `prompt_tokens` tokens, sent one at a time."""

    system: str
    prompt_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def ttft_median_s(self) -> Optional[float]:
        return percentile(self.ttft_s, 50)


@dataclass(slots=True)
class Roofline:
    """Ceilings from measured machine speed: bandwidth bounds c=1, matmul FLOP/s bounds c=16."""

    weight_bytes: int
    read_bandwidth_bytes_per_s: float
    matmul_params: int
    matmul_concurrency: int
    matmul_flops_per_s: float
    matvec_flops_per_s: float = 0.0
    quantized_weight_bytes: Optional[int] = None  # what one step reads when weights stay quantized

    @property
    def bandwidth_tokens_per_s(self) -> float:
        return self.read_bandwidth_bytes_per_s / self.weight_bytes

    @property
    def quantized_bandwidth_tokens_per_s(self) -> Optional[float]:
        if not self.quantized_weight_bytes:
            return None
        return self.read_bandwidth_bytes_per_s / self.quantized_weight_bytes

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


def summarize(system: str, concurrency: int, samples: Sequence[RequestSample], wall_s: float) -> PhaseResult:
    ttfts = [sample.ttft_s for sample in samples]
    tpots = [t for t in (sample.tpot_s for sample in samples) if t is not None]
    return PhaseResult(
        system=system, concurrency=concurrency, num_requests=len(samples),
        num_output_tokens=sum(sample.num_output_tokens for sample in samples), wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90), tpot_p50_s=percentile(tpots, 50),
    )


def best_peer(results: Iterable[PhaseResult], concurrency: int) -> Optional[PhaseResult]:
    peers = [r for r in results if r.system not in SUBJECTS and r.system not in RAW_DECODE_SYSTEMS
             and r.concurrency == concurrency and r.output_tokens_per_s]
    return max(peers, key=lambda r: r.output_tokens_per_s, default=None)


def ratio_vs_best_peer(results: Sequence[PhaseResult], result: PhaseResult) -> Optional[float]:
    best = best_peer(results, result.concurrency)
    if best is None or result.output_tokens_per_s is None:
        return None
    return result.output_tokens_per_s / best.output_tokens_per_s


def ratio(results: Sequence[PhaseResult], system: str, baseline: str, concurrency: int,
          rate: str = "output") -> Optional[float]:
    """Output (or "decode") tokens/s of `system` over `baseline` at one concurrency; None when either did
    not run."""
    rates = {r.system: r.decode_tokens_per_s if rate == "decode" else r.output_tokens_per_s
             for r in results if r.concurrency == concurrency}
    measured, base = rates.get(system), rates.get(baseline)
    return measured / base if measured and base else None


def check_targets(results: Sequence[PhaseResult]) -> list[TargetCheck]:
    return [TargetCheck(f"{system} c={c} {'decode ' if rate == 'decode' else ''}tokens/s vs {baseline}", required,
                        ratio(results, system, baseline, c, rate))
            for system, baseline, c, required, rate in TARGETS]


def format_table(results: Sequence[PhaseResult], roofline: Optional[Roofline] = None) -> str:
    """Markdown table, rows grouped by concurrency; also fine on a terminal."""
    rows = []
    for concurrency in sorted({r.concurrency for r in results}):
        for result in (r for r in results if r.concurrency == concurrency):
            if result.error is not None:
                rows.append((concurrency, result.system, f"not run: {result.error}", *["-"] * 4))
                continue
            vs_best = ratio_vs_best_peer(results, result)
            rows.append((concurrency, result.system, f"{result.output_tokens_per_s:.1f}",
                         cell(result.ttft_p50_s, ".0f", 1000), cell(result.tpot_p50_s, ".0f", 1000),
                         cell(vs_best, ".2f") + ("" if vs_best is None else "x"),
                         cell(result.foreign_cpu_fraction, ".0%")))
        rows += [(concurrency, name, f"{tokens_per_s:.1f}", *["-"] * 4)
                 for name, tokens_per_s in _ceilings(roofline, concurrency)]
    return markdown_table(["concurrency", "system", "output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "vs best peer",
                           "other CPU"], rows)


def _ceilings(roofline: Optional[Roofline], concurrency: int) -> list[tuple[str, float]]:
    if roofline is None:
        return []
    rows = []
    if concurrency == 1:
        rows.append(("ceiling: weight bytes / read bandwidth", roofline.bandwidth_tokens_per_s))
        if roofline.quantized_bandwidth_tokens_per_s is not None:
            rows.append(("ceiling: quantized weight bytes / read bandwidth", roofline.quantized_bandwidth_tokens_per_s))
        rows.append(("ceiling: measured matmul FLOP/s at M=1", roofline.matvec_tokens_per_s))
    if concurrency == roofline.matmul_concurrency:
        rows.append((f"ceiling: measured matmul FLOP/s at M={concurrency}", roofline.matmul_tokens_per_s))
    return rows


def format_long_prompts(results: Sequence[LongPromptResult]) -> str:
    """Markdown table of time to first token on long prompts, with the ratio to llama-server."""
    llama = next((r.ttft_median_s for r in results if r.system == LLAMA_SERVER), None)
    rows = []
    for result in sorted(results, key=lambda r: SYSTEM_ORDER.index(r.system) if r.system in SYSTEM_ORDER else 99):
        if result.error is not None or result.ttft_median_s is None:
            rows.append((result.system, result.prompt_tokens, f"not run: {result.error}", "-", "-"))
            continue
        rows.append((result.system, result.prompt_tokens, cell(result.ttft_median_s, ".0f", 1000),
                     ", ".join(f"{t * 1000:.0f}" for t in result.ttft_s),
                     "-" if llama is None else f"{llama / result.ttft_median_s:.2f}x"))
    return markdown_table(["system", "prompt tokens", "TTFT median (ms)", "runs (ms)", "vs llama-server"], rows)


def format_roofline(roofline: Roofline) -> str:
    quantized = ""
    if roofline.quantized_weight_bytes:
        quantized = (f"quantized weights read per step: {roofline.quantized_weight_bytes / 1e6:.0f} MB "
                     f"-> c=1 ceiling {roofline.quantized_bandwidth_tokens_per_s:.1f} tok/s; ")
    return quantized + (
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
        verdict = "not measured in this run" if check.measured_ratio is None else "met" if check.met else "MISSED"
        lines.append(f"target {check.name} >= {check.required_ratio:g}x: {measured} ({verdict})")
    return "\n".join(lines)


@dataclass(slots=True)
class BenchReport:
    command: str
    machine: dict
    workload: dict
    results: list[PhaseResult] = field(default_factory=list)
    roofline: Optional[Roofline] = None
    long_prompts: list[LongPromptResult] = field(default_factory=list)

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
                "quantized_bandwidth_tokens_per_s": self.roofline.quantized_bandwidth_tokens_per_s,
                "matmul_tokens_per_s": self.roofline.matmul_tokens_per_s,
                "matvec_tokens_per_s": self.roofline.matvec_tokens_per_s,
            }
        targets = [asdict(check) | {"met": check.met} for check in check_targets(self.results)]
        long_prompts = [asdict(r) | {"ttft_median_s": r.ttft_median_s} for r in self.long_prompts]
        return {"command": self.command, "machine": self.machine, "workload": self.workload,
                "results": rows, "roofline": roofline, "targets": targets, "long_prompt_ttft": long_prompts}


def write_json(report: BenchReport, path: str) -> None:
    write_document(path, report.to_dict(), indent=2)
