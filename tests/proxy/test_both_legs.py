"""Both legs at once, through the real proxy against stub workers: the decode leg waits at D while P
computes (P held by an event: the order is forced, not raced), P's answer is delivered to D, and every
failure on either side leaves D holding nothing and P's pin read or released."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from proxy.config import TimeoutConfig
from tests.proxy.forwarder_fixtures import BODY, cluster, proxy, start_proxy, stubs  # noqa: F401
from tests.proxy.proxy_stubs import PIN_NONCE
from tests.proxy.test_forwarder import released, released_soon, wait_until


def held(*workers) -> threading.Event:
    """Hold the workers' generation requests until the returned event is set."""
    event = threading.Event()
    for worker in workers:
        worker.hold = event
    return event


def prefilled_on(workers) -> str:
    """The prefill worker the proxy chose (round robin: either)."""
    [name] = [name for name in ("p0", "p1") if workers[name].calls]
    return name


def send(url: str, body=BODY, timeout_s: float = 10.0) -> "concurrent.futures.Future[httpx.Response]":
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=timeout_s)
    pool.shutdown(wait=False)
    return future


def both_waiting(workers) -> bool:
    return bool(workers["d0"].waiting) and bool(workers["p0"].calls or workers["p1"].calls)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_leg_waits_at_d_while_p_computes_and_gets_ps_params(cluster, proxy, stream):
    workers, _ = cluster
    p_done = held(workers["p0"], workers["p1"])
    answer = send(proxy.url, {**BODY, "stream": stream})
    assert wait_until(lambda: both_waiting(workers)), "the decode leg did not go out with the prefill leg"
    decode = proxy.components.decode_pool.backends()[0]
    assert (decode.num_in_flight, decode.num_awaiting_ticket) == (1, 1)  # routing sees D serve nothing yet
    p_done.set()
    response = answer.result()
    assert decode.num_awaiting_ticket == 0
    engine = prefilled_on(workers)
    assert response.status_code == 200 and engine in response.text
    [(key, params)] = workers["d0"].deliveries
    assert params["remote_engine_id"] == engine and params["remote_pin_nonce"] == PIN_NONCE and len(key) == 32
    [call] = workers["d0"].calls
    assert call.body["kv_transfer_params"] == params  # D went on with P's params, exactly as P gave them
    assert not released(workers) and not workers["d0"].waiting  # D read it: nothing to release, nothing left
    assert proxy.metric("pdserve_proxy_concurrent_legs_total", outcome="delivered") == 1


def test_p_answering_an_error_while_d_waits_calls_ds_leg_off_at_once(cluster, proxy):
    workers, _ = cluster
    p_done = held(workers["p0"], workers["p1"])
    for name in ("p0", "p1"):
        workers[name].fail_status, workers[name].fail_type = 400, "invalid_request_error"  # about the request
    answer = send(proxy.url)
    assert wait_until(lambda: both_waiting(workers))
    p_done.set()
    assert answer.result().status_code == 400
    assert wait_until(lambda: len(workers["d0"].abandoned) == 1 and len(workers["d0"].deliveries) == 1)
    [(key, params)] = workers["d0"].deliveries
    assert params is None and workers["d0"].abandoned == [key]  # and was told so
    assert not workers["d0"].calls and not workers["d0"].waiting and not released(workers)
    assert proxy.metric("pdserve_proxy_concurrent_legs_total", outcome="called_off") == 1


def test_every_prefill_worker_failing_while_d_waits_frees_d_and_d_computes_the_prompt(cluster, proxy):
    workers, _ = cluster
    p_done = held(workers["p0"], workers["p1"])
    for name in ("p0", "p1"):
        workers[name].fail_status = 502  # the path to each failed: retried on the other, then colocated
    answer = send(proxy.url)
    assert wait_until(lambda: both_waiting(workers))
    p_done.set()
    response = answer.result()
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "from local"
    assert wait_until(lambda: len(workers["d0"].abandoned) == 1 and len(workers["d0"].deliveries) == 1)
    assert [params for _, params in workers["d0"].deliveries] == [None]
    [call] = workers["d0"].calls  # the fallback leg, without params
    assert "kv_transfer_params" not in call.body and not workers["d0"].waiting
    assert proxy.metric("pdserve_proxy_colocated_fallbacks_total", reason="prefill_failed") == 1


