"""Every benchmark figure: latency CDFs, TTFT and ITL histograms, every inter-token gap over time with
the long prompts' prefill windows marked, SLO attainment against the request rate (serve), KV pull
bytes and time against the prompt length (transfer.kv_pull), and TTFT with and without the offload
tier (kv_offload). Each draws from the benchmark's own JSON report (or its records).

Invariant: all systems of a figure share its axes and bins, so curves compare
by eye; the non-interactive Agg backend is used, so plotting never needs a display.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: a benchmark box has no display
import matplotlib.pyplot as plt  # noqa: E402

from bench.lib.stream import RequestRecord  # noqa: E402
from bench.lib.stats import RunSummary, e2e_s, itl_gaps, prefill_windows, tpot_s, ttft_s  # noqa: E402

Run = tuple[RunSummary, Sequence[RequestRecord]]
_LINE_STYLES = ("-", "--", ":", "-.")


def _ok(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.ok]


def _ttfts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [ttft_s(r) * 1000 for r in _ok(records)]


def _gaps_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [(end - start) * 1000 for r in _ok(records) for start, end in itl_gaps(r)]


def _cdf(axis, values_ms: Sequence[float], label: str, color: str, style: str = "-") -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axis.step(ordered, fractions, where="post", label=label, color=color, linestyle=style)


def _colors(num_runs: int) -> list[str]:
    return [f"C{i}" for i in range(num_runs)]


def _ttft_cdf(axis, runs: Sequence[Run]) -> None:
    for (summary, records), color in zip(runs, _colors(len(runs))):
        classes = sorted({r.class_name for r in records})
        if len(classes) == 1:
            _cdf(axis, [ttft_s(r) * 1000 for r in _ok(records)], summary.label, color)
            continue
        for name, style in zip(classes, _LINE_STYLES):
            values = [ttft_s(r) * 1000 for r in _ok(records) if r.class_name == name]
            _cdf(axis, values, f"{summary.label} [{name}]", color, style)
    axis.set(title="TTFT", xlabel="ms", ylabel="fraction of requests")


def plot_cdfs(runs: Sequence[Run], path: str) -> None:
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    _ttft_cdf(axes[0][0], runs)
    for (summary, records), color in zip(runs, _colors(len(runs))):
        _cdf(axes[0][1], _gaps_ms(records), summary.label, color)
        tpots = [t * 1000 for t in (tpot_s(r) for r in _ok(records)) if t is not None]
        _cdf(axes[1][0], tpots, summary.label, color)
        _cdf(axes[1][1], [e2e_s(r) * 1000 for r in _ok(records)], summary.label, color)
    axes[0][1].set(title="inter-token latency (every gap)", xlabel="ms (log)", ylabel="fraction of gaps", xscale="log")
    axes[1][0].set(title="TPOT (per request)", xlabel="ms", ylabel="fraction of requests")
    axes[1][1].set(title="end-to-end latency", xlabel="ms", ylabel="fraction of requests")
    for axis in axes.flat:
        axis.grid(True, alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    _save(figure, path)


def _log_bins(values: Sequence[float], num_bins: int = 40) -> list[float]:
    low, high = max(min(values), 1e-3), max(max(values), 1e-3)
    if math.isclose(low, high):
        high = low * 2
    step = (math.log10(high) - math.log10(low)) / num_bins
    return [10 ** (math.log10(low) + i * step) for i in range(num_bins + 1)]


def plot_histograms(runs: Sequence[Run], path: str) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    panels = ((axes[0], "TTFT", _ttfts_ms), (axes[1], "inter-token latency", _gaps_ms))
    for axis, title, values_of in panels:
        every = [v for _, records in runs for v in values_of(records)]
        if every:
            bins = _log_bins(every)
            for (summary, records), color in zip(runs, _colors(len(runs))):
                axis.hist(values_of(records), bins=bins, histtype="step", color=color, label=summary.label,
                          linewidth=1.5)
            axis.legend(fontsize=8)
        axis.set(title=title, xlabel="ms (log)", ylabel="count", xscale="log")
        axis.grid(True, alpha=0.3)
    _save(figure, path)


def _timeline_panel(axis, summary: RunSummary, records: Sequence[RequestRecord], color: str) -> None:
    long_class = summary.long_class
    for start_s, end_s in prefill_windows(records, long_class) if long_class else ():
        axis.axvspan(start_s, end_s, color="orange", alpha=0.15, linewidth=0)
    for name, marker in zip(sorted({r.class_name for r in records}), ("o", "s", "^", "D")):
        gaps = [(end, (end - start) * 1000) for r in _ok(records) if r.class_name == name for start, end in itl_gaps(r)]
        if gaps:  # the long requests' own gaps in grey: the question is what happens to the others
            axis.scatter([g[0] for g in gaps], [g[1] for g in gaps], s=5, marker=marker, alpha=0.6,
                         color="grey" if name == long_class else color, label=f"gaps of [{name}]")
    arrivals = [r.sent_s for r in records if r.class_name == long_class]
    if arrivals:
        axis.plot(arrivals, [1.0] * len(arrivals), linestyle="none", marker="v", color="red", markersize=8,
                  transform=axis.get_xaxis_transform(), clip_on=False, label=f"[{long_class}] arrives")
    axis.set(title=summary.label, ylabel="gap (ms, log)", yscale="log")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="upper right")


def plot_itl_timeline(runs: Sequence[Run], path: str) -> None:
    figure, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), sharex=True, sharey=True, squeeze=False)
    for (summary, records), axis, color in zip(runs, axes[:, 0], _colors(len(runs))):
        _timeline_panel(axis, summary, records, color)
    axes[-1][0].set_xlabel("time since the run started (s); shaded: a long prompt waits or prefills")
    _save(figure, path)


def _save(figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_all(runs: Sequence[Run], out_dir: str, prefix: Optional[str] = None) -> list[str]:
    """Writes every figure into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = f"{prefix}_" if prefix else ""
    paths = [os.path.join(out_dir, f"{stem}{name}.png") for name in ("latency_cdf", "latency_hist", "itl_timeline")]
    plot_cdfs(runs, paths[0])
    plot_histograms(runs, paths[1])
    plot_itl_timeline(runs, paths[2])
    return paths


