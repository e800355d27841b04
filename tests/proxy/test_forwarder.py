"""The two-leg forwarder over real HTTP: stub workers in uvicorn threads, the real proxy app in front."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from proxy.config import HealthConfig, RoutingConfig, TimeoutConfig
from tests.proxy.forwarder_fixtures import BODY, SLOW_POLLS, cluster, proxy, start_proxy, stubs  # noqa: F401
from tests.proxy.proxy_stubs import PIN_NONCE, Served, unused_url

def test_legs_follow_the_wire_protocol_with_one_request_id(cluster, proxy):
    workers, _ = cluster
    body = {**BODY, "stream_options": None, "min_tokens": 2, "max_completion_tokens": 8,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"}}
    response = httpx.post(proxy.url + "/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "req-42"
    prefill_call = (workers["p0"].calls + workers["p1"].calls)[0]
    decode_call = workers["d0"].calls[0]
    assert prefill_call.body["stream"] is False and prefill_call.body["max_tokens"] == 1
    assert prefill_call.body["max_completion_tokens"] == 1
    assert "stream_options" not in prefill_call.body and "min_tokens" not in prefill_call.body
    assert prefill_call.body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
        "decode_max_tokens": 8, "decode_min_tokens": 2}
    engine = decode_call.body["kv_transfer_params"]["remote_engine_id"]
    assert engine in ("p0", "p1") and decode_call.body["kv_transfer_params"]["remote_host"] == "127.0.0.1"
    assert decode_call.body["min_tokens"] == 2 and decode_call.body["max_tokens"] == 8
    assert prefill_call.headers["x-request-id"] == decode_call.headers["x-request-id"] == "req-42"
    assert prefill_call.headers["x-pdserve-internal-token"] == decode_call.headers["x-pdserve-internal-token"] == "s3cret"
    assert response.json()["choices"][0]["text"] == f"from {engine}"


def test_streamed_answer_is_decodes_bytes_unchanged(cluster, proxy):
    _, urls = cluster
    direct = httpx.post(urls["d0"] + "/v1/completions", json={**BODY, "stream": True,
                        "kv_transfer_params": {"remote_engine_id": "p0"}})
    with httpx.stream("POST", proxy.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        relayed = b"".join(response.iter_raw())
    assert relayed.replace(b"p1-", b"p0-") == direct.content
    assert proxy.metric("pdserve_proxy_ttft_seconds_count", mode="disaggregated") == 1
    assert proxy.metric("pdserve_proxy_ttft_prefill_seconds_count") == 1
    assert proxy.metric("pdserve_proxy_overhead_seconds_count", mode="disaggregated") == 1


def test_round_robin_alternates_prefill_workers(cluster, proxy):
    workers, _ = cluster
    for _ in range(4):
        assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
    assert len(workers["p0"].calls) == len(workers["p1"].calls) == 2


def test_failed_prefill_leg_is_retried_on_the_other_worker(cluster, proxy):
    workers, _ = cluster
    workers["p0"].fail_status = 502  # a gateway in front of p0 cannot reach it
    texts = [httpx.post(proxy.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(4)]
    assert texts == ["from p1"] * 4
    assert proxy.metric("pdserve_proxy_retries_total", role="prefill", reason="http_502") >= 1
    assert proxy.metric("pdserve_proxy_backend_errors_total", role="prefill", reason="http_502") >= 1


def test_breaker_opens_after_consecutive_failures_and_traffic_moves(cluster):
    workers, urls = cluster
    workers["p0"].fail_status = 502
    health = HealthConfig(interval_s=0.05, breaker_failures=3, breaker_cooldown_s=60)
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], health=health)
    try:
        for _ in range(8):
            assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 200
        assert served.components.prefill_pool.get(urls["p0"]).breaker.state.name == "OPEN"
        assert served.metric("pdserve_proxy_backend_breaker_state", backend=urls["p0"]) == 2
    finally:
        served.__exit__(None, None, None)
    assert len(workers["p0"].calls) == 3  # the breaker's threshold, then no more


def test_breaker_half_opens_and_closes_when_the_worker_recovers(cluster, proxy):
    workers, urls = cluster
    workers["p0"].fail_status = 504
    for _ in range(6):
        httpx.post(proxy.url + "/v1/completions", json=BODY)
    workers["p0"].fail_status = None
    time.sleep(0.6)  # the breaker's cool-down
    for _ in range(4):
        assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
    assert proxy.components.prefill_pool.get(urls["p0"]).breaker.state.name == "CLOSED"


def test_unreachable_prefill_worker_costs_no_request(cluster):
    _, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]], health=SLOW_POLLS)
    served.components.prefill_pool.add(unused_url()).healthy = True  # died since the last poll
    try:
        for _ in range(6):
            assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 200
        assert served.metric("pdserve_proxy_retries_total", role="prefill", reason="connect") >= 1
    finally:
        served.__exit__(None, None, None)


def test_kv_pull_failure_reprefills_on_another_worker_once(cluster, proxy):
    workers, _ = cluster
    workers["d0"].num_kv_failures = 1
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    first, second = workers["d0"].calls
    assert first.body["kv_transfer_params"]["remote_engine_id"] != second.body["kv_transfer_params"]["remote_engine_id"]
    assert proxy.metric("pdserve_proxy_retries_total", role="prefill", reason="kv_pull_failed") == 1


def test_second_kv_pull_failure_reaches_the_client(cluster, proxy):
    workers, _ = cluster
    workers["d0"].num_kv_failures = 2
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "kv_pull_failed"
    assert "retry-after" in response.headers
    assert len(workers["d0"].calls) == 2


def test_client_error_from_prefill_is_passed_through_without_retry(cluster, proxy):
    workers, _ = cluster
    workers["p0"].fail_status = workers["p1"].fail_status = 400
    workers["p0"].fail_type = workers["p1"].fail_type = "invalid_request_error"
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(workers["p0"].calls) + len(workers["p1"].calls) == 1
    assert workers["d0"].calls == []


def test_no_ready_decode_worker_is_a_quick_503_before_any_prefill(cluster, proxy):
    workers, urls = cluster
    workers["d0"].ready = False
    assert wait_until(lambda: not proxy.components.decode_pool.get(urls["d0"]).healthy)
    started = time.monotonic()
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert time.monotonic() - started < 5.0  # no wait for a worker (a CI VM pauses up to ~0.6 s at times)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"] == {"message": "no decode worker is available; retry later",
                                        "type": "service_unavailable", "param": None, "code": 503}
    assert proxy.metric("pdserve_proxy_rejected_total", role="decode") == 1
    assert workers["p0"].calls == workers["p1"].calls == []  # no prefill work wasted
    assert httpx.get(proxy.url + "/health").status_code == 503
    workers["d0"].ready = True
    assert wait_until(lambda: httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 200)


def test_decode_refusing_connections_gives_503_after_prefill(cluster):
    _, urls = cluster
    dead = unused_url()
    served = start_proxy([urls["p0"]], [urls["d0"]], health=SLOW_POLLS)
    served.components.decode_pool.retire(urls["d0"])
    served.components.decode_pool.add(dead).healthy = True  # died since the last poll
    try:
        response = httpx.post(served.url + "/v1/completions", json=BODY)
        assert response.status_code == 503 and "retry-after" in response.headers
        assert served.metric("pdserve_proxy_backend_errors_total", role="decode", reason="connect") == 1
    finally:
        served.__exit__(None, None, None)


def test_unready_worker_is_skipped_until_it_reports_ready(cluster, proxy):
    workers, urls = cluster
    workers["p1"].ready = False
    deadline = time.monotonic() + 2
    while proxy.components.prefill_pool.get(urls["p1"]).healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    for _ in range(4):
        assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
    assert workers["p1"].calls == [] and len(workers["p0"].calls) == 4


def test_short_prompt_goes_straight_to_decode(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]], routing=RoutingConfig(disagg_min_prompt_tokens=50))
    try:
        short = httpx.post(served.url + "/v1/completions", json=BODY)
        long = httpx.post(served.url + "/v1/completions", json={**BODY, "prompt": "word " * 100})
    finally:
        served.__exit__(None, None, None)
    assert short.json()["choices"][0]["text"] == "from local"
    assert long.json()["choices"][0]["text"] == "from p0"
    assert len(workers["p0"].calls) == 1
    assert "kv_transfer_params" not in workers["d0"].calls[0].body


def test_prefill_timeout_moves_to_the_other_worker(cluster):
    workers, urls = cluster
    workers["p0"].delay_s = 5.0
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], timeouts=TimeoutConfig(prefill_s=0.3))
    try:
        texts = [httpx.post(served.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(2)]
        assert texts == ["from p1", "from p1"]
        assert served.metric("pdserve_proxy_backend_errors_total", role="prefill", reason="timeout") >= 1
        assert served.metric("pdserve_proxy_retries_total", role="prefill", reason="timeout") >= 1
    finally:
        served.__exit__(None, None, None)


def test_client_gone_during_prefill_cancels_the_prefill_leg(cluster, proxy):
    workers, _ = cluster
    workers["p0"].delay_s = workers["p1"].delay_s = 5.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "gone-1"}, timeout=0.3)
    deadline = time.monotonic() + 3
    while not (workers["p0"].disconnects + workers["p1"].disconnects) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert workers["p0"].disconnects + workers["p1"].disconnects == ["gone-1"]
    assert workers["d0"].calls == []


def test_client_gone_mid_stream_cancels_the_decode_leg(cluster, proxy):
    workers, urls = cluster
    workers["d0"].num_chunks, workers["d0"].chunk_delay_s = 50, 0.05
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**BODY, "stream": True},
                      headers={"X-Request-Id": "gone-2"}) as response:
        next(response.iter_raw())
    deadline = time.monotonic() + 3
    while not workers["d0"].disconnects and time.monotonic() < deadline:
        time.sleep(0.02)
    assert workers["d0"].disconnects == ["gone-2"]
    decode = proxy.components.decode_pool.get(urls["d0"])
    assert wait_until(lambda: decode.num_in_flight == 0)


def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_invalid_json_is_an_openai_style_400(proxy):
    response = httpx.post(proxy.url + "/v1/completions", content=b"{not json", headers={"X-Request-Id": "bad"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["x-request-id"] == "bad"


def test_models_health_and_metrics_routes(cluster, proxy):
    models = httpx.get(proxy.url + "/v1/models")
    assert models.json()["data"][0]["id"] == "stub-model"
    public = httpx.get(proxy.url + "/health").json()
    assert public == {"status": "ok"}  # no backend addresses for just anyone
    wrong = httpx.get(proxy.url + "/health", headers={"X-Pdserve-Internal-Token": "guess"}).json()
    assert wrong == {"status": "ok"}
    health = httpx.get(proxy.url + "/health", headers={"X-Pdserve-Internal-Token": "s3cret"}).json()
    assert health["status"] == "ok" and len(health["prefill"]) == 2 and health["decode"][0]["breaker"] == "closed"
    httpx.post(proxy.url + "/v1/completions", json=BODY)
    text = httpx.get(proxy.url + "/metrics").text
    for name in ("pdserve_proxy_requests_total", "pdserve_proxy_backend_requests_total",
                 "pdserve_proxy_backend_latency_seconds_bucket", "pdserve_proxy_overhead_seconds_bucket",
                 "pdserve_proxy_backend_healthy", "pdserve_proxy_backend_breaker_state"):
        assert name in text
    assert httpx.get(proxy.url + "/nope").json()["error"]["type"] == "not_found_error"


def test_prefix_policy_pins_a_prompt_to_one_prefill_worker(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], routing=RoutingConfig(prefill_policy="prefix"))
    try:
        for _ in range(4):
            assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 200
    finally:
        served.__exit__(None, None, None)
    assert sorted([len(workers["p0"].calls), len(workers["p1"].calls)]) == [0, 4]


def test_decode_breaking_mid_stream_ends_with_an_error_event(cluster, proxy):
    workers, urls = cluster
    workers["d0"].break_after_chunks = 2
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**BODY, "stream": True}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3
    assert json.loads(events[-1][len("data: "):])["error"]["type"] == "bad_gateway"
    assert proxy.metric("pdserve_proxy_backend_errors_total", role="decode", reason="stream_broken") == 1
    assert proxy.components.decode_pool.get(urls["d0"]).breaker.num_consecutive_failures == 1


@pytest.mark.parametrize("body, status, param", [
    ({**BODY, "max_tokens": 0}, 400, "max_tokens"),
    ({**BODY, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({**BODY, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**BODY, "stream": "yes"}, 400, "stream"),
    ({**BODY, "temperature": 2.5}, 400, "temperature"),
])
def test_requests_the_workers_would_refuse_never_reach_a_worker(cluster, proxy, body, status, param):
    workers, _ = cluster
    response = httpx.post(proxy.url + "/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert all(worker.calls == [] for worker in workers.values())


def test_deep_large_and_misnamed_requests_get_the_workers_answers(cluster, proxy):
    workers, _ = cluster
    deep = httpx.post(proxy.url + "/v1/completions",
                      content=b'{"prompt": "x", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}")
    assert deep.status_code == 400 and "nested deeper" in deep.json()["error"]["message"]
    large = httpx.post(proxy.url + "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert large.status_code == 413
    bad_id = httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "x" * 241})
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "X-Request-Id"
    assert all(worker.calls == [] for worker in workers.values())
    assert proxy.metric("pdserve_proxy_requests_total", status="4xx") == 3


def released(workers) -> list[dict]:
    return workers["p0"].releases + workers["p1"].releases


def released_soon(workers, count: int) -> list[dict]:
    wait_until(lambda: len(released(workers)) >= count)
    time.sleep(0.1)  # and no more than that
    return released(workers)


@pytest.mark.parametrize("stream", [False, True])
def test_p_d_legs_the_decode_worker_computed_itself_are_counted(cluster, proxy, stream):
    workers, _ = cluster
    for worker in workers.values():
        worker.says_recomputed = worker.role == "decode"
    assert httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": stream}).status_code == 200
    assert proxy.metric("pdserve_proxy_pd_legs_recomputed_total") == 1
    for worker in workers.values():
        worker.says_recomputed = False
    assert httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": stream}).status_code == 200
    assert proxy.metric("pdserve_proxy_pd_legs_recomputed_total") == 1  # a pulled leg says nothing


@pytest.mark.parametrize("status, error_type", [(400, "invalid_request_error"), (503, "service_unavailable"),
                                                (500, "internal_error")])
def test_a_refused_decode_leg_frees_the_prefill_workers_kv_at_once(cluster, status, error_type):
    """With the legs in turn P has pinned before D refuses; with both legs at once D's refusal may come
    first, and tests/proxy/test_both_legs.py covers that order."""
    workers, urls = cluster
    workers["d0"].fail_status, workers["d0"].fail_type = status, error_type
    proxy = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], internal_token="s3cret", concurrent_legs=False)
    try:
        response = httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "refused"})
        assert response.status_code in (status, 502)
        [release] = released_soon(workers, 1)
        [engine] = [name for name in ("p0", "p1") if workers[name].calls]  # the prefill worker that pinned it
        assert release == {"remote_request_id": "p-1", "remote_engine_id": engine, "remote_epoch": f"{engine}-epoch",
                           "remote_pin_nonce": PIN_NONCE}
        assert proxy.metric("pdserve_proxy_kv_releases_total", result="sent") == 1
    finally:
        proxy.__exit__(None, None, None)


def test_both_prefills_of_a_kv_retry_are_freed_when_decode_cannot_read_either(cluster, proxy):
    workers, _ = cluster
    workers["d0"].num_kv_failures = 2
    assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 503
    assert sorted(r["remote_engine_id"] for r in released_soon(workers, 2)) == ["p0", "p1"]


def test_kv_is_freed_when_no_decode_worker_can_be_reached(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]], health=SLOW_POLLS)
    served.components.decode_pool.retire(urls["d0"])
    served.components.decode_pool.add(unused_url()).healthy = True
    try:
        assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 503
        assert len(released_soon(workers, 1)) == 1
    finally:
        served.__exit__(None, None, None)


def test_kv_is_kept_after_a_decode_leg_that_may_still_be_reading(cluster):
    workers, urls = cluster
    workers["d0"].delay_s = 5.0  # answers too late: the decode worker has the request and may be reading
    served = start_proxy([urls["p0"]], [urls["d0"]], timeouts=TimeoutConfig(decode_s=0.3))
    try:
        assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 504
        ok = httpx.post(served.url + "/v1/completions", json={**BODY, "stream": True})
        assert ok.status_code == 504 or ok.status_code == 200
        time.sleep(0.3)
        assert released(workers) == []
    finally:
        served.__exit__(None, None, None)


def test_served_requests_release_nothing(cluster, proxy):
    workers, _ = cluster
    for stream in (False, True):
        assert httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": stream}).status_code == 200
    time.sleep(0.2)
    assert released(workers) == []


@pytest.mark.parametrize("status, error_type", [(400, "invalid_request_error"), (500, "request_failed"),
                                                (500, "internal_error"), (501, "not_implemented")])
def test_errors_the_request_caused_pass_through_unretried_and_never_trip_the_breaker(cluster, status, error_type):
    workers, urls = cluster
    for name in ("p0", "p1"):
        workers[name].fail_status, workers[name].fail_type = status, error_type
    health = HealthConfig(interval_s=0.05, breaker_failures=2, breaker_cooldown_s=60)
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], health=health)
    try:
        for _ in range(6):
            response = httpx.post(served.url + "/v1/completions", json=BODY)
            assert response.status_code == status and response.json()["error"]["type"] == error_type
        assert len(workers["p0"].calls) + len(workers["p1"].calls) == 6  # one leg each, no retry
        assert all(b.breaker.state.name == "CLOSED" for b in served.components.prefill_pool.backends())
        for name in ("p0", "p1"):
            workers[name].fail_status = None
        assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 200  # nobody got a 503
    finally:
        served.__exit__(None, None, None)


def test_a_hundred_requests_a_worker_answers_with_500s_and_4xxs_open_no_breaker(cluster):
    """No sequence of client requests can take a healthy worker out: each answer it gives about one
    request, 4xx or its own 5xx, reaches the client unchanged; the breakers stay closed."""
    workers, urls = cluster
    health = HealthConfig(interval_s=0.05, breaker_failures=2, breaker_cooldown_s=60)
    # Legs in turn: with concurrent legs a prefill may still run when the decode worker's refusal has
    # answered the client, and meet the next request's failure setting (test_both_legs.py covers that mode).
    served = start_proxy([urls["p0"]], [urls["d0"]], health=health, concurrent_legs=False)
    answers = [(500, "internal_error"), (400, "invalid_request_error"), (500, "request_failed"), (422, "unprocessable")]
    try:
        for index in range(100):
            status, error_type = answers[index // 2 % len(answers)]
            failing = workers["p0"] if index % 2 == 0 else workers["d0"]  # both legs take their share
            failing.fail_status, failing.fail_type = status, error_type
            response = httpx.post(served.url + "/v1/completions", json=BODY)
            failing.fail_status = None
            assert response.status_code == status and response.json()["error"]["type"] == error_type, index
        pools = (served.components.prefill_pool, served.components.decode_pool)
        assert all(b.breaker.state.name == "CLOSED" for pool in pools for b in pool.backends())
        assert served.metric("pdserve_proxy_backend_server_errors_total", role="prefill", status="500") == 25
        assert served.metric("pdserve_proxy_backend_server_errors_total", role="decode", status="500") == 25
        assert served.metric("pdserve_proxy_backend_errors_total") == 0
        good = httpx.post(served.url + "/v1/completions", json=BODY)
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "from p0"
    finally:
        served.__exit__(None, None, None)


def test_a_half_open_decode_breaker_admits_exactly_one_trial(cluster):
    import concurrent.futures

    workers, urls = cluster
    workers["d0"].fail_status = 502
    health = HealthConfig(interval_s=0.05, breaker_failures=2, breaker_cooldown_s=0.5)
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], health=health, concurrent_legs=False)
    try:
        for _ in range(2):
            assert httpx.post(served.url + "/v1/completions", json=BODY).status_code == 502
        breaker = served.components.decode_pool.get(urls["d0"]).breaker
        assert breaker.state.name == "OPEN"
        workers["d0"].fail_status, workers["d0"].delay_s = None, 0.8
        num_calls_before = len(workers["d0"].calls)
        wait_until(lambda: breaker.state.name == "HALF_OPEN", 2.0)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            statuses = sorted(pool.map(lambda _: httpx.post(served.url + "/v1/completions", json=BODY,
                                                            timeout=10).status_code, range(4)))
        assert statuses == [200, 503, 503, 503]
        assert len(workers["d0"].calls) - num_calls_before == 1
        assert breaker.state.name == "CLOSED"
    finally:
        served.__exit__(None, None, None)

