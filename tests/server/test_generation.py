"""Completions and chat completions through the real app and a fake engine: JSON and SSE answers."""

from __future__ import annotations

import httpx
import pytest

from pdserve.api.kv_transfer import RemoteDecodeRequest, RemotePrefillParams
from tests.server.fake_engine import BOS_ID, FakeEngine, FakeTokenizer, asgi_client, make_app, sse_payloads

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the server and the fake engine use asyncio primitives

CHAT_BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def post(engine: FakeEngine, path: str, body: dict, headers: dict | None = None):
    async with asgi_client(make_app(engine)) as client:
        return await client.post(path, json=body, headers=headers)


async def test_completion_returns_the_engine_text_usage_and_finish_reason():
    engine = FakeEngine(reply="Hello world")
    response = await post(engine, "/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"] == f"cmpl-{engine.requests[0].request_id}"
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 8
    assert "kv_transfer_params" not in body


async def test_completion_prompt_is_tokenized_with_special_tokens_and_sampling_passed_on():
    engine = FakeEngine()
    await post(engine, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0, "stop": ["x"], "seed": 7})
    request = engine.requests[0]
    assert request.prompt_token_ids == tuple(FakeTokenizer().encode("hi"))
    assert request.prompt_token_ids[0] == BOS_ID
    assert (request.sampling.max_tokens, request.sampling.temperature) == (4, 0.0)
    assert (request.sampling.stop, request.sampling.seed) == (("x",), 7)


async def test_completion_without_max_tokens_may_use_the_rest_of_the_context():
    engine = FakeEngine(max_model_len=50)
    await post(engine, "/v1/completions", {"prompt": [5, 6, 7]})
    assert engine.requests[0].prompt_token_ids == (5, 6, 7)
    assert engine.requests[0].sampling.max_tokens == 47


async def test_stop_token_ends_the_reply_with_stop():
    engine = FakeEngine(reply="abc")
    stop_id = FakeTokenizer().encode("b", add_special_tokens=False)[0]
    response = await post(engine, "/v1/completions", {"prompt": "x", "stop_token_ids": [stop_id]})
    assert response.json()["choices"][0]["text"] == "ab"
    assert response.json()["choices"][0]["finish_reason"] == "stop"


async def test_completion_logprobs_zero_returns_the_sampled_tokens_logprobs():
    response = await post(FakeEngine(reply="abc"), "/v1/completions", {"prompt": "x", "logprobs": 0})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.25, -0.25, -0.25]
    assert logprobs["text_offset"] == [0, 1, 2]


async def test_kv_transfer_params_are_parsed_at_the_edge_and_come_back_top_level():
    sent = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    returned = RemotePrefillParams(
        do_remote_prefill=True, remote_engine_id="p0", remote_request_id="r", remote_block_ids=[[1, 2]],
        remote_host="127.0.0.1", remote_port=8100, remote_epoch="e1", num_prompt_tokens=3, lease_s=30.0)
    engine = FakeEngine(kv_transfer_params_out=returned)
    response = await post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 1, "kv_transfer_params": sent})
    assert engine.requests[0].kv_params == RemoteDecodeRequest(do_remote_decode=True)
    assert response.json()["kv_transfer_params"] == returned.to_wire()


async def test_chat_applies_the_template_and_answers_as_assistant():
    engine = FakeEngine(reply="Hi!", num_cached_tokens=4)
    response = await post(engine, "/v1/chat/completions", {**CHAT_BODY, "max_completion_tokens": 10})
    assert response.status_code == 200
    body = response.json()
    template = FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert engine.requests[0].prompt_token_ids == tuple(FakeTokenizer().encode(template, add_special_tokens=False))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


async def test_chat_logprobs_list_each_sampled_token():
    response = await post(FakeEngine(reply="ok"), "/v1/chat/completions", {**CHAT_BODY, "logprobs": True})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"], t["bytes"]) for t in content] == [("o", -0.25, [111]), ("k", -0.25, [107])]


async def test_streamed_completion_sends_text_chunks_then_done():
    response = await post(FakeEngine(reply="abc"), "/v1/completions", {"prompt": "x", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks)


async def test_streamed_chat_announces_the_role_and_reports_usage_when_asked():
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2}
    response = await post(FakeEngine(reply="abc"), "/v1/chat/completions", body)
    payloads = sse_payloads(response.text)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["choices"][0]["delta"]["content"] for p in payloads[1:3]] == ["a", "b"]
    assert payloads[2]["choices"][0]["finish_reason"] == "length"
    usage_chunk = payloads[3]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 2
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 2
    assert payloads[4] == "[DONE]"
    assert all(p["object"] == "chat.completion.chunk" for p in payloads[:4])


async def test_streamed_chat_without_include_usage_has_no_usage_chunk():
    response = await post(FakeEngine(reply="ab"), "/v1/chat/completions", {**CHAT_BODY, "stream": True})
    payloads = sse_payloads(response.text)
    assert all(p["usage"] is None for p in payloads[:-1])
    assert all(p["choices"] for p in payloads[:-1])


async def test_engine_error_output_becomes_a_500_with_the_engine_message():
    engine = FakeEngine(error_after_tokens=0, error_message="KV pull from p0 failed")
    response = await post(engine, "/v1/completions", {"prompt": "x"})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "KV pull from p0 failed"
    assert response.json()["error"]["type"] == "internal_error"


async def test_engine_error_mid_stream_ends_the_stream_with_an_error_event():
    engine = FakeEngine(reply="abcdef", error_after_tokens=2, error_message="decode failed")
    response = await post(engine, "/v1/chat/completions", {**CHAT_BODY, "stream": True})
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-2] == {"error": {"message": "decode failed", "type": "internal_error", "param": None, "code": 500}}
    assert payloads[-1] == "[DONE]"
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-2]) == "ab"


async def test_finished_requests_are_not_counted_as_aborted():
    engine = FakeEngine(reply="ab")
    await post(engine, "/v1/completions", {"prompt": "x"})
    await post(engine, "/v1/completions", {"prompt": "x", "stream": True})
    assert engine.aborted_ids == []
    assert len(engine.finished_ids) == 2


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT_BODY)])
async def test_an_exception_escaping_below_the_http_layer_is_a_logged_500_with_the_request_id(path, body, caplog):
    """Our bug, not the client's: a plain 500 (streamed: an error event, then [DONE]); the log names
    the request id; the request is aborted and its id freed."""
    for stream in (False, True):
        engine = FakeEngine(reply="abcdef", crash_after_tokens=2)
        caplog.clear()
        # Starlette re-raises after the 500 is sent (for the server's log): let the transport swallow it.
        transport = httpx.ASGITransport(app=make_app(engine), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pdserve.test") as client:
            response = await client.post(path, json={**body, "stream": stream}, headers={"X-Request-Id": f"bug-{stream}"})
        expected_error = {"message": "internal server error", "type": "internal_error", "param": None, "code": 500}
        if stream:
            assert response.status_code == 200
            payloads = sse_payloads(response.text)
            assert payloads[-2] == {"error": expected_error} and payloads[-1] == "[DONE]"
        else:
            assert response.status_code == 500 and response.json() == {"error": expected_error}
            assert response.headers["x-request-id"] == "bug-False"
        failures = [r for r in caplog.records if r.levelname == "ERROR" and f"bug-{stream}" in r.getMessage()]
        assert failures and failures[0].exc_info is not None, [r.getMessage() for r in caplog.records]
        assert engine.aborted_ids and len(engine.request_ids) == 0
