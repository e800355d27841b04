"""Every kind of bad request gets the right 4xx (or 503) and an OpenAI error body; none gets a 500."""

from __future__ import annotations

import json

import pytest
from tests.server.fake_engine import FakeEngine, asgi_client, make_app

from pdserve.api.errors import EngineOverloaded
from pdserve.metrics import create_metrics

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


USER = [{"role": "user", "content": "hi"}]


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def send(engine: FakeEngine, path: str, **kwargs):
    async with asgi_client(make_app(engine)) as client:
        return await client.post(path, **kwargs)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe"],
    ids=["invalid-json", "empty", "array", "string", "not-utf8"],
)
async def test_malformed_body_is_a_400(content):
    engine = FakeEngine()
    response = await send(engine, "/v1/completions", content=content)
    assert_openai_error(response, 400)
    assert engine.requests == []


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"400": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a("}, "guided_regex"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
                                                                "json_schema": {"schema": {"type": "foo"}}}},
         "response_format"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
        ("/v1/completions", {"prompt": [5, 259]}, "prompt"),
        ("/v1/completions", {"prompt": [-3, 5]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [400]}, "stop_token_ids"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": USER, "n": -3}, "n"),
        ("/v1/chat/completions", {"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": USER, "stream": False, "stream_options": {}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "RAISE"}]}, "messages"),
    ],
)
async def test_invalid_field_is_a_400_naming_the_field(path, body, param):
    engine = FakeEngine()
    response = await send(engine, path, json=body)
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert engine.requests == []


async def test_prompt_over_the_context_is_a_400_with_the_limit():
    engine = FakeEngine(max_model_len=16)
    response = await send(engine, "/v1/completions", json={"prompt": "x" * 40})
    error = assert_openai_error(response, 400, "prompt")
    assert "maximum context length is 16 tokens" in error["message"] and "41 tokens" in error["message"]


async def test_prompt_plus_max_tokens_over_the_context_is_a_400_on_max_tokens():
    engine = FakeEngine(max_model_len=30)  # the templated prompt is 23 tokens
    response = await send(engine, "/v1/chat/completions", json={"messages": USER, "max_tokens": 10})
    error = assert_openai_error(response, 400, "max_tokens")
    assert "reduce max_tokens to at most 7" in error["message"]


async def test_unknown_model_is_a_404():
    response = await send(FakeEngine(), "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    error = assert_openai_error(response, 404, "model")
    assert "gpt-9" in error["message"] and "fake-model" in error["message"]


async def test_engine_not_ready_is_a_503():
    engine = FakeEngine(ready=False)
    response = await send(engine, "/v1/chat/completions", json={"messages": USER})
    assert assert_openai_error(response, 503)["type"] == "service_unavailable"
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_engine_is_a_503_even_when_streaming(stream):
    engine = FakeEngine(raise_on_start=EngineOverloaded("waiting queue is full"))
    response = await send(engine, "/v1/completions", json={"prompt": "x", "stream": stream})
    assert assert_openai_error(response, 503)["message"] == "waiting queue is full"


async def test_invalid_request_id_header_is_a_400():
    response = await send(FakeEngine(), "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "a" * 300})
    assert_openai_error(response, 400, "X-Request-Id")


async def test_unknown_route_and_wrong_method_keep_their_status_with_an_openai_body():
    async with asgi_client(make_app(FakeEngine())) as client:
        assert_openai_error(await client.get("/v1/nothing"), 404)
        assert_openai_error(await client.get("/v1/completions"), 405)


async def test_errors_are_counted_by_status_and_echo_the_request_id():
    metrics = create_metrics()
    async with asgi_client(make_app(FakeEngine(), metrics)) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "n": 0}, headers={"X-Request-Id": "bad-1"})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.headers["x-request-id"] == "bad-1"
    assert metrics.registry.get_sample_value("pdserve_request_errors_total", {"status": "400"}) == 1.0
    assert metrics.registry.get_sample_value("pdserve_request_errors_total", {"status": "404"}) == 1.0


async def test_rejected_requests_free_their_request_id():
    app = make_app(FakeEngine())
    async with asgi_client(app) as client:
        await client.post("/v1/completions", content=json.dumps({"prompt": ""}), headers={"X-Request-Id": "r"})
        await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "r"})
    assert len(app.state.serving.request_ids) == 0


async def test_every_503_carries_retry_after():
    engine = FakeEngine(raise_on_start=EngineOverloaded("waiting queue is full"))
    response = await send(engine, "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    not_ready = await send(FakeEngine(ready=False), "/v1/completions", json={"prompt": "x"})
    assert not_ready.status_code == 503 and not_ready.headers["retry-after"] == "1"


async def test_streams_past_the_cap_get_503_before_any_work_and_slots_come_back():
    import asyncio

    from pdserve.api.config import ServerConfig

    engine = FakeEngine(reply="abcdef", stall_after_tokens=2)  # streams stay open until their client leaves
    app = make_app(engine, server=ServerConfig(max_concurrent_streams=2))
    body = {"prompt": "x", "stream": True}
    async with asgi_client(app) as client:
        async def read_stream() -> None:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                await response.aread()

        held = [asyncio.create_task(read_stream()) for _ in range(2)]
        while app.state.serving.num_open_streams < 2 or len(engine.requests) < 2:  # both taken and both submitted
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/completions", json=body)
        assert_openai_error(refused, 503)
        assert refused.headers["retry-after"] == "1"
        assert len(engine.requests) == 2  # the refused one never reached the engine
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        for _ in range(200):
            if app.state.serving.num_open_streams == 0:
                break
            await asyncio.sleep(0.01)
        assert app.state.serving.num_open_streams == 0
        engine.stall_after_tokens = None
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert app.state.serving.num_open_streams == 0
