"""What the proxy reads from a client's body, and the two legs' bodies built from it."""

from __future__ import annotations

import json

import pytest

from proxy.client_request import (
    CHAT_TOKENS_PER_MESSAGE, REMOTE_DECODE_PARAMS, choose_request_id, decode_body, estimate_text_tokens,
    parse_client_request, prefill_body,
)
from proxy.errors import InvalidClientRequest


def parse(path: str, body: object, chars_per_token: float = 4.0):
    return parse_client_request(path, json.dumps(body).encode(), "rid", chars_per_token)


def test_client_kv_transfer_params_are_dropped():
    request = parse("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"remote_host": "evil"}})
    assert "kv_transfer_params" not in request.body
    assert json.loads(decode_body(request.body, None)) == {"prompt": "hi"}


def test_prefill_body_never_streams_and_asks_for_one_token():
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3,
            "max_tokens": 50, "max_completion_tokens": 50, "temperature": 0.7}
    leg = json.loads(prefill_body(body))
    assert leg == {"prompt": "hi", "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                   "temperature": 0.7, "kv_transfer_params": REMOTE_DECODE_PARAMS}
    assert body["stream"] is True  # the client's body is left alone for the decode leg


def test_max_completion_tokens_is_added_to_prefill_only_when_present():
    assert "max_completion_tokens" not in json.loads(prefill_body({"prompt": "hi"}))


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
    assert parse("/v1/completions", {"prompt": "x", "stream": "yes"}).stream is False


@pytest.mark.parametrize("raw", [b"{oops", b"[1, 2]", b"\xff\xfe"])
def test_non_object_or_invalid_json_is_rejected(raw):
    with pytest.raises(InvalidClientRequest):
        parse_client_request("/v1/completions", raw, "rid", 4.0)


def test_request_id_is_kept_when_valid_and_replaced_otherwise():
    assert choose_request_id("abc-1") == "abc-1"
    for bad in (None, "", "has space", "x" * 300):
        fresh = choose_request_id(bad)
        assert fresh != bad and len(fresh) == 32


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
