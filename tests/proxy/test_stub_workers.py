"""The stub workers the proxy tests stand behind behave like the real ones where it matters."""

import httpx

from tests.proxy.proxy_stubs import Served, StubWorker


def test_stub_prefill_returns_kv_params_and_records_the_call():
    worker = StubWorker("prefill", "p0")
    with Served(worker.app()) as served:
        response = httpx.post(served.url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "r1"})
    assert response.json()["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert worker.calls[0].body == {"prompt": "hi"} and worker.calls[0].headers["x-request-id"] == "r1"


def test_stub_decode_streams_events_ending_with_done():
    worker = StubWorker("decode", "d0")
    with Served(worker.app()) as served:
        response = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "stream": True})
    assert response.text.endswith("data: [DONE]\n\n") and response.text.count("data: ") == 4
