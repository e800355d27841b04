"""Adaptive disaggregation with real processes (the embedded model, real NIXL, real HTTP): while the
prefill worker has a long prompt in hand, a short prompt is computed by the decode worker itself;
once the prefill worker is idle, the same prompt goes through it again. Every answer equals what
the decode worker gives for the prompt on its own (greedy): where a prompt is computed never changes
what is answered.

The order is forced, not raced: the prefill worker is frozen (SIGSTOP) with the long prompts in
flight, and the proxy polls health only at start here, so it still counts that worker available.
The SLO is chosen so that the decisions do not depend on the machine's speed: a TTFT budget of
5 ms per prompt token and a 1 ms TPOT. The proxy has timed three prefills, so it knows s, the
prefill worker's seconds per token. The long prompt (about 1,400 tokens) fits its 7 s budget on
the idle prefill worker for any s below 5 ms. Behind it, the short prompt (about 90 tokens) would
wait about 1,500 s there against a budget of 0.45 s: any s above 0.3 ms (3.3k tokens a second, ten
times what one CPU core does with this model, about 3 ms a token) sends it to the decode worker;
with nothing ahead, any s below 5 ms keeps it on P."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import pytest

from tests.integration.cluster import ProxyProcess, Worker, free_port, start_workers, stop_all, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "adaptive-token"
AUTH_HEADER = "X-Pdserve-Internal-Token"


def completion(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("adaptive")
    common = ["--internal-token", TOKEN, "--num-blocks", "800"]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), common, device)
    decode = Worker("decode", free_port(), str(logs / "decode.log"), common, device)
    start_workers(prefill, decode)
    proxy = ProxyProcess(free_port(), str(logs / "proxy.log"), [
        "--prefill", prefill.url, "--decode", decode.url, "--internal-token", TOKEN, "--health-interval-s", "3600",
        "--disaggregation", "adaptive", "--slo-ttft-ms", "0", "--slo-ttft-ms-per-token", "5", "--slo-tpot-ms", "1"])
    try:
        assert wait_for(proxy.is_ready, 60), "proxy never became ready"
        yield prefill, decode, proxy
    finally:
        stop_all(proxy, prefill, decode)


def direct(decode: Worker, body: dict) -> str:
    response = httpx.post(decode.url + "/v1/completions", json=body, headers={AUTH_HEADER: TOKEN}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def through(proxy: ProxyProcess, body: dict) -> str:
    response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def decisions(proxy: ProxyProcess, where: str) -> float:
    return proxy.metric("pdserve_proxy_disaggregation_decisions_total", where=where)


def test_a_short_prompt_moves_to_the_decode_worker_while_prefill_is_busy_and_back_when_idle(cluster):
    prefill, decode, proxy = cluster
    for index in range(3):  # distinct prompts: no prefix hit flatters the timing
        body = completion(f"Warm-up {index}: " + " ".join(f"item {index}-{i}" for i in range(80)))
        assert through(proxy, body) == direct(decode, body)
    assert decisions(proxy, "prefill") == 3 and decisions(proxy, "decode") == 0
    short = completion("Name three colours of the rainbow, then " + "count again " * 40)
    expected = direct(decode, short)
    os.kill(prefill.process.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = completion("Long document: " + " ".join(f"line {i}" for i in range(300)))  # ~1,400 tokens
            pending = pool.submit(through, proxy, long)
            assert wait_for(lambda: proxy.metric("pdserve_proxy_backend_in_flight_requests", role="prefill") == 1,
                            30, interval_s=0.02)
            assert decisions(proxy, "prefill") == 4  # the long prompt went to the (idle) prefill worker
            assert through(proxy, short) == expected  # computed by the decode worker meanwhile
            assert decisions(proxy, "decode") == 1
            os.kill(prefill.process.pid, signal.SIGCONT)
            answer = pending.result()
    finally:
        os.kill(prefill.process.pid, signal.SIGCONT)
    assert answer == direct(decode, long)
    assert through(proxy, short) == expected  # P is idle again: back to P/D
    assert decisions(proxy, "prefill") == 5 and decisions(proxy, "decode") == 1
