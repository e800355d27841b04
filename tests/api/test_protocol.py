"""Wire schemas: strict validation of known fields, rejection of unsupported features, mapping to SamplingParams."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.api.errors import ContextLengthExceeded, InvalidRequest
from pdserve.api.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    CompletionResponse,
    openai_finish_reason,
    to_sampling_params,
)
from pdserve.api.sampling import FinishReason, SamplingParams


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_sampling_defaults_to_temperature_one_and_the_rest_of_the_context():
    params = to_sampling_params(completion(), num_prompt_tokens=10, max_model_len=100)
    assert params == SamplingParams(max_tokens=90, temperature=1.0, top_p=1.0, top_k=0)


def test_sampling_maps_every_supported_field():
    request = completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=40, seed=3, stop="END", stop_token_ids=[5, 6],
        ignore_eos=True, min_tokens=2, logprobs=0,
    )
    params = to_sampling_params(request, num_prompt_tokens=3, max_model_len=100)
    assert params == SamplingParams(
        max_tokens=7, temperature=0.0, top_p=0.5, top_k=40, seed=3, stop=("END",), stop_token_ids=(5, 6),
        ignore_eos=True, min_tokens=2, logprobs=True,
    )
    assert params.greedy


def test_max_completion_tokens_wins_over_max_tokens():
    params = to_sampling_params(chat(max_tokens=50, max_completion_tokens=5), num_prompt_tokens=1, max_model_len=100)
    assert params.max_tokens == 5


def test_top_k_minus_one_means_disabled():
    assert to_sampling_params(completion(top_k=-1), num_prompt_tokens=1, max_model_len=10).top_k == 0


def test_chat_logprobs_flag_requests_sampled_token_logprobs():
    params = to_sampling_params(chat(logprobs=True, top_logprobs=0), num_prompt_tokens=1, max_model_len=10)
    assert params.logprobs


def test_unknown_fields_are_ignored():
    request = completion(frobnicate=True, metadata={"a": 1}, repetition_penalty=1.1)
    assert request.prompt == "hi"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"seed": 2**64}, "seed"),
        ({"kv_transfer_params": [1]}, "kv_transfer_params"),
    ],
)
def test_wrong_types_and_ranges_fail_validation_on_their_field(fields, param):
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    assert info.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"x5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ],
)
def test_unsupported_completion_features_are_rejected(fields, param):
    with pytest.raises(InvalidRequest) as info:
        completion(**fields)
    assert info.value.param == param


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ],
)
def test_unsupported_chat_combinations_are_rejected(fields, param):
    with pytest.raises(InvalidRequest) as info:
        chat(**fields).output_constraint()
    assert info.value.param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_conflicting_or_malformed_completion_constraints_are_rejected(fields, param):
    with pytest.raises(InvalidRequest) as info:
        completion(**fields).output_constraint()
    assert info.value.param == param


def test_chat_constraints_name_their_source():
    assert chat(tools=[TOOL], tool_choice="required").output_constraint().param == "tool_choice"
    assert chat(tools=[TOOL], tool_choice="auto").output_constraint() is None
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}).output_constraint()
    assert (named.kind, named.schema) == ("tool_call", {"type": "object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constraint = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert constraint.output_constraint().schema == schema


def test_neutral_values_of_unsupported_features_are_accepted():
    request = completion(n=1, echo=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, best_of=1)
    assert request.n == 1
    assert chat(tools=[], response_format={"type": "text"}, top_logprobs=0).tools == []


def test_sampling_features_map_to_sampling_params():
    request = completion(n=3, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                         logit_bias={"5": 2.5}, logprobs=3, echo=True)
    params = to_sampling_params(request, num_prompt_tokens=4, max_model_len=64)
    assert request.num_choices == 3
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.2)
    assert params.logit_bias == ((5, 2.5),) and params.has_penalties
    assert (params.logprobs, params.top_logprobs, params.prompt_logprobs) == (True, 3, 3)
    chat_params = to_sampling_params(chat(logprobs=True, top_logprobs=4), num_prompt_tokens=4, max_model_len=64)
    assert (chat_params.top_logprobs, chat_params.prompt_logprobs) == (4, None)


@pytest.mark.parametrize(
    "prompt, expected",
    [("abc", ["abc"]), (["abc"], ["abc"]), ([5, 6], [[5, 6]]), ([[5, 6]], [[5, 6]]),
     (["a", "b"], ["a", "b"]), ([[5], [6, 7]], [[5], [6, 7]])],
)
def test_prompt_forms_resolve_to_a_list_of_prompts(prompt, expected):
    assert completion(prompt=prompt).prompt_inputs() == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], ["a", ""]])
def test_empty_prompt_is_rejected(prompt):
    with pytest.raises(InvalidRequest, match="must not be empty"):
        completion(prompt=prompt).prompt_inputs()


def test_chat_requires_at_least_one_message():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json('{"messages": []}')
    assert info.value.errors()[0]["loc"] == ("messages",)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "function", "content": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"role": "user", "content": 5},
    ],
)
def test_unsupported_chat_messages_fail_validation(message):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(json.dumps({"messages": [message]}))


def test_chat_messages_become_template_dicts():
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_prompt_plus_max_tokens_may_fill_the_context_exactly():
    assert to_sampling_params(completion(max_tokens=6), num_prompt_tokens=4, max_model_len=10).max_tokens == 6


def test_prompt_plus_max_tokens_over_the_context_is_rejected_with_the_numbers():
    with pytest.raises(ContextLengthExceeded) as info:
        to_sampling_params(completion(max_tokens=7), num_prompt_tokens=4, max_model_len=10)
    assert info.value.param == "max_tokens"
    assert "10 tokens" in info.value.message and "at most 6" in info.value.message


@pytest.mark.parametrize("num_prompt_tokens", [10, 11])
def test_prompt_that_leaves_no_room_is_rejected(num_prompt_tokens):
    with pytest.raises(ContextLengthExceeded) as info:
        to_sampling_params(chat(), num_prompt_tokens=num_prompt_tokens, max_model_len=10, prompt_param="messages")
    assert info.value.param == "messages"
    assert f"has {num_prompt_tokens} tokens" in info.value.message


def test_min_tokens_over_remaining_context_is_rejected():
    with pytest.raises(InvalidRequest):
        to_sampling_params(completion(min_tokens=8), num_prompt_tokens=4, max_model_len=10)


def test_kv_transfer_params_appear_in_responses_only_when_set():
    response = CompletionResponse(id="c", created=1, model="m", choices=[])
    assert "kv_transfer_params" not in response.model_dump()
    with_params = CompletionResponse(id="c", created=1, model="m", choices=[], kv_transfer_params={"a": 1})
    assert json.loads(with_params.model_dump_json())["kv_transfer_params"] == {"a": 1}


def test_chat_delta_omits_absent_fields():
    assert ChatDelta(content="x").model_dump() == {"content": "x"}
    assert ChatDelta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


def test_finish_reasons_map_to_openai_names():
    assert openai_finish_reason(FinishReason.STOP) == "stop"
    assert openai_finish_reason(FinishReason.LENGTH) == "length"
    assert openai_finish_reason(None) is None