def plot_attainment(table: dict[str, list[tuple[float, float]]], slo, out_dir: str,
                    file_name: str = "goodput_attainment.png") -> str:
    """SLO attainment against the request rate, one line per system, the 90% target marked."""
    os.makedirs(out_dir, exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, (name, points) in enumerate(table.items()):
        rates, ratios = zip(*sorted(points))
        axis.plot(rates, [r * 100 for r in ratios], _LINE_STYLES[index % len(_LINE_STYLES)], marker="o", label=name)
    axis.axhline(90, color="grey", linewidth=0.8)
    axis.set_xlabel("request rate (requests/s, Poisson)")
    axis.set_ylabel("requests meeting the SLO (%)")
    axis.set_title(f"SLO attainment: TTFT <= {slo.ttft_ms:g} ms + {slo.ttft_ms_per_token:g} ms/token, "
                   f"TPOT <= {slo.tpot_ms:g} ms", fontsize=9)
    axis.set_ylim(0, 105)
    axis.legend(fontsize=8)
    path = os.path.join(out_dir, file_name)
    _save(figure, path)
    return path


def plot_kv_pull(report: dict, path: str) -> str:
    """`transfer.kv_pull --mode layout`: bytes a pull moves, and how long it takes against a memcpy
    of the same bytes, per memory mode, against the prompt length."""
    figure, (bytes_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for index, memory in enumerate(dict.fromkeys(row["memory"] for row in report["pulls"])):
        rows = sorted((r for r in report["pulls"] if r["memory"] == memory), key=lambda r: r["prompt_tokens"])
        tokens = [r["prompt_tokens"] for r in rows]
        if index == 0:
            bytes_axis.plot(tokens, [r["num_bytes"] / 1e6 for r in rows], marker="o", label=report["shape"]["label"])
        series = [("page_pull_s", "NIXL pull, a descriptor per page"), ("piece_pull_s", "NIXL pull, per (layer, K|V)"),
                  ("memcpy_s", "memcpy")]
        for (key, label), style in zip(series, _LINE_STYLES):
            if rows and rows[0].get(key) is not None:
                time_axis.plot(tokens, [r[key] * 1000 for r in rows], style, marker="o", color=f"C{index}",
                               label=f"{label} ({memory})")
    bytes_axis.set(title="KV bytes one pull moves", xlabel="prompt tokens", ylabel="MB")
    time_axis.set(title="time of one pull", xlabel="prompt tokens", ylabel="ms")
    for axis in (bytes_axis, time_axis):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(report.get("source", report.get("command", "")), fontsize=7)
    _save(figure, path)
    return path


def plot_offload_ttft(rows: list[dict], path: str) -> str:
    """`kv_offload`: per tier configuration (none, memory, file), prompt tokens computed, TTFT p50 and p99
    (with and without the tier), and the tier's hit rate; `rows` are its report's."""
    tiers = [row["tier"] for row in rows]
    positions = range(len(tiers))
    figure, (computed, ttft, hits) = plt.subplots(1, 3, figsize=(12, 3.6))
    computed.bar(positions, [row["computed_prompt_tokens"] for row in rows], color="tab:blue")
    computed.axhline(rows[0]["prompt_tokens"], color="grey", linestyle="--", label="prompt tokens asked for")
    computed.set_title("prompt tokens computed")
    computed.legend(loc="lower left", fontsize="small")
    width = 0.4
    ttft.bar([p - width / 2 for p in positions], [row["ttft_p50_s"] * 1000 for row in rows], width, label="p50")
    ttft.bar([p + width / 2 for p in positions], [row["ttft_p99_s"] * 1000 for row in rows], width, label="p99")
    ttft.set_title("TTFT (ms)")
    ttft.legend(fontsize="small")
    hits.bar(positions, [row["tier_hit_rate"] for row in rows], color="tab:green")
    hits.set_ylim(0, 1)
    hits.set_title("tier hit rate (tokens loaded / asked for)")
    for axes in (computed, ttft, hits):
        axes.set_xticks(list(positions), tiers)
    _save(figure, path)
    return path
