"""bench.proxy still runs end to end (tiny sizes): stubs, two proxies, the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_proxy_benchmark_runs_and_writes_every_path(tmp_path):
    out = tmp_path / "proxy.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.proxy", "--requests", "20", "--warmup", "5",
         "--rounds", "2", "--duration-s", "0.5", "--concurrency", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    rows = {(row["path"], row["kind"]): row for row in summary["rows"]}
    paths = ("direct", "proxy (1 leg)", "proxy (P/D)", "proxy (P/D, kv_aware)")
    assert set(rows) == {(p, k) for p in paths for k in ("completion", "stream", "chat (6 turns)")}
    assert all(row["p50_ms"] > 0 for row in rows.values())
    assert rows[("proxy (P/D)", "completion")]["proxy_cpu_ms_per_request"] >= 0
    assert rows[("direct", "completion")]["max_requests_per_s"] > 0
    assert "proxy (P/D)" in result.stdout
    assert summary["proxy_overhead_histogram"]["proxy (P/D, kv_aware)"]  # its requests were kv-routed and timed
