"""n > 1, batched prompts, tokenizer endpoints and tool-call answers through the real app and a fake engine."""

from __future__ import annotations

import json

import pytest

from tests.server.fake_engine import FakeEngine, FakeTokenizer, asgi_client, make_app, sse_payloads

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def post(engine: FakeEngine, path: str, body: dict):
    app = make_app(engine)
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    assert len(app.state.serving.request_ids) == 0, "every choice's id is released"
    return response


async def test_batched_prompts_answer_one_choice_each_in_order_with_summed_usage():
    engine = FakeEngine(reply="ok")
    response = await post(engine, "/v1/completions", {"prompt": ["a", "bcd"], "max_tokens": 5, "n": 2})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    by_id = {r.request_id: r.prompt_token_ids for r in engine.requests}
    assert sorted(by_id.values()) == sorted([tuple(FakeTokenizer().encode("a"))] * 2 + [tuple(FakeTokenizer().encode("bcd"))] * 2)
    assert body["usage"]["prompt_tokens"] == 2 + 4 and body["usage"]["completion_tokens"] == 4 * 2
    ids = await post(FakeEngine(reply="ok"), "/v1/completions", {"prompt": [[7, 8], [9]], "max_tokens": 5})
    assert ids.json()["usage"]["prompt_tokens"] == 3
    mixed = await post(FakeEngine(), "/v1/completions", {"prompt": ["a", [7]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"


async def test_n_choices_have_their_own_seeds_and_ids_and_count_every_token():
    engine = FakeEngine(reply="ok")
    response = await post(engine, "/v1/completions", {"prompt": "x", "n": 3, "seed": 10, "max_tokens": 5})
    body = response.json()
    assert [c["text"] for c in body["choices"]] == ["ok"] * 3
    assert sorted(r.sampling.seed for r in engine.requests) == [10, 11, 12]
    assert len({r.request_id for r in engine.requests}) == 3
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_siblings_start_after_their_leaders_first_output():
    engine = FakeEngine(reply="abc", token_delay_s=0.01)
    await post(engine, "/v1/completions", {"prompt": [["x"], "y"][1], "n": 2})
    leader, sibling = engine.requests
    assert leader.request_id != sibling.request_id and sibling.sampling.prompt_logprobs is None


async def test_streamed_choices_carry_their_index_and_one_usage_chunk():
    engine = FakeEngine(reply="ab")
    response = await post(engine, "/v1/chat/completions", {"messages": USER, "n": 2, "stream": True,
                                                            "stream_options": {"include_usage": True}})
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    for index in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == index)
        assert text == "ab"
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_a_failing_choice_fails_the_request_and_aborts_the_others():
    engine = FakeEngine(reply="abcdef", error_after_tokens=2, token_delay_s=0.01)
    response = await post(engine, "/v1/completions", {"prompt": "x", "n": 3})
    assert response.status_code == 500
    assert not set(engine.requests and [r.request_id for r in engine.requests]) - set(
        engine.finished_ids + engine.aborted_ids)


async def test_tokenizer_endpoints_keep_the_request_bounds():
    from pdserve.api.config import LimitsConfig

    app = make_app(FakeEngine(), limits=LimitsConfig(max_prompt_chars=10, max_messages=1, max_body_bytes=1024))
    async with asgi_client(app) as client:
        long_prompt = await client.post("/tokenize", json={"prompt": "x" * 11})
        many_messages = await client.post("/tokenize", json={"messages": USER * 2})
        large = await client.post("/detokenize", json={"tokens": [1] * 600})
        fits = await client.post("/tokenize", json={"prompt": "x" * 10})
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    assert many_messages.status_code == 400 and many_messages.json()["error"]["param"] == "messages"
    assert large.status_code == 413
    assert fits.status_code == 200


async def test_tokenize_and_detokenize_round_trip():
    engine = FakeEngine()
    app = make_app(engine)
    async with asgi_client(app) as client:
        tokens = (await client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True})).json()
        chat = (await client.post("/tokenize", json={"messages": USER})).json()
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        bad = await client.post("/detokenize", json={"tokens": [999]})
        both = await client.post("/tokenize", json={"prompt": "x", "messages": USER})
    assert tokens["tokens"] == FakeTokenizer().encode("hé") and tokens["count"] == 4
    assert tokens["max_model_len"] == engine.max_model_len and len(tokens["token_strs"]) == 4
    expected_chat = FakeTokenizer().encode(FakeTokenizer().apply_chat_template(USER), add_special_tokens=False)
    assert chat["tokens"] == expected_chat
    assert text == {"prompt": "hé"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert both.status_code == 400


async def test_named_tool_choice_answers_with_a_call_streamed_as_argument_deltas():
    engine = FakeEngine(reply='{"city": "Paris"}')
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = (await post(engine, "/v1/chat/completions", body)).json()["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "stop"
    call = whole["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"]
    assert engine.requests[0].sampling.grammar  # the grammar forces the call
    streamed = sse_payloads((await post(engine, "/v1/chat/completions", {**body, "stream": True})).text)[:-1]
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in streamed if c["choices"][0]["delta"].get("tool_calls")]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert all("name" not in d["function"] for d in deltas[1:])


async def test_required_tool_choice_returns_every_call_with_finish_reason_tool_calls():
    reply = json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}}])
    engine = FakeEngine(reply=reply)
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "stream": True}
    streamed = sse_payloads((await post(engine, "/v1/chat/completions", body)).text)[:-1]
    final = streamed[-1]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    call = final["delta"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert not any(c["choices"][0]["delta"].get("content") for c in streamed)


async def test_auto_tool_choice_parses_the_templates_native_format_and_streams_the_content_before_it():
    engine = FakeEngine(reply='Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    engine.tokenizer.chat_template = "{{ '<tool_call>' }}"  # a Hermes-style template
    body = {"messages": USER, "tools": [WEATHER]}
    whole = (await post(engine, "/v1/chat/completions", body)).json()["choices"][0]
    assert whole["message"]["content"] == "Let me check." and whole["finish_reason"] == "tool_calls"
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert engine.requests[0].sampling.grammar is None  # auto never forces anything
    streamed = sse_payloads((await post(engine, "/v1/chat/completions", {**body, "stream": True})).text)[:-1]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed)
    assert content == "Let me check."
    assert streamed[-1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


REMOTE_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
                 "remote_request_id": "r", "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1",
                 "remote_port": 8100, "remote_epoch": "e1", "num_prompt_tokens": 3, "lease_s": 30.0,
                 "remote_pin_nonce": "0" * 32}


async def test_a_prefill_leg_computes_one_choice_without_a_grammar_whatever_n():
    engine = FakeEngine(reply="ok")
    body = {"messages": USER, "n": 3, "max_tokens": 1, "tools": [WEATHER], "tool_choice": "required",
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    response = await post(engine, "/v1/chat/completions", body)
    assert response.status_code == 200 and len(engine.requests) == 1
    assert engine.requests[0].sampling.grammar is None


async def test_a_decode_worker_refuses_echoed_logprobs_of_a_prompt_it_did_not_compute():
    engine = FakeEngine()
    body = {"prompt": "x", "echo": True, "logprobs": 1, "kv_transfer_params": REMOTE_PARAMS}
    response = await post(engine, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    batched = await post(engine, "/v1/completions", {"prompt": ["a", "b"], "kv_transfer_params": REMOTE_PARAMS})
    assert batched.status_code == 400 and batched.json()["error"]["param"] == "prompt"
    assert engine.requests == []
