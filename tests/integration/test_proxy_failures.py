"""The proxy in front of real workers that die: two prefill workers + one decode (policy `fail`)
+ `pdserve proxy`, all real processes. A killed prefill worker costs no client request; a killed
decode worker gives quick 503s with Retry-After, and serving resumes when it is back."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.cluster import ProxyProcess, Worker, free_port, start_workers, stop_all, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "proxy-test-token"
BODY = {"model": MODEL, "prompt": "Once upon a time in a small village by the sea, there lived",
        "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "300", "--internal-token", TOKEN]
    prefills = [Worker("prefill", free_port(), str(logs / f"prefill{i}.log"), [*common, "--kv-lease-s", "10"])
                for i in range(2)]
    decode = Worker("decode", free_port(), str(logs / "decode.log"),
                    [*common, "--kv-failure-policy", "fail", "--kv-pull-timeout-s", "5"])
    workers = start_workers(*prefills, decode)
    proxy = ProxyProcess(free_port(), str(logs / "proxy.log"), [
        "--prefill", *(p.url for p in prefills), "--decode", decode.url, "--internal-token", TOKEN,
        "--policy", "round_robin", "--health-interval-s", "0.25", "--breaker-failures", "2",
        "--breaker-cooldown-s", "2", "--retry-after-s", "1"])
    state = {"prefills": prefills, "decode": decode, "proxy": proxy}
    try:
        assert wait_for(lambda: _ready(proxy), 30), "proxy never became ready"
        yield state
    finally:
        stop_all(proxy, *workers, state["decode"])


def _ready(proxy: ProxyProcess) -> bool:
    try:
        return httpx.get(proxy.url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def expected_text(decode: Worker) -> str:
    response = httpx.post(decode.url + "/v1/completions", json=BODY, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class ClientLoop(threading.Thread):
    """Sends requests back to back through the proxy and keeps every answer."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.results: list[tuple[int, str]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop_event.is_set():
                response = client.post(self.url + "/v1/completions", json=BODY)
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
                self.results.append((response.status_code, text))


def test_killing_one_of_two_prefill_workers_fails_no_request(cluster):
    proxy, decode = cluster["proxy"], cluster["decode"]
    victim, survivor = cluster["prefills"]
    expected = expected_text(decode)
    loops = [ClientLoop(proxy.url) for _ in range(2)]
    for loop in loops:
        loop.start()
    assert wait_for(lambda: sum(len(loop.results) for loop in loops) >= 6, 60)
    victim.kill()
    killed_at = sum(len(loop.results) for loop in loops)
    assert wait_for(lambda: sum(len(loop.results) for loop in loops) >= killed_at + 12, 90)
    for loop in loops:
        loop.stop_event.set()
        loop.join(120)
    results = [result for loop in loops for result in loop.results]
    failures = [result for result in results if result[0] != 200]
    assert failures == [], failures
    assert all(text == expected for _, text in results)
    states = {b["url"]: b for b in proxy.health(TOKEN)["prefill"]}
    assert states[victim.url]["available"] is False and states[survivor.url]["available"] is True


def test_killing_the_only_decode_worker_gives_quick_503s_then_recovers(cluster, tmp_path):
    proxy, decode = cluster["proxy"], cluster["decode"]
    expected = expected_text(decode)
    decode.kill()
    for _ in range(5):
        started = time.monotonic()
        response = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
        assert time.monotonic() - started < 5.0  # not the client's 30 s: no wait on the dead worker
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "service_unavailable"
    revived = Worker("decode", decode.port, decode.log_path, decode.extra_args, internal_port=decode.internal_port)
    cluster["decode"] = revived
    start_workers(revived)

    def serves() -> bool:
        response = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=60)
        return response.status_code == 200 and response.json()["choices"][0]["text"] == expected

    assert wait_for(serves, timeout_s=30, interval_s=0.5)
