"""A real uvicorn server on 127.0.0.1 backed by the fake engine.

The official `openai` client (chat and completions, streamed or not), and real
TCP clients that go away early.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from tests.server.fake_engine import FakeEngine, make_app

from pdserve.metrics import create_metrics


@pytest.fixture(scope="module")
def served():
    """(base_url, engine) of a server running in a background thread."""
    engine = FakeEngine(reply="Hello there")
    metrics = create_metrics()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held until the server takes the socket
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(engine, metrics), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1", engine
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def client(served) -> openai.OpenAI:
    base_url, _ = served
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10) as client:
        yield client


def test_openai_client_lists_the_model(client):
    assert [model.id for model in client.models.list()] == ["fake-model"]


def test_openai_client_chat_completion(client):
    completion = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert completion.choices[0].message.content == "Hello"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5


def test_openai_client_streamed_chat_completion_with_usage(client):
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len("Hello there")


def test_openai_client_completion(client):
    completion = client.completions.create(model="fake-model", prompt="hi", max_tokens=3, seed=1)
    assert completion.choices[0].text == "Hel"
    assert completion.usage.prompt_tokens == 3


def test_openai_client_streamed_completion(client):
    stream = client.completions.create(model="fake-model", prompt=[5, 6, 7], stream=True)
    texts = [chunk.choices[0].text for chunk in stream]
    assert "".join(texts) == "Hello there"


def test_openai_client_raises_on_error_statuses(client, served):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="hi", suffix="tail")
    assert info.value.body["param"] == "suffix"


def test_openai_client_request_id_header_reaches_the_engine(client, served):
    _, engine = served
    response = client.completions.with_raw_response.create(
        model="fake-model", prompt="hi", max_tokens=1, extra_headers={"X-Request-Id": "client-trace-1"}
    )
    assert response.headers["x-request-id"] == "client-trace-1"
    assert engine.requests[-1].request_id == "client-trace-1"


def test_openai_client_sees_an_engine_failure_mid_stream_as_an_api_error(client, served):
    _, engine = served
    engine.error_after_tokens = 2
    try:
        with pytest.raises(openai.APIError, match="KV transfer failed"):
            list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                stream=True))
    finally:
        engine.error_after_tokens = None


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def stalling_engine(served):
    _, engine = served
    engine.stall_after_tokens = 2
    yield engine
    engine.stall_after_tokens = None


def test_closing_a_stream_early_over_tcp_aborts_the_engine_request(served, stalling_engine):
    base_url, _ = served
    body = {"model": "fake-model", "prompt": "hi", "stream": True}
    headers = {"X-Request-Id": "tcp-stream-1"}
    with httpx.stream("POST", f"{base_url}/completions", json=body, headers=headers, timeout=10) as response:
        first = next(response.iter_bytes())
        assert first.startswith(b"data: ")
    wait_for(lambda: "tcp-stream-1" in stalling_engine.aborted_ids)


def test_client_timeout_on_a_non_streaming_request_over_tcp_aborts_the_engine_request(served, stalling_engine):
    base_url, _ = served
    body = {"model": "fake-model", "prompt": "hi"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/completions", json=body, headers={"X-Request-Id": "tcp-plain-1"}, timeout=0.3)
    wait_for(lambda: "tcp-plain-1" in stalling_engine.aborted_ids)
