"""The one edge validation the proxy and the workers share: size, JSON depth, schema, bounds, before any work."""

from __future__ import annotations

import json

import pytest
from tests.server.fake_engine import FakeEngine, asgi_client, make_app

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import InvalidRequest, RequestTooLarge
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.json_text import check_json_depth
from pdserve.api.validation import MAX_REQUEST_ID_CHARS, check_request_id, parse_json_body, parse_request

LIMITS = LimitsConfig()


def nested_array(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


def rejected(schema, raw: bytes, limits: LimitsConfig = LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(schema, raw, limits)
    return caught.value


def test_a_20000_deep_array_is_a_400_not_a_crash():
    error = rejected(CompletionRequest, b'{"prompt": "hi", "user": ' + nested_array(20_000) + b"}")
    assert "nested deeper" in error.message


@pytest.mark.parametrize("depth, ok", [(31, True), (32, True), (33, False)])
def test_json_depth_limit_is_exact(depth, ok):
    value = json.loads(nested_array(depth))
    if ok:
        check_json_depth(value, 32)
    else:
        with pytest.raises(InvalidRequest):
            check_json_depth(value, 32)


def test_depth_counts_objects_and_arrays_alike():
    document = {"a": [{"b": [[1]]}]}  # depth 5
    check_json_depth(document, 5)
    with pytest.raises(InvalidRequest):
        check_json_depth(document, 4)


def test_an_ordinary_chat_body_is_well_within_the_depth():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "kv_transfer_params": {"remote_block_ids": [[1, 2]]}}
    assert parse_json_body(json.dumps(body).encode(), LIMITS) == body


def test_a_body_over_the_size_limit_is_a_413():
    with pytest.raises(RequestTooLarge):
        parse_json_body(completion(user="x" * 2000), LimitsConfig(max_body_bytes=1024))


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
                                 b'{"prompt": "a\\ud800b"}', b"\xff", b"", b"[1, 2]", b"1", b"null", b'"x"'])
def test_bodies_that_are_not_strict_json_objects_are_400s(raw):
    rejected(CompletionRequest, raw)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": "yes"}, "stream"),
])
def test_the_requests_a_prefill_leg_would_have_hidden_are_rejected_up_front(fields, param):
    assert rejected(CompletionRequest, completion(**fields)).param == param


def test_prompt_length_is_bounded_in_characters():
    limits = LimitsConfig(max_prompt_chars=10)
    parse_request(CompletionRequest, json.dumps({"prompt": "x" * 10}).encode(), limits)
    assert rejected(CompletionRequest, json.dumps({"prompt": "x" * 11}).encode(), limits).param == "prompt"
    assert rejected(CompletionRequest, json.dumps({"prompt": ["x" * 11]}).encode(), limits).param == "prompt"


def test_chat_bounds_count_messages_and_all_their_text():
    limits = LimitsConfig(max_prompt_chars=10, max_messages=3)
    message = {"role": "user", "content": "x" * 4}
    parse_request(ChatCompletionRequest, json.dumps({"messages": [message, message]}).encode(), limits)
    too_long = json.dumps({"messages": [message, message, message]}).encode()
    assert "characters" in rejected(ChatCompletionRequest, too_long, limits).message
    too_many = json.dumps({"messages": [{"role": "user", "content": ""}] * 4}).encode()
    assert rejected(ChatCompletionRequest, too_many, limits).param == "messages"
    parts = [{"type": "text", "text": "x" * 6}, {"type": "text", "text": "y" * 6}]
    assert rejected(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(),
                    limits).param == "messages"


@pytest.mark.parametrize("fields", [
    {"stop": ["s"] * 17},
    {"stop": "x" * 257},
    {"stop": ["ok", "x" * 257]},
    {"stop_token_ids": list(range(65))},
])
def test_stop_conditions_are_bounded(fields):
    assert rejected(CompletionRequest, completion(**fields)).param in ("stop", "stop_token_ids")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"prompt": [[1]] * 3, "n": 100}, "n"),
    ({"prompt": ["x" * 600_000, "y" * 600_000]}, "prompt"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ({"guided_choice": ["x" * 40_000, "y" * 40_000]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"enum": ["z" * 70_000]}}}},
     "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_batches_choices_logit_bias_and_constraints_are_bounded_by_default(fields, param):
    assert rejected(CompletionRequest, completion(**fields)).param == param


