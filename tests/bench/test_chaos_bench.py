"""bench.chaos still runs end to end (one kill of a decode worker mid-read): the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def test_chaos_benchmark_kills_once_and_writes_its_counts(tmp_path):
    out = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--victim", "decode", "--phase", "mid-read",
         "--kills", "1", "--load-threads", "1", "--num-decode", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    row = next(r for r in summary["table"] if r["phase"] == "mid-read")
    assert (row["victim"], row["kills"], row["prefill_deaths"], row["wrong"], row["hang"]) == ("decode", 1, 0, 0, 0)
    assert summary["kills"][0]["recovery_s"] > 0 and summary["failures"] == []
    assert "| decode | mid-read | 1 |" in result.stdout