def test_a_prefill_leg_timing_out_while_d_waits_frees_d(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]], timeouts=TimeoutConfig(prefill_s=0.3),
                         colocated_fallback=False)
    try:
        p_never = held(workers["p0"], workers["p1"])
        response = httpx.post(served.url + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 504
        assert wait_until(lambda: len(workers["d0"].abandoned) == 1 and len(workers["d0"].deliveries) == 1)
        assert [params for _, params in workers["d0"].deliveries] == [None] and not workers["d0"].waiting
    finally:
        p_never.set()
        served.__exit__(None, None, None)


def test_a_client_leaving_while_p_computes_frees_d_and_abandons_the_prefill(cluster, proxy):
    workers, _ = cluster
    p_done = held(workers["p0"], workers["p1"])
    with pytest.raises(httpx.ReadTimeout):
        send(proxy.url, timeout_s=0.5).result()  # P is held: the client leaves while P computes
    assert wait_until(lambda: len(workers["d0"].abandoned) == 1 and len(workers["d0"].deliveries) == 1)
    assert [params for _, params in workers["d0"].deliveries] == [None] and not workers["d0"].waiting
    p_done.set()
    assert not workers["d0"].calls


def test_d_refusing_while_p_computes_answers_at_once_and_closes_the_prefill_leg(cluster, proxy):
    workers, _ = cluster
    for name in ("p0", "p1"):
        workers[name].delay_s = 30.0  # P computes (and notices a closed leg); nothing here waits for it
    workers["d0"].fail_status, workers["d0"].fail_type = 500, "internal_error"  # D's own fault with the request
    started_s = time.monotonic()
    assert httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=10).status_code == 500
    assert time.monotonic() - started_s < 10  # the client did not wait for P
    assert wait_until(lambda: len(workers["p0"].disconnects) + len(workers["p1"].disconnects) == 1)  # P aborts
    assert not released(workers) and not workers["d0"].deliveries  # P pinned nothing; nothing to deliver


def test_d_refusing_the_request_after_its_ticket_releases_ps_pin(cluster, proxy):
    workers, _ = cluster
    p_done = held(workers["p0"], workers["p1"])
    d_refuses = held(workers["d0"])
    workers["d0"].fail_status, workers["d0"].fail_type = 500, "internal_error"
    answer = send(proxy.url)
    assert wait_until(lambda: bool(workers["d0"].calls or workers["p0"].calls or workers["p1"].calls))
    p_done.set()  # P answers (and pins) ...
    assert wait_until(lambda: len(workers["d0"].deliveries) == 1)  # ... its ticket goes to D, which is busy
    d_refuses.set()  # ... then D refuses the request: it read nothing
    assert answer.result().status_code == 500
    [release] = released_soon(workers, 1)
    engine = prefilled_on(workers)
    assert release == {"remote_request_id": "p-1", "remote_engine_id": engine, "remote_epoch": f"{engine}-epoch",
                       "remote_pin_nonce": PIN_NONCE}


def test_a_decode_worker_that_takes_no_concurrent_legs_gets_them_in_turn(cluster, proxy):
    workers, _ = cluster
    workers["d0"].takes_concurrent_legs = False  # refuses awaited params by name, as a release before them would
    p_done = held(workers["p0"], workers["p1"])
    answer = send(proxy.url)
    assert wait_until(lambda: proxy.metric("pdserve_proxy_concurrent_legs_total", outcome="in_turn") == 1)
    assert workers["d0"].num_refused_awaited == 1  # the proxy took D's refusal before P answered
    p_done.set()
    response = answer.result()
    engine = prefilled_on(workers)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == f"from {engine}"
    [call] = workers["d0"].calls
    assert call.body["kv_transfer_params"]["remote_engine_id"] == engine and not workers["d0"].deliveries
    assert not released(workers)


def test_without_concurrent_legs_the_decode_leg_goes_out_once_p_answered(cluster):
    workers, urls = cluster
    served = start_proxy([urls["p0"]], [urls["d0"]], concurrent_legs=False)
    try:
        p_done = held(workers["p0"], workers["p1"])
        answer = send(served.url)
        assert wait_until(lambda: bool(workers["p0"].calls))
        assert not workers["d0"].waiting and not workers["d0"].calls  # nothing at D while P computes
        p_done.set()
        assert answer.result().status_code == 200 and not workers["d0"].deliveries
        [call] = workers["d0"].calls
        assert "awaited_ticket" not in call.body["kv_transfer_params"]
    finally:
        served.__exit__(None, None, None)