def test_the_default_bounds_still_take_a_full_batch_and_the_openai_maxima():
    parse_request(CompletionRequest, completion(prompt=["a"] * 256), LIMITS)
    parse_request(CompletionRequest, completion(prompt=["a", "b"], n=128, logprobs=5), LIMITS)
    parse_request(CompletionRequest, completion(logit_bias={str(i): 1.0 for i in range(1024)}), LIMITS)
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL] * 128, "top_logprobs": 20,
            "logprobs": True, "tool_choice": "required"}
    parse_request(ChatCompletionRequest, json.dumps(chat).encode(), LIMITS)


def test_tools_and_choices_follow_their_configured_bounds():
    limits = LimitsConfig(max_tools=2, max_choices=4)
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL] * 3}
    assert rejected(ChatCompletionRequest, json.dumps(chat).encode(), limits).param == "tools"
    assert rejected(ChatCompletionRequest, json.dumps({**chat, "tools": [TOOL], "n": 5}).encode(), limits).param == "n"
    assert rejected(CompletionRequest, completion(prompt=["a", "b"], n=3), limits).param == "n"
    parse_request(CompletionRequest, completion(prompt=["a", "b"], n=2), limits)


def test_a_constraint_a_decode_worker_would_refuse_is_refused_by_validation():
    chat = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}
    assert rejected(ChatCompletionRequest, json.dumps(chat).encode()).param == "tool_choice"


def test_request_ids_up_to_240_printable_characters_pass():
    check_request_id("a" * MAX_REQUEST_ID_CHARS)
    for bad in ("a" * (MAX_REQUEST_ID_CHARS + 1), "has space", "tab\t", "é"):
        with pytest.raises(InvalidRequest):
            check_request_id(bad)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_worker_rejects_an_oversized_prompt_before_tokenizing_it(anyio_backend):
    engine = FakeEngine()
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *args, **kwargs: calls.append(args) or encode(*args, **kwargs)
    app = make_app(engine, limits=LimitsConfig(max_prompt_chars=100))
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x" * 101})
        deep = await client.post("/v1/completions", content=b'{"prompt": "x", "user": ' + nested_array(20_000) + b"}")
        large = await client.post("/v1/completions", content=completion(user="y" * (9 << 20)))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert deep.status_code == 400 and "nested deeper" in deep.json()["error"]["message"]
    assert large.status_code == 413 and large.json()["error"]["code"] == 413
    assert calls == [] and engine.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_prefill_leg_whose_decode_leg_would_not_fit_is_refused_before_computing(anyio_backend):
    engine = FakeEngine(max_model_len=128)
    leg = {"prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    async with asgi_client(make_app(engine)) as client:
        too_long = await client.post("/v1/completions", json={
            **leg, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 200}})
        too_many_min = await client.post("/v1/completions", json={
            **leg, "kv_transfer_params": {"do_remote_decode": True, "decode_min_tokens": 125}})
        fits = await client.post("/v1/completions", json={
            **leg, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 100, "decode_min_tokens": 5}})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert too_many_min.status_code == 400 and too_many_min.json()["error"]["param"] == "min_tokens"
    assert fits.status_code == 200
    assert len(engine.requests) == 1


# ---- converted once, at the edge: nothing a later int() or json parse can trip over ----------------

HOSTILE_FIELDS = {
    "a superscript digit as a logit_bias key (str.isdigit() says yes, int() raises)": ({"logit_bias": {"²": 1}},
                                                                                     "logit_bias"),
    "an Arabic-Indic digit as a logit_bias key": ({"logit_bias": {"٣": 1}}, "logit_bias"),
    "a 5,000-digit logit_bias key (past int()'s digit limit)": ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    "a logit_bias key past int32": ({"logit_bias": {str(2**31): 1}}, "logit_bias"),
    "a guided_json string nested 3,000 deep (past the recursive parser)": (
        {"guided_json": "[" * 3000 + "]" * 3000}, "guided_json"),
    "a guided_json string with NaN": ({"guided_json": '{"type": NaN}'}, "guided_json"),
}


