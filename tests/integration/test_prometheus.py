"""Debian's real Prometheus server scrapes a running prefill, decode and proxy on
127.0.0.1; the key series are read back through its HTTP API."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.integration.cluster import REPO_ROOT, Worker, free_port, start_workers, stop_all, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def start_proxy(port: int, prefill: Worker, decode: Worker, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pdserve.app.cli", "proxy", "--host", "127.0.0.1", "--port", str(port),
               "--prefill", prefill.url, "--decode", decode.url]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.Popen(command, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


def start_prometheus(tmp_path, targets: dict[str, str], port: int) -> subprocess.Popen:
    jobs = "\n".join(
        f"  - job_name: {name}\n    scrape_interval: 1s\n    static_configs:\n      - targets: ['{address}']"
        for name, address in targets.items()
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n{jobs}\n")
    command = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}"]
    return subprocess.Popen(command, stdout=open(tmp_path / "prometheus.log", "ab"), stderr=subprocess.STDOUT)


def query(port: int, promql: str) -> float:
    """Sum of the instant vector; NaN when empty or while Prometheus is not up yet."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": promql}, timeout=5)
    except httpx.HTTPError:
        return float("nan")
    if answer.status_code != 200:  # a starting Prometheus answers 503 "Service Unavailable" (not JSON)
        return float("nan")
    response = answer.json()
    result = response["data"]["result"]
    return sum(float(sample["value"][1]) for sample in result) if result else float("nan")


def test_prometheus_scrapes_workers_and_proxy(tmp_path):
    assert shutil.which("prometheus"), "Debian's prometheus package must be installed (.ci/run does it)"
    prefill = Worker("prefill", free_port(), str(tmp_path / "prefill.log"), ["--num-blocks", "200"])
    decode = Worker("decode", free_port(), str(tmp_path / "decode.log"), ["--num-blocks", "200"])
    start_workers(prefill, decode)
    proxy_port, prom_port = free_port(), free_port()
    proxy = start_proxy(proxy_port, prefill, decode, str(tmp_path / "proxy.log"))
    prometheus = None
    try:
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        assert wait_for(lambda: _ready(proxy_url), timeout_s=30)
        for index in range(3):
            response = httpx.post(proxy_url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"Tell me about the number {index}.", "max_tokens": 8, "temperature": 0})
            assert response.status_code == 200, response.text
        with httpx.stream("POST", proxy_url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Count: one, two,", "max_tokens": 8, "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert "data: [DONE]" in list(streamed.iter_lines())
        prometheus = start_prometheus(tmp_path, {
            "prefill": f"127.0.0.1:{prefill.port}", "decode": f"127.0.0.1:{decode.port}",
            "proxy": f"127.0.0.1:{proxy_port}"}, prom_port)
        assert wait_for(lambda: query(prom_port, 'sum(up{job=~"prefill|decode|proxy"})') == 3, timeout_s=30)
        assert wait_for(lambda: query(prom_port, 'pdserve_transfer_bytes_total{job="decode"}') > 0, timeout_s=15)
        assert query(prom_port, 'pdserve_transfer_descriptors_total{job="decode"}') >= 3
        assert query(prom_port, 'pdserve_request_time_to_first_token_seconds_count{job="decode"}') >= 3
        assert query(prom_port, 'pdserve_transfer_pinned_blocks{job="prefill"}') == 0
        assert query(prom_port, 'pdserve_proxy_requests_total{job="proxy"}') >= 4
        assert query(prom_port, 'pdserve_proxy_ttft_prefill_seconds_count{job="proxy"}') >= 1
        assert query(prom_port, 'pdserve_proxy_ttft_decode_first_token_seconds_count{job="proxy"}') >= 1
    finally:
        for process in (proxy, prometheus):
            if process is not None:
                process.terminate()
                process.wait(10)
        stop_all(prefill, decode)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
