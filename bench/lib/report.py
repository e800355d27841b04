"""Reports: the serving tables (throughput; latency mean, p50, p90, p99, max with the systems side by
side per metric), the serving JSON with every request's raw timings, and any benchmark's JSON file.

Invariant: a metric that was not measured prints as '-' and is null in the JSON,
never 0, so a missing number can not pass for a perfect one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Iterable, Optional, Sequence

from bench.lib.machine import machine_info
from bench.lib.stats import Distribution, RunSummary
from bench.lib.stream import RequestRecord


def cell(value: Optional[float], spec: str = ".2f", scale: float = 1.0, missing: str = "-") -> str:
    """A table cell: `value * scale` formatted by `spec` (".0%", ".1f", ...); `missing` when there is none."""
    return missing if value is None else format(value * scale, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned; cells as given."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def format_throughput_table(summaries: Sequence[RunSummary]) -> str:
    return markdown_table(
        ["system", "requests ok / failed", "duration (s)", "requests/s", "output tok/s", "total tok/s", "other CPU"],
        [(s.label, f"{s.num_requests - s.num_failed} / {s.num_failed}", f"{s.duration_s:.1f}",
          f"{s.request_throughput:.3f}", f"{s.output_throughput:.1f}", f"{s.total_token_throughput:.1f}",
          cell(s.foreign_cpu_fraction, ".0%")) for s in summaries])


def latency_rows(summary: RunSummary) -> list[tuple[str, Optional[Distribution]]]:
    """(metric name, distribution) in table order; per-class rows only when there are several classes."""
    rows: list[tuple[str, Optional[Distribution]]] = [("TTFT", summary.overall.ttft)]
    several = len(summary.by_class) > 1
    if several:
        rows += [(f"TTFT [{name}]", latency.ttft) for name, latency in summary.by_class.items()]
    rows += [("TPOT", summary.overall.tpot), ("ITL", summary.overall.itl)]
    if several:
        rows += [(f"ITL [{name}]", latency.itl) for name, latency in summary.by_class.items()]
    if summary.long_class is not None:
        rows += [
            (f"ITL of others while a [{summary.long_class}] prompt waits or prefills", summary.itl_during_long_prefill),
            ("ITL of others otherwise", summary.itl_outside_long_prefill),
        ]
    rows.append(("E2E", summary.overall.e2e))
    return rows


def format_latency_table(summaries: Sequence[RunSummary]) -> str:
    """Rows grouped by metric, one row per system, so systems compare line by line."""
    per_system = [dict(latency_rows(s)) for s in summaries]
    metric_names = list(dict.fromkeys(name for s in summaries for name, _ in latency_rows(s)))
    return markdown_table(["latency (ms)", "system", "mean", "p50", "p90", "p99", "max", "samples"], [
        (name, summary.label, *(cell(getattr(rows.get(name), k, None), ".1f", 1000)
                                for k in ("mean", "p50", "p90", "p99", "max")),
         rows[name].count if rows.get(name) is not None else 0)
        for name in metric_names for summary, rows in zip(summaries, per_system)])


def format_report(summaries: Sequence[RunSummary]) -> str:
    return format_throughput_table(summaries) + "\n\n" + format_latency_table(summaries)


def summary_dict(summary: RunSummary) -> dict:
    return asdict(summary) | {
        "request_throughput_per_s": summary.request_throughput,
        "output_tokens_per_s": summary.output_throughput,
        "total_tokens_per_s": summary.total_token_throughput,
    }


def write_json(path: str, command: str, workload: dict, runs: Sequence[tuple[RunSummary, Sequence[RequestRecord]]],
               extra: Optional[dict] = None) -> None:
    """One file: the command, machine, workload, each run's summary and its requests' raw timings."""
    report = {
        "command": command, "machine": machine_info(), "workload": workload,
        "runs": [summary_dict(summary) | {"requests": [asdict(r) for r in records]} for summary, records in runs],
    } | (extra or {})
    write_document(path, report)


def write_document(path: str, document: dict, indent: int = 1) -> None:
    """Any benchmark's JSON report, written whole or not at all."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    staging = path + ".partial"
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=indent)
        f.write("\n")
    os.replace(staging, path)  # a crash mid-write never leaves a truncated report behind