@pytest.mark.parametrize("fields, param", HOSTILE_FIELDS.values(), ids=list(HOSTILE_FIELDS))
def test_fields_a_later_step_would_convert_are_400s_at_validation(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        request = parse_request(CompletionRequest, completion(**fields), LIMITS)
        request.output_constraint()  # what the proxy and the workers ask of every request
    assert caught.value.param == param


def test_logit_bias_is_parsed_once_into_the_pairs_the_engine_uses():
    request = parse_request(CompletionRequest, completion(logit_bias={"12": 1.5, "0": -100, "2147483647": 3}), LIMITS)
    assert request.logit_bias_pairs() == ((12, 1.5), (0, -100.0), (2147483647, 3.0))


def test_a_guided_json_schema_string_is_parsed_with_the_body_depth_bound():
    nested = {"type": "object", "properties": {"a": {"type": "string"}}}
    request = parse_request(CompletionRequest, completion(guided_json=json.dumps(nested)), LIMITS)
    assert request.output_constraint().schema == nested


def test_tool_call_arguments_too_deep_to_parse_stay_text():
    deep = "[" * 3000 + "]" * 3000
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                         {"role": "user", "content": "again"}]}
    request = parse_request(ChatCompletionRequest, json.dumps(chat).encode(), LIMITS)
    arguments = request.template_messages()[1]["tool_calls"][0]["function"]["arguments"]
    assert arguments == deep
    shallow = {**chat, "messages": [chat["messages"][0], {**chat["messages"][1], "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}]}]}
    request = parse_request(ChatCompletionRequest, json.dumps(shallow).encode(), LIMITS)
    assert request.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == {"x": [1]}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_worker_answers_each_hostile_field_with_a_400_and_computes_nothing(anyio_backend):
    engine = FakeEngine()
    async with asgi_client(make_app(engine)) as client:
        for fields, param in HOSTILE_FIELDS.values():
            response = await client.post("/v1/completions", json={"prompt": "hi", **fields})
            assert response.status_code == 400, (fields, response.text)
            assert response.json()["error"]["param"] == param
        good = await client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"3": 2}})
    assert good.status_code == 200
    assert len(engine.requests) == 1


# ---- a bound on the answer's size, not only on the request's -------------------------------------

def test_an_answer_that_could_hold_too_many_token_entries_is_refused_where_max_tokens_is_known():
    # 100 answers x 10,000 tokens x (1 + 5 alternatives) = 6M entries: past the default 4M (2^22)
    assert rejected(CompletionRequest, completion(n=100, max_tokens=10_000, logprobs=5)).param == "max_tokens"
    parse_request(CompletionRequest, completion(n=100, max_tokens=10_000), LIMITS)  # 1M: fine
    two_prompts = completion(prompt=["a", "b"], max_tokens=100, logprobs=4)  # 2 x 100 x 5 = 1,000 entries
    assert rejected(CompletionRequest, two_prompts, LimitsConfig(max_output_entries=999)).param == "max_tokens"
    parse_request(CompletionRequest, two_prompts, LimitsConfig(max_output_entries=1000))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_worker_bounds_the_answer_with_the_rest_of_the_context_and_echoed_logprobs(anyio_backend):
    engine = FakeEngine()  # a 128-token context; "hi" is 3 tokens with BOS
    app = make_app(engine, limits=LimitsConfig(max_output_entries=600))
    async with asgi_client(app) as client:
        # no max_tokens: the rest of the context, 125 tokens, times n = 5 -> 625 entries
        rest = await client.post("/v1/completions", json={"prompt": "hi", "n": 5})
        fits = await client.post("/v1/completions", json={"prompt": "hi", "n": 4})  # 500
        # echoed prompt logprobs count too: 51 prompt tokens x (1 + 5) + 1 x (1 + 5) = 312 an answer
        long_prompt = {"prompt": "x" * 50, "max_tokens": 1, "logprobs": 5}
        echo = await client.post("/v1/completions", json={**long_prompt, "n": 2, "echo": True})  # 624
        no_echo = await client.post("/v1/completions", json={**long_prompt, "n": 2})  # 12
    assert rest.status_code == 400 and rest.json()["error"]["param"] == "max_tokens"
    assert fits.status_code == 200
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "max_tokens"
    assert no_echo.status_code == 200
    assert len(engine.requests) == 4 + 2  # only the answers of the requests that fit
