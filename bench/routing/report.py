"""The routing benchmark's results: per-policy figures from the client and the workers' counters,
the table, the JSON and a bar chart of the prefill work.

Invariant: a figure that was not measured prints as '-' and is null in the
JSON, never 0; ratios are taken against the round_robin run of the same
invocation (same machine, same conversations), and a "+peer" policy's also
against the same policy without peer pulls (its off arm) of that invocation.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

from bench.lib.load import FIRST_TURN, LATER_TURN, LoadResult
from bench.lib.machine import machine_info
from bench.lib.report import cell, markdown_table, write_document
from bench.lib.stats import RunSummary, summarize_run

BASELINE = "round_robin"
PEER = "+peer"  # "<policy>+peer": the same policy with the proxy's peer hints (--peer-pull)
SUMMED = ("prompt_tokens", "computed_prefill_tokens", "computed_decode_tokens", "kv_bytes_pulled", "kv_events",
          "decode_only_turns", "peer_pulled_tokens")  # PolicyResult's counts: rounds add up


@dataclass
class PolicyResult:
    policy: str
    summary: RunSummary
    result: LoadResult
    prompt_tokens: int  # every successful turn's prompt, as the answers' usage counted it
    computed_prefill_tokens: float  # prompt tokens the prefill workers' models computed
    computed_decode_tokens: float  # ... and the decode workers' (the last token of each pulled prompt, or more)
    kv_bytes_pulled: float
    kv_events: float  # events the workers published (only while a kv_aware proxy subscribed)
    decode_only_turns: float  # turns the proxy served without a prefill leg
    prediction_error_tokens: Optional[float]  # kv_aware: sum of |reported - predicted| over checked answers
    peer_pulled_tokens: float = 0.0  # "+peer" runs: prompt tokens workers pulled from peers instead of computing

    @property
    def computed_tokens(self) -> float:
        return self.computed_prefill_tokens + self.computed_decode_tokens

    @property
    def num_ok(self) -> int:
        return self.summary.num_requests - self.summary.num_failed

    @property
    def cache_hit_rate(self) -> Optional[float]:
        """Share of prompt tokens no model had to compute (served from some prefix cache)."""
        return 1.0 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else None


def summarize(policy: str, result: LoadResult) -> RunSummary:
    return summarize_run(policy, result.records, result.duration_s)


def merge(rounds: Sequence[PolicyResult]) -> PolicyResult:
    """One policy's rounds as one result: counts summed, turns pooled (so are their percentiles),
    the other processes' CPU share averaged."""
    if len(rounds) == 1:
        return rounds[0]
    result = LoadResult([rec for r in rounds for rec in r.result.records], sum(r.result.duration_s for r in rounds))
    summary = summarize(rounds[0].policy, result)
    foreign = [r.summary.foreign_cpu_fraction for r in rounds if r.summary.foreign_cpu_fraction is not None]
    summary.foreign_cpu_fraction = sum(foreign) / len(foreign) if foreign else None
    errors = [r.prediction_error_tokens for r in rounds if r.prediction_error_tokens is not None]
    return replace(rounds[0], summary=summary, result=result, prediction_error_tokens=sum(errors) if errors else None,
                   **{name: sum(getattr(r, name) for r in rounds) for name in SUMMED})


def vs_off_arm(result: PolicyResult, results: Sequence[PolicyResult]) -> Optional[dict[str, Optional[float]]]:
    """A "+peer" policy's prompt tokens computed, TTFT p50 and p99 over its off arm's; None for other policies."""
    off = next((r for r in results if r.policy + PEER == result.policy), None)
    if off is None:
        return None
    pairs = {"computed_tokens": (result.computed_tokens, off.computed_tokens),
             **{f"ttft_{q}": (_ttft(result.summary, None, q), _ttft(off.summary, None, q)) for q in ("p50", "p99")}}
    return {name: on / off_value if on is not None and off_value else None for name, (on, off_value) in pairs.items()}


def _ttft(summary: RunSummary, class_name: Optional[str], attribute: str) -> Optional[float]:
    latency = summary.overall if class_name is None else summary.by_class.get(class_name)
    distribution = latency.ttft if latency is not None else None
    return getattr(distribution, attribute) if distribution is not None else None


