"""The KV offload workload's figure (bench/kv_offload.py --plot): per tier configuration, prompt tokens
computed, TTFT p50 and p99, and the tier's hit rate, side by side in one PNG."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot: a benchmark box has no display
import matplotlib.pyplot as plt  # noqa: E402


def plot_workload(rows: list[dict], path: str) -> str:
    """Write the figure of `rows` (run_workload's, one per tier) to `path`; returns it."""
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
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
