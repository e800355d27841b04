"""KV-aware routing with real workers: two prefill workers, one decode worker and `pdserve proxy --policy
kv_aware`, real processes, real NIXL. A conversation's later turns go to the prefill worker that served its
first turn, with the predicted cached tokens equal to what the worker reports; a restarted worker's blocks
leave the index and its new (empty) history replaces them as soon as its new event stream starts; a turn the
decode worker already holds is served without a prefill leg, with the same greedy answer."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.integration.cluster import Worker, free_port, start_workers, stop_all, wait_for
from tests.integration.test_proxy_failures import ProxyProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "kv-routing-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "300", "--internal-token", TOKEN]
    prefills = [Worker("prefill", free_port(), str(logs / f"prefill{i}.log"), common, device) for i in range(2)]
    decode = Worker("decode", free_port(), str(logs / "decode.log"), common, device)
    workers = start_workers(*prefills, decode)
    backends = ["--prefill", *(p.url for p in prefills), "--decode", decode.url, "--internal-token", TOKEN,
                "--policy", "kv_aware", "--health-interval-s", "0.2"]
    # Sticky: never skip the prefill leg, so every turn shows which prefill worker it chose.
    sticky = ProxyProcess(free_port(), str(logs / "proxy-sticky.log"), [*backends, "--kv-decode-only-max-tokens", "0"])
    skipping = ProxyProcess(free_port(), str(logs / "proxy-skipping.log"), backends)
    state = {"prefills": prefills, "decode": decode, "sticky": sticky, "skipping": skipping}
    try:
        for proxy in (sticky, skipping):
            assert wait_for(lambda: routing_ready(proxy), timeout_s=60), "proxy never loaded the routing info"
        yield state
    finally:
        stop_all(sticky, skipping, *state["prefills"], decode, *workers)


def metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(proxy.url + "/metrics", timeout=5).text.splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def explain(proxy: ProxyProcess, body: dict) -> dict:
    return httpx.post(proxy.url + "/internal/routing/explain", json=body, timeout=10,
                      headers={"X-Pdserve-Internal-Token": TOKEN}).json()


def routing_ready(proxy: ProxyProcess) -> bool:
    try:
        answer = explain(proxy, {"prompt": "hi"})
    except httpx.HTTPError:
        return False
    return answer.get("ready") is True and len(answer["prefill"]["candidates"]) == 2


def turn(proxy: ProxyProcess, messages: list[dict]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def prefill_legs(proxy: ProxyProcess, worker: Worker) -> float:
    return metric(proxy, "pdserve_proxy_backend_requests_total", role="prefill", backend=worker.url)


def test_later_turns_follow_the_cache_and_a_restart_empties_it(cluster, tmp_path):
    proxy, prefills = cluster["sticky"], cluster["prefills"]
    messages = [{"role": "system", "content": "You are a geography tutor. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    messages.append({"role": "assistant", "content": turn(proxy, messages)})
    first = max(prefills, key=lambda p: prefill_legs(proxy, p))
    other = prefills[1 - prefills.index(first)]
    for question in ("And of Germany?", "And of Italy?"):
        messages.append({"role": "user", "content": question})
        body = {"model": MODEL, "messages": messages}
        assert wait_for(lambda: explain(proxy, body)["prefill"]["choice"] == first.url, timeout_s=5)
        messages.append({"role": "assistant", "content": turn(proxy, messages)})
    assert (prefill_legs(proxy, first), prefill_legs(proxy, other)) == (3, 0)
    assert metric(proxy, "pdserve_proxy_kv_routing_decisions_total", role="prefill", reason="cache_hit") == 2
    predicted = metric(proxy, "pdserve_proxy_kv_predicted_cached_tokens_total", role="prefill")
    assert predicted > 0
    assert metric(proxy, "pdserve_proxy_kv_actual_cached_tokens_total", role="prefill") == predicted
    assert metric(proxy, "pdserve_proxy_kv_prediction_error_tokens_sum", role="prefill") == 0

    blocks_before = metric(proxy, "pdserve_proxy_kv_index_blocks", role="prefill")
    first.kill()
    killed_s = time.monotonic()
    assert wait_for(lambda: metric(proxy, "pdserve_proxy_kv_index_blocks", role="prefill") < blocks_before, 1.0)
    assert time.monotonic() - killed_s < 1.0
    restarted = Worker("prefill", first.port, str(tmp_path / "restarted.log"), first.extra_args, first.device)
    cluster["prefills"][prefills.index(first)] = restarted
    start_workers(restarted)
    ready_s = time.monotonic()
    assert wait_for(lambda: metric(proxy, "pdserve_proxy_kv_resyncs_total", role="prefill", reason="restart") == 1,
                    timeout_s=5, interval_s=0.05)
    # The stream is retried at least once a second; once it starts the new history replaces the old.
    assert time.monotonic() - ready_s < 2.5, f"resynced {time.monotonic() - ready_s:.2f} s after the restart"
    candidates = explain(proxy, {"model": MODEL, "messages": messages})["prefill"]["candidates"]
    assert [c["cached_tokens"] for c in candidates if c["url"] == first.url] in ([], [0])


def test_a_turn_the_decode_worker_holds_skips_the_prefill_leg_with_the_same_answer(cluster):
    skipping, sticky = cluster["skipping"], cluster["sticky"]
    messages = [{"role": "system", "content": "Cooking help: answer in one short sentence."},
                {"role": "user", "content": "How long should I boil an egg?"}]
    messages.append({"role": "assistant", "content": turn(skipping, messages)})
    messages.append({"role": "user", "content": "And a soft one?"})
    assert metric(skipping, "pdserve_proxy_requests_total", mode="disaggregated") == 1
    body = {"model": MODEL, "messages": messages}
    assert wait_for(lambda: explain(skipping, body)["skip_prefill"], timeout_s=5)
    legs_before = metric(skipping, "pdserve_proxy_backend_requests_total", role="prefill")
    answer = turn(skipping, messages)
    assert metric(skipping, "pdserve_proxy_backend_requests_total", role="prefill") == legs_before
    assert metric(skipping, "pdserve_proxy_kv_routing_decisions_total", role="prefill",
                  reason="skipped_decode_cached") == 1
    assert metric(skipping, "pdserve_proxy_requests_total", mode="decode_only") == 1
    assert metric(skipping, "pdserve_proxy_kv_prediction_error_tokens_sum", role="decode") == 0
    assert metric(skipping, "pdserve_proxy_kv_actual_cached_tokens_total", role="decode") > 0
    assert turn(sticky, messages) == answer  # the same turn through both legs


def test_kv_endpoints_of_the_workers_need_the_internal_token(cluster):
    decode = cluster["decode"]
    assert httpx.get(decode.internal_url + "/internal/kv/routing_info", timeout=10).status_code == 401
    assert httpx.post(decode.internal_url + "/internal/kv/reset_prefix_cache", timeout=10).status_code == 401
    with httpx.stream("GET", decode.internal_url + "/internal/kv/events", timeout=10) as response:
        assert response.status_code == 401
