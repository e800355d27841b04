"""What the proxy reads from a client's body, and the two legs' bodies built from it."""

from __future__ import annotations

import json

import pytest

from proxy.client_request import (
    CHAT_TOKENS_PER_MESSAGE, REMOTE_DECODE_PARAMS, choose_request_id, decode_body, estimate_text_tokens,
    parse_client_request, prefill_body,
)
from proxy.errors import RejectedRequest


def parse(path: str, body: object, chars_per_token: float = 4.0):
    return parse_client_request(path, json.dumps(body).encode(), "rid", chars_per_token)


def test_client_kv_transfer_params_are_dropped():
    request = parse("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"remote_host": "evil"}})
    assert "kv_transfer_params" not in request.body
    assert json.loads(decode_body(request.body, None)) == {"prompt": "hi"}


def test_prefill_body_never_streams_and_asks_for_one_token():
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3,
            "max_tokens": 50, "max_completion_tokens": 40, "temperature": 0.7}
    request = parse("/v1/completions", body)
    leg = json.loads(prefill_body(request))
    # The decode leg's token budget rides along, so the prefill worker can refuse what decode would.
    assert leg == {"prompt": "hi", "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                   "temperature": 0.7, "kv_transfer_params": {**REMOTE_DECODE_PARAMS, "decode_max_tokens": 40,
                                                              "decode_min_tokens": 3}}
    assert request.body["stream"] is True  # the client's body is left alone for the decode leg


def test_max_completion_tokens_is_added_to_prefill_only_when_present():
    leg = json.loads(prefill_body(parse("/v1/completions", {"prompt": "hi"})))
    assert "max_completion_tokens" not in leg and leg["kv_transfer_params"] == REMOTE_DECODE_PARAMS


def test_decode_body_carries_prefill_params_verbatim():
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [3]], "remote_epoch": "e1"}
    assert json.loads(decode_body({"prompt": "hi", "stream": True}, params)) == {
        "prompt": "hi", "stream": True, "kv_transfer_params": params}


def test_text_prompt_size_is_estimated_from_characters():
    assert estimate_text_tokens("a" * 10, 4.0) == 3
    assert parse("/v1/completions", {"prompt": "x" * 40}, chars_per_token=2.0).num_prompt_tokens == 20


def test_token_id_prompts_are_counted_exactly():
    assert parse("/v1/completions", {"prompt": [1, 2, 3, 4, 5]}).num_prompt_tokens == 5
    assert parse("/v1/completions", {"prompt": [[7, 8]]}).num_prompt_tokens == 2


def test_chat_estimate_adds_per_message_template_overhead():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    request = parse("/v1/chat/completions", {"messages": messages})
    assert "be brief" in request.prompt_text and "hi" in request.prompt_text
    assert request.num_prompt_tokens >= 2 * CHAT_TOKENS_PER_MESSAGE


def test_prefix_key_is_the_leading_characters():
    request = parse("/v1/completions", {"prompt": "abcdef"})
    assert request.prefix_key(3) == b"abc"


def test_stream_flag_is_read_strictly():
    assert parse("/v1/completions", {"prompt": "x", "stream": True}).stream is True
    with pytest.raises(RejectedRequest) as caught:
        parse("/v1/completions", {"prompt": "x", "stream": "yes"})
    assert (caught.value.status_code, caught.value.param) == (400, "stream")


@pytest.mark.parametrize("raw", [b"{oops", b"[1, 2]", b"\xff\xfe", b'{"prompt": "x", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}"])
def test_non_object_invalid_or_too_deep_json_is_a_400(raw):
    with pytest.raises(RejectedRequest) as caught:
        parse_client_request("/v1/completions", raw, "rid", 4.0)
    assert caught.value.status_code == 400 and caught.value.error_type == "invalid_request_error"


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
                                  {"prompt": "x", "stream_options": {"include_usage": True}},
                                  {"messages": []}, {"prompt": "x", "stop": ["s"] * 17}])
def test_requests_a_worker_would_refuse_are_refused_by_the_proxy_alike(body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with pytest.raises(RejectedRequest) as caught:
        parse(path, body)
    assert caught.value.status_code == 400


def test_request_id_is_kept_when_valid_fresh_when_absent_and_refused_when_a_worker_would():
    assert choose_request_id("abc-1") == "abc-1"
    assert choose_request_id("x" * 240) == "x" * 240
    for absent in (None, ""):
        assert len(choose_request_id(absent)) == 32
    for bad in ("has space", "x" * 241):
        with pytest.raises(RejectedRequest) as caught:
            choose_request_id(bad)
        assert caught.value.status_code == 400 and caught.value.param == "X-Request-Id"


@pytest.mark.parametrize("body, local", [
    ({"prompt": ["a", "b"]}, True),
    ({"prompt": [[1, 2], [3]]}, True),
    ({"prompt": ["a"]}, False),
    ({"prompt": [1, 2, 3]}, False),
    ({"prompt": "a", "echo": True, "logprobs": 0}, True),
    ({"prompt": "a", "echo": True}, False),
    ({"prompt": "a", "logprobs": 2, "n": 3}, False),
])
def test_batches_and_echoed_logprobs_are_computed_by_the_decode_worker(body, local):
    request = parse_client_request("/v1/completions", json.dumps(body).encode(), "r", 4.0)
    assert request.needs_local_prompt is local