def format_table(results: Sequence[PolicyResult]) -> str:
    baseline = next((r for r in results if r.policy == BASELINE), None)
    rows = []
    for r in results:
        ratio = f"{r.computed_tokens / baseline.computed_tokens:.2f}" if baseline and baseline.computed_tokens else "-"
        pulled = r.kv_bytes_pulled / r.num_ok / 1e6 if r.num_ok else None
        ttfts = [_ttft(r.summary, None, "p50"), _ttft(r.summary, None, "p99"), _ttft(r.summary, LATER_TURN, "p50")]
        rows.append((r.policy, f"{r.num_ok} / {r.summary.num_failed}", f"{r.prompt_tokens:,}", f"{r.computed_tokens:,.0f}",
                     ratio, cell(r.cache_hit_rate, ".0%"), *(cell(t, ".0f", 1000) for t in ttfts), cell(pulled, ".1f"),
                     f"{r.decode_only_turns:.0f}", f"{r.peer_pulled_tokens:,.0f}",
                     " / ".join(cell(v) for v in (vs_off_arm(r, results) or {None: None}).values()),
                     cell(r.summary.foreign_cpu_fraction, ".0%")))
    return markdown_table(["policy", "turns ok / failed", "prompt tokens", "prefill tokens computed", "vs round_robin",
                           "cache hit (tokens)", "TTFT p50 ms", "TTFT p99 ms", "TTFT p50 later turns ms",
                           "KV MB pulled / turn", "turns without prefill leg", "tokens pulled from peers",
                           "vs off arm: computed / TTFT p50 / p99", "other CPU"], rows)


def verdict(results: Sequence[PolicyResult]) -> list[str]:
    by_policy = {r.policy: r for r in results}
    kv, baseline = by_policy.get("kv_aware"), by_policy.get(BASELINE)
    peer = [f"{r.policy} against {r.policy.removesuffix(PEER)}: prompt tokens computed "
            f"{cell(ratios['computed_tokens'])}x, TTFT p50 {cell(ratios['ttft_p50'])}x, p99 {cell(ratios['ttft_p99'])}x ({r.peer_pulled_tokens:,.0f} "
            f"tokens pulled from peers)" for r in results if (ratios := vs_off_arm(r, results)) is not None]
    if kv is None or baseline is None or not baseline.computed_tokens:
        return [*peer, "kv_aware target not evaluated: needs both kv_aware and round_robin runs"]
    ratio = kv.computed_tokens / baseline.computed_tokens
    p50s = {r.policy: _ttft(r.summary, None, "p50") for r in results}
    best = min((p for p in p50s if p50s[p] is not None), key=lambda p: p50s[p])
    return [*peer, f"kv_aware computes {ratio:.2f}x the prefill tokens of round_robin (target <= 0.50): "
            f"{'met' if ratio <= 0.5 else 'NOT met'}",
            f"best TTFT p50: {best} ({cell(p50s[best], '.0f', 1000)} ms; target kv_aware): {'met' if best == 'kv_aware' else 'NOT met'}"]


def write_json(path: str, command: str, workload: dict, cluster: dict, results: Sequence[PolicyResult],
               extra: dict) -> None:
    document = {
        "benchmark": "routing", "command": command, "workload": workload, "cluster": cluster, **extra,
        "machine": machine_info(),
        "verdict": verdict(results),
        "policies": [{
            "policy": r.policy, "summary": asdict(r.summary), "prompt_tokens": r.prompt_tokens,
            "computed_prefill_tokens": r.computed_prefill_tokens, "computed_decode_tokens": r.computed_decode_tokens,
            "cache_hit_rate": r.cache_hit_rate, "kv_bytes_pulled": r.kv_bytes_pulled, "kv_events": r.kv_events,
            "decode_only_turns": r.decode_only_turns, "prediction_error_tokens": r.prediction_error_tokens,
            "peer_pulled_tokens": r.peer_pulled_tokens, "vs_off_arm": vs_off_arm(r, results),
            "turns": [{"class": rec.class_name, "sent_s": rec.sent_s, "first_token_s": rec.chunk_times_s[:1],
                       "done_s": rec.done_s, "prompt_tokens": rec.num_prompt_tokens,
                       "decode_cached_tokens": rec.cached_tokens, "error": rec.error}
                      for rec in r.result.records],
        } for r in results],
    }
    write_document(path, document)


def plot(results: Sequence[PolicyResult], out_dir: str) -> list[str]:
    """The serving benchmark's latency CDFs and histograms per policy, and the prefill work per policy."""
    from bench.lib.plots import plot_cdfs, plot_histograms, plt  # matplotlib only when plotting

    os.makedirs(out_dir, exist_ok=True)
    runs = [(r.summary, r.result.records) for r in results]
    paths = [os.path.join(out_dir, name) for name in ("latency_cdf.png", "latency_hist.png", "prefill_work.png")]
    plot_cdfs(runs, paths[0])
    plot_histograms(runs, paths[1])
    figure, axis = plt.subplots(figsize=(8, 4))
    names = [r.policy for r in results]
    axis.bar(names, [r.computed_prefill_tokens for r in results], label="on prefill workers")
    axis.bar(names, [r.computed_decode_tokens for r in results], bottom=[r.computed_prefill_tokens for r in results],
             label="on decode workers")
    axis.set(title=f"prompt tokens computed ({FIRST_TURN} + {LATER_TURN})", ylabel="tokens")
    axis.legend()
    figure.tight_layout()
    figure.savefig(paths[2], dpi=110)
    plt.close(figure)
    return paths
