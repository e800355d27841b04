"""SIGTERM drains: a prefill worker with pinned blocks exits only after the decode
worker pulled them, and no client request fails; readiness turns false at once."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.integration.cluster import Worker, decode_leg, free_port, prefill_leg, start_workers, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "A short story about a lighthouse keeper:", "max_tokens": 12, "temperature": 0}


def test_prefill_drain_waits_for_pinned_blocks_to_be_pulled(tmp_path):
    prefill = Worker("prefill", free_port(), str(tmp_path / "prefill.log"), ["--num-blocks", "200", "--kv-lease-s", "60"])
    decode = Worker("decode", free_port(), str(tmp_path / "decode.log"), ["--num-blocks", "200", "--no-prefix-caching"])
    start_workers(prefill, decode)
    try:
        expected = httpx.post(decode.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
        params = prefill_leg(prefill, "/v1/completions", BODY, "drain-1").json()["kv_transfer_params"]
        assert prefill.metric("pdserve_transfer_pinned_blocks") > 0

        prefill.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(prefill.url + "/ready", timeout=2).status_code == 503, timeout_s=5)
        assert httpx.get(prefill.url + "/live", timeout=2).status_code == 200
        refused = prefill_leg(prefill, "/v1/completions", BODY, "drain-2")
        assert refused.status_code == 503  # new prefills go elsewhere
        time.sleep(1.0)
        assert prefill.process.poll() is None, "exited with blocks still pinned"

        response = decode_leg(decode, "/v1/completions", BODY, params, "drain-1")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        assert decode.metric("pdserve_transfer_failures_total") == 0
        prefill.process.wait(timeout=15)
        assert prefill.process.returncode == 0
    finally:
        prefill.kill()
        decode.kill()


def test_decode_drain_finishes_running_requests_then_exits(tmp_path):
    decode = Worker("decode", free_port(), str(tmp_path / "decode.log"), ["--num-blocks", "200"])
    start_workers(decode)
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", decode.url + "/v1/completions",
                               json={**BODY, "max_tokens": 48, "stream": True, "ignore_eos": True}) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                decode.process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        decode.process.wait(timeout=20)
        assert decode.process.returncode == 0
    finally:
        decode.kill()
