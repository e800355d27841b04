"""Health, metrics, the model list and request ids."""

from __future__ import annotations

import asyncio

import pytest
from tests.server.fake_engine import FakeEngine, asgi_client, make_app

from pdserve.api.errors import InvalidRequest
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.metrics import create_metrics

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_health_is_200_when_ready_and_503_while_loading():
    engine = FakeEngine(ready=False)
    async with asgi_client(make_app(engine)) as client:
        loading = await client.get("/health")
        engine.ready = True
        ready = await client.get("/health")
    assert loading.status_code == 503
    assert ready.status_code == 200


async def test_models_lists_the_served_model_with_its_context_length():
    async with asgi_client(make_app(FakeEngine(model_name="smol", max_model_len=2048))) as client:
        response = await client.get("/v1/models")
    body = response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("smol", "model", 2048)]


async def test_metrics_expose_request_series_after_a_request():
    metrics = create_metrics()
    async with asgi_client(make_app(FakeEngine(reply="abcd"), metrics)) as client:
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "pdserve_request_time_to_first_token_seconds_count 2.0",
        "pdserve_request_e2e_latency_seconds_count 2.0",
        "pdserve_request_inter_token_latency_seconds_count 5.0",  # 2 + 3 gaps between 3 and 4 tokens
        'pdserve_request_finished_total{reason="length"} 1.0',
        'pdserve_request_finished_total{reason="stop"} 1.0',
        "pdserve_request_generation_tokens_total 7.0",
        "pdserve_scheduler_queue_time_seconds",
        "pdserve_kv_prefix_cache_hits_tokens_total",
        "pdserve_engine_step_duration_seconds",
    ):
        assert name in text, name
    prompt_tokens = metrics.registry.get_sample_value("pdserve_request_prompt_tokens_total")
    assert prompt_tokens == 3 + len("<s><user>x\n<assistant>")


async def test_incoming_request_id_is_used_by_the_engine_and_echoed():
    engine = FakeEngine()
    async with asgi_client(make_app(engine)) as client:
        response = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "trace-42"})
        streamed = await client.post(
            "/v1/completions", json={"prompt": "x", "stream": True}, headers={"X-Request-Id": "trace-43"}
        )
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    assert streamed.headers["x-request-id"] == "trace-43"
    assert [r.request_id for r in engine.requests] == ["trace-42", "trace-43"]


async def test_request_id_is_generated_when_absent():
    engine = FakeEngine()
    async with asgi_client(make_app(engine)) as client:
        response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.headers["x-request-id"] == engine.requests[0].request_id
    assert len(engine.requests[0].request_id) == 32


async def test_concurrent_requests_with_one_request_id_get_distinct_engine_ids():
    engine = FakeEngine(reply="abcdef", token_delay_s=0.01)
    app = make_app(engine)
    async with asgi_client(app) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "dup"}) for _ in range(3))
        )
    assert sorted(r.headers["x-request-id"] for r in responses) == ["dup", "dup#2", "dup#3"]
    assert sorted(r.request_id for r in engine.requests) == ["dup", "dup#2", "dup#3"]
    assert len(app.state.serving.request_ids) == 0


def test_request_id_registry_suffixes_taken_ids_and_reuses_released_ones():
    registry = RequestIdRegistry()
    assert registry.reserve("a") == "a"
    assert registry.reserve("a") == "a#2"
    registry.release("a")
    assert registry.reserve("a") == "a"
    assert registry.reserve(None) not in {"a", "a#2"}


@pytest.mark.parametrize("wanted", ["has space", "tab\tid", "é", "x" * 241])
def test_request_id_registry_rejects_unprintable_or_long_ids(wanted):
    with pytest.raises(InvalidRequest):
        RequestIdRegistry().reserve(wanted)


def test_liveness_readiness_and_load_endpoints():
    from fastapi.testclient import TestClient

    from pdserve.api.config import ServerConfig
    from pdserve.metrics import Metrics
    from pdserve.server.app import create_app
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine()
    client = TestClient(create_app(engine, Metrics(), ServerConfig()))
    assert client.get("/live").status_code == 200
    assert client.get("/ready").status_code == 200
    load = client.get("/load").json()
    assert load["ready"] is True and load["num_running"] == 0 and load["kv_usage"] == 0.0
    engine.ready = False
    assert client.get("/ready").status_code == 503
    assert client.get("/live").status_code == 200
    assert client.get("/load").json()["ready"] is False
