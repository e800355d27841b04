"""The forwarder when workers die, when its own code fails, and under adaptive disaggregation and the
SLO: stub workers over real HTTP, the real proxy app in front (fixtures from test_forwarder)."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from proxy.config import RoutingConfig
from tests.proxy.proxy_stubs import DroppingWorker
from tests.proxy.forwarder_fixtures import BODY, SLOW_POLLS, cluster, proxy, start_proxy, stubs  # noqa: F401
from tests.proxy.test_forwarder import wait_until


# ---- what a process death costs (issue 22, part 4) -----------------------------------------


def test_when_every_prefill_worker_fails_the_decode_worker_computes_the_prompt(cluster, proxy):
    workers, _ = cluster
    workers["p0"].fail_status = workers["p1"].fail_status = 502  # both unreachable behind their gateways
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "from local"
    assert "kv_transfer_params" not in workers["d0"].calls[-1].body  # a plain, colocated request
    assert proxy.metric("pdserve_proxy_colocated_fallbacks_total", reason="prefill_failed") == 1
    assert proxy.metric("pdserve_proxy_requests_total", mode="decode_only", status="2xx") == 1


def test_with_no_healthy_prefill_worker_requests_are_served_colocated_and_the_proxy_stays_ready(cluster, proxy):
    workers, urls = cluster
    workers["p0"].ready = workers["p1"].ready = False
    assert wait_until(lambda: not proxy.components.prefill_pool.available())
    for _ in range(3):
        response = httpx.post(proxy.url + "/v1/completions", json=BODY)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "from local"
    assert workers["p0"].calls == workers["p1"].calls == []
    assert proxy.metric("pdserve_proxy_colocated_fallbacks_total", reason="no_prefill") == 3
    assert httpx.get(proxy.url + "/health").status_code == 200
    workers["p0"].ready = True  # back: disaggregated again
    assert wait_until(lambda: bool(proxy.components.prefill_pool.available()))
    assert httpx.post(proxy.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] == "from p0"


def test_without_the_fallback_no_prefill_worker_is_still_a_503(cluster):
    workers, urls = cluster
    workers["p0"].fail_status = 502
    served = start_proxy([urls["p0"]], [urls["d0"]], colocated_fallback=False)
    try:
        response = httpx.post(served.url + "/v1/completions", json=BODY)
        assert response.status_code in (502, 503), response.text
        assert workers["d0"].calls == []
        assert served.metric("pdserve_proxy_colocated_fallbacks_total", reason="prefill_failed") == 0
    finally:
        served.__exit__(None, None, None)


@pytest.mark.parametrize("concurrent", [False, True], ids=["in_turn", "concurrent"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_worker_that_dies_with_the_request_before_answering_costs_nothing(cluster, stream, concurrent):
    """Legs in turn: the dying worker has the request (and may have pulled the KV) when it drops the
    connection: the proxy prefills again, for a new pin, and another decode worker answers. Concurrent
    legs: it dies before its ticket (it read nothing): another decode worker takes the same pin."""
    workers, urls = cluster
    dying = DroppingWorker()
    served = start_proxy([urls["p0"]], [urls["d0"]], health=SLOW_POLLS, concurrent_legs=concurrent,
                         routing=RoutingConfig(prefill_policy="round_robin", decode_policy="round_robin"))
    served.components.decode_pool.add(dying.url).healthy = True  # died since the last poll
    try:
        answers = [httpx.post(served.url + "/v1/completions", json={**BODY, "stream": stream}) for _ in range(4)]
    finally:
        served.__exit__(None, None, None)
        dying.close()
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers]
    legs = [r for r in dying.requests if r.startswith(b"POST /v1/")]  # not the tickets delivered to it
    assert 1 <= len(legs) <= 4 and all(b"kv_transfer_params" in r for r in legs)
    # In turn, each death cost one more prefill; concurrent, none (the dying worker never had a ticket).
    assert len(workers["p0"].calls) == 4 + (0 if concurrent else len(legs))
    assert len(workers["d0"].calls) == 4
    fresh = {call.body["kv_transfer_params"]["remote_engine_id"] for call in workers["d0"].calls}
    assert fresh == {"p0"}


def test_an_exception_escaping_the_forwarder_is_a_logged_500_that_names_the_request(cluster, monkeypatch, caplog):
    """Our bug, not the client's or a worker's: a plain 500 with the request id, logged with its traceback."""
    from proxy.forwarder import Forwarder

    async def broken(self, *args):
        raise RuntimeError("a bug in the proxy")

    monkeypatch.setattr(Forwarder, "_run_legs", broken)
    _, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]])
    try:
        response = httpx.post(served.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "bug-7"})
        assert response.status_code == 500
        assert response.headers["x-request-id"] == "bug-7"
        assert response.json() == {"error": {"message": "internal proxy error", "type": "internal_error",
                                             "param": None, "code": 500}}
        assert served.metric("pdserve_proxy_requests_total", status="5xx") == 1
    finally:
        served.__exit__(None, None, None)
    logged = [r for r in caplog.records if "bug-7" in r.getMessage() and r.exc_info is not None]
    assert logged and "a bug in the proxy" in str(logged[0].exc_info[1])


# ---- adaptive disaggregation and the SLO (issue 27) -----------------------------------------


def test_adaptive_moves_a_short_prompt_to_the_decode_worker_while_prefill_is_busy_and_back_when_idle(cluster):
    """Three prefills alone teach the proxy the prefill speed (0.1 s for a 125-token prompt: 0.8 ms a
    token). Two 2,500-token prompts then sit on the prefill worker (held there: the order is forced).
    A 125-token prompt would wait 4 s behind them, past its 1.25 s budget; the decode worker computes it
    in 0.1 s, so it goes there. Once the prefill worker is idle again, the same prompt goes to it."""
    workers, urls = cluster
    short, long = {**BODY, "prompt": "word " * 100}, {**BODY, "prompt": "word " * 2000}
    served = start_proxy([urls["p0"]], [urls["d0"]], routing=RoutingConfig(disaggregation="adaptive"))
    try:
        workers["p0"].delay_s = 0.1
        for _ in range(3):
            assert httpx.post(served.url + "/v1/completions", json=short).json()["choices"][0]["text"] == "from p0"
        workers["p0"].delay_s = 0.0
        workers["p0"].hold = threading.Event()
        prefill = served.components.prefill_pool.get(urls["p0"])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            burst = [pool.submit(httpx.post, served.url + "/v1/completions", json=long, timeout=30) for _ in range(2)]
            assert wait_until(lambda: prefill.prompt_tokens_in_flight == 2 * 2500)
            moved = httpx.post(served.url + "/v1/completions", json=short)
            assert moved.json()["choices"][0]["text"] == "from local"
            workers["p0"].hold.set()
            assert [f.result().json()["choices"][0]["text"] for f in burst] == ["from p0", "from p0"]
        assert prefill.prompt_tokens_in_flight == 0
        back = httpx.post(served.url + "/v1/completions", json=short)
        assert back.json()["choices"][0]["text"] == "from p0"
        decisions = lambda where, reason: served.metric(  # noqa: E731
            "pdserve_proxy_disaggregation_decisions_total", where=where, reason=reason)
        assert decisions("prefill", "static") == 3  # before the speed was known
        assert decisions("decode", "prefill_busy") == 1
        assert decisions("prefill", "prefill_fits") == 3  # the burst, then the prompt once P was idle
    finally:
        served.__exit__(None, None, None)


def test_streamed_answers_are_judged_against_the_slo(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]])
    try:
        workers["d0"].num_chunks, workers["d0"].chunk_delay_s = 4, 0.0
        fast = httpx.post(served.url + "/v1/completions", json={**BODY, "stream": True})
        workers["d0"].chunk_delay_s = 0.06  # 60 ms between tokens: past the 20 ms TPOT
        slow = httpx.post(served.url + "/v1/completions", json={**BODY, "stream": True})
        unjudged = httpx.post(served.url + "/v1/completions", json=BODY)  # not streamed: no TTFT to see
        assert fast.status_code == slow.status_code == unjudged.status_code == 200
        assert served.metric("pdserve_proxy_slo_requests_total", result="met") == 1
        assert served.metric("pdserve_proxy_slo_requests_total", result="tpot_missed") == 1
        assert served.metric("pdserve_proxy_slo_attainment_ratio") == 0.5
    finally:
        served.__exit__(None, None, None)
