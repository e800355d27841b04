"""bench.transfer.kv_pull --mode layout end to end on one small pull, on each device: it moves real pages
between two processes, verifies them, and records where the pools lived."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.cluster import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_kv_transfer_bench_pulls_verified_pages_on_the_chosen_device(device, tmp_path):
    out = tmp_path / "kv_transfer.json"
    command = [sys.executable, "-m", "bench.transfer.kv_pull", "--mode", "layout", "--device", device,
               "--memory", "4k-pages", "--reps", "1",
               "--prompt-tokens", "256", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    [pull] = report["pulls"]  # check_bytes raised inside the bench had a page landed wrong
    assert pull["memory"] == ("vram" if device == "cuda" else "4k-pages")
    assert pull["num_blocks"] == 16 and pull["page_pull_gbps"] > 0 and pull["memcpy_gbps"] > 0
    assert report["machine"]["device"] == "cpu" or device == "cuda"
    assert "--device" in report["command"]
