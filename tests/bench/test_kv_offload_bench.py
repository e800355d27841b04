"""The offload load benchmark on tiny pages: every mode really loads the pages (the benchmark checks the
bytes after each), each tier is compared with its raw copy, and --loads-only writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.kv_offload.loads import BASELINE, MODES, load_bandwidth
from tests.integration.cluster import REPO_ROOT


def test_every_mode_is_timed_and_each_tier_has_its_share_of_the_raw_copy(tmp_path):
    result = load_bandwidth(page_bytes=4096, directory=str(tmp_path), rounds=3, pages_per_load=4)
    assert list(result["modes"]) == list(MODES)
    for mode, row in result["modes"].items():
        assert row["gb_per_s_p50"] > 0 and row["gb_per_s_total"] > 0
        if mode in BASELINE:
            raw = result["modes"][BASELINE[mode]]
            assert row["share_of_raw_p50"] == row["gb_per_s_p50"] / raw["gb_per_s_p50"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CRC32", "XXH3", "XXH3-disk", "XXH3-re-read"]  # raw files gone


def test_loads_only_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "loads.json"
    run = subprocess.run([sys.executable, "-m", "bench.kv_offload", "--loads-only", "--page-bytes", "8192",
                          "--load-rounds", "2", "--load-pages", "3", "--dir", str(tmp_path / "tier"),
                          "--load-out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "file tier, XXH3" in run.stdout and "of raw p50" in run.stdout
    document = json.loads(out.read_text())
    assert document["pages_per_load"] == 3 and set(document["modes"]) == set(MODES)


def test_the_workload_plot_draws_every_tier(tmp_path):
    from bench.lib.plots import plot_offload_ttft as plot_workload

    rows = [{"tier": tier, "computed_prompt_tokens": computed, "prompt_tokens": 8448, "ttft_p50_s": p50,
             "ttft_p99_s": 2 * p50, "tier_hit_rate": hits}
            for tier, computed, p50, hits in (("none", 8256, 0.5, 0.0), ("memory", 3456, 0.23, 0.57),
                                              ("file", 3456, 0.23, 0.57))]
    path = plot_workload(rows, str(tmp_path / "offload.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_repeats_pool_their_ttfts_and_load_bandwidth():
    from bench.kv_offload.cli import pooled

    runs = [{"tier": "memory", "computed_prompt_tokens": 10, "ttfts_s": [0.1, 0.5, 0.9], "later_turn_ttfts_s": [0.5],
             "load_bytes": 4e9, "load_s": 1.0},
            {"tier": "memory", "computed_prompt_tokens": 10, "ttfts_s": [0.2, 0.3, 0.4], "later_turn_ttfts_s": [0.3],
             "load_bytes": 2e9, "load_s": 2.0}]
    row = pooled(runs)
    assert row["ttfts_s"] == [0.1, 0.5, 0.9, 0.2, 0.3, 0.4]
    assert row["ttft_p50_s"] == 0.35  # the median of all six, not a mean of the two medians (0.4)
    assert row["later_turn_ttft_p50_s"] == 0.4
    assert row["load_gb_per_s"] == 2.0  # 6 GB in 3 s
    assert row["computed_prompt_tokens"] == 10

