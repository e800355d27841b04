"""Every issue-11 feature through the official openai client, streamed and not, as checks run against
both a colocated `pdserve serve` (test_openai_serve.py) and `pdserve up`'s proxy over P/D
(test_proxy_cluster.py). Tiny max_tokens: this runs in CI on two cores."""

from __future__ import annotations

import json
from typing import Callable

import httpx
import jsonschema
import openai

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Name a fruit."}]
SCHEMA = {
    "type": "object",
    "properties": {"fruit": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9},
                   "colors": {"type": "array", "items": {"enum": ["red", "green", "yellow"]}, "maxItems": 2}},
    "required": ["fruit", "count", "colors"], "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "buy", "parameters": {"type": "object", "properties": {"item": {"type": "string", "maxLength": 10},
                                                                   "qty": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
                                  "required": ["item", "qty"], "additionalProperties": False}}}


def _stream_texts(stream) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = getattr(choice, "text", None)
            if piece is None:
                piece = choice.delta.content or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts, chunks


def check_n_choices(client: openai.OpenAI, base_url: str) -> None:
    one = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    three = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, n=3)
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    texts, chunks = _stream_texts(client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    assert chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens


def check_batched_prompts_logprobs_and_echo(client: openai.OpenAI, base_url: str) -> None:
    prompts = ["The sky is", "Two plus two is"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, logprobs=2)
    assert [c.index for c in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert choice.text == alone.choices[0].text
        assert len(choice.logprobs.tokens) == 3 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2, temperature=0, echo=True,
                                     logprobs=1)
    choice = echo.choices[0]
    assert choice.text.startswith(prompts[0]) and choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    texts, chunks = _stream_texts(client.completions.create(model=MODEL, prompt=prompts, max_tokens=3,
                                                            temperature=0, logprobs=2, stream=True))
    assert texts == {0: batch.choices[0].text, 1: batch.choices[1].text}
    streamed = {0: [], 1: []}
    for chunk in chunks:
        for piece in chunk.choices:
            streamed[piece.index] += piece.logprobs.token_logprobs if piece.logprobs else []
    assert streamed == {index: choice.logprobs.token_logprobs for index, choice in enumerate(batch.choices)}


def check_chat_top_logprobs(client: openai.OpenAI, base_url: str) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in content)
    streamed = [entry.logprob for chunk in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert streamed == [entry.logprob for entry in content]


def check_penalties_and_logit_bias(client: openai.OpenAI, base_url: str) -> None:
    forced = httpx.post(base_url + "/tokenize", json={"prompt": " yes", "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    assert len(forced) == 1
    biased = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={str(forced[0]): 100})
    assert biased.choices[0].text == " yes" * 3
    texts, _ = _stream_texts(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                                       logit_bias={str(forced[0]): 100}, stream=True))
    assert texts == {0: " yes" * 3}
    prompt = "1 1 1 1 1 1 1 1"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 10.0})
    assert plain.choices[0].text.count("1") >= 2, plain.choices[0].text  # the model repeats
    assert penalized.choices[0].text.count("1") < plain.choices[0].text.count("1")
    text = httpx.post(base_url + "/detokenize", json={"tokens": forced}, timeout=30).json()["prompt"]
    assert text == " yes"


def check_structured_output(client: openai.OpenAI, base_url: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}
    full = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=0.7, seed=1,
                                          response_format=response_format)
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    texts, _ = _stream_texts(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60,
                                                            temperature=0.7, seed=1, stream=True,
                                                            response_format=response_format))
    assert texts[0] == full.choices[0].message.content
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=4,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    anything = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0.7, seed=2,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def check_tools(client: openai.OpenAI, base_url: str) -> None:
    named = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0, tools=[TOOL],
                                           tool_choice={"type": "function", "function": {"name": "buy"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "buy"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    arguments, names = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0,
                                                tools=[TOOL], tool_choice="required", stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
    assert names == ["buy"]
    jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[TOOL], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # SmolLM2's template defines no native call format: under "auto" it answers as plain content.
    auto = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[TOOL], tool_choice="auto")
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content


def check_unsupported_is_a_precise_400(client: openai.OpenAI, base_url: str) -> None:
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="tail")
    except openai.BadRequestError as error:
        assert error.body["param"] == "suffix"
    else:
        raise AssertionError("suffix was accepted")


CHECKS: list[Callable[[openai.OpenAI, str], None]] = [
    check_n_choices, check_batched_prompts_logprobs_and_echo, check_chat_top_logprobs,
    check_penalties_and_logit_bias, check_structured_output, check_tools, check_unsupported_is_a_precise_400,
]
