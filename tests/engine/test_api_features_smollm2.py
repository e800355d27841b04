"""The OpenAI features on the embedded SmolLM2, through the real app and engine in one process:
logprobs against transformers, n > 1 at temperature 0, echo with prompt logprobs, structured
outputs that parse and validate, forced tool calls."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
import torch

from pdserve.api.config import CacheConfig, ModelConfig, ServerConfig, WorkerConfig
from pdserve.api.sampling import FinishReason
from pdserve.app.engine_factory import build_engine
from pdserve.metrics import Metrics
from pdserve.models.loader import load_model
from pdserve.server.app import create_app
from tests.engine.harness import generate, greedy, make_engine
from tests.models.hf_oracle import hf_prompt_logits

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_m", "pets", "address"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def app(loaded):
    config = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"), cache=CacheConfig(block_size=16, num_blocks=512))
    built = build_engine(config, Metrics(), loaded)
    built.engine.start()
    yield create_app(built.engine, Metrics(), ServerConfig()), built
    built.close()


async def post(app, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]), base_url="http://t", timeout=300) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_ids(loaded, question: str) -> list[int]:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return loaded.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2_model):
    return hf_smollm2_model  # loaded once a run (tests/conftest.py)


def test_top1_and_top_logprobs_equal_transformers_log_softmax(loaded, hf_model):
    prompt = chat_ids(loaded, "Name a color.")
    sampling = greedy(8, ignore_eos=True, logprobs=True, top_logprobs=3)
    collected = generate(make_engine(loaded=loaded), [prompt], sampling)[0]
    ids = collected.token_ids
    logprobs = [lp for output in collected.outputs for lp in output.new_logprobs]
    tops = [top for output in collected.outputs for top in output.new_top_logprobs]
    expected = hf_prompt_logits(hf_model, prompt + ids[:-1]).log_softmax(-1)[len(prompt) - 1:]
    assert len(logprobs) == len(tops) == len(ids) == 8
    for step, token_id in enumerate(ids):
        assert abs(logprobs[step] - expected[step, token_id].item()) < 1e-4
        reference = expected[step].topk(3)
        assert [t for t, _ in tops[step]] == reference.indices.tolist()
        assert max(abs(lp - ref) for (_, lp), ref in zip(tops[step], reference.values.tolist())) < 1e-4


async def test_wire_logprobs_carry_the_engine_values(app, loaded):
    prompt = chat_ids(loaded, "Name a color.")
    body = await post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                                                    "max_tokens": 8, "temperature": 0, "logprobs": True,
                                                    "top_logprobs": 3})
    collected = generate(make_engine(loaded=loaded), [prompt], greedy(8, logprobs=True), prefix="w")[0]
    content = body["choices"][0]["logprobs"]["content"]
    engine_logprobs = [lp for output in collected.outputs for lp in output.new_logprobs]
    assert [entry["logprob"] for entry in content] == pytest.approx(engine_logprobs, abs=1e-6)
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)


async def test_n3_at_temperature_0_gives_three_copies_of_the_n1_answer(app):
    request = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 12, "temperature": 0}
    single = await post(app, "/v1/chat/completions", request)
    triple = await post(app, "/v1/chat/completions", {**request, "n": 3})
    answer = single["choices"][0]["message"]["content"]
    assert [c["index"] for c in triple["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in triple["choices"]] == [answer] * 3
    usage, single_usage = triple["usage"], single["usage"]
    assert usage["prompt_tokens"] == single_usage["prompt_tokens"]
    assert usage["completion_tokens"] == 3 * single_usage["completion_tokens"]


async def test_seeded_n3_is_reproducible_and_choice_j_is_the_n1_answer_with_seed_plus_j(app):
    request = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    first, again = await asyncio.gather(post(app, "/v1/completions", {**request, "n": 3}),
                                        post(app, "/v1/completions", {**request, "n": 3}))
    texts = [choice["text"] for choice in first["choices"]]
    assert [choice["text"] for choice in again["choices"]] == texts  # batched together, same draws
    assert len(set(texts)) > 1  # each choice draws from its own generator
    for index in range(3):
        single = await post(app, "/v1/completions", {**request, "seed": 11 + index})
        assert single["choices"][0]["text"] == texts[index]


def test_min_tokens_keeps_the_model_from_stopping_early(loaded):
    prompt = chat_ids(loaded, "Reply with one word: yes or no?")
    built = make_engine(loaded=loaded)
    free, held = generate(built, [prompt], greedy(24), prefix="free")[0], None
    assert free.final.finish_reason is FinishReason.STOP  # the model ends on EOS by itself...
    minimum = len(free.token_ids) + 3
    held = generate(built, [prompt], greedy(24, min_tokens=minimum), prefix="held")[0]
    assert len(held.token_ids) >= minimum  # ... and is held past it, never drawing EOS before
    assert not set(held.token_ids[:minimum]) & set(loaded.tokenizer.eos_token_ids)
    assert held.token_ids[:len(free.token_ids) - 1] == free.token_ids[:-1]  # the same answer up to the EOS


async def test_echo_with_logprobs_returns_the_prompt_logprobs_of_transformers(app, loaded, hf_model):
    prompt = "The capital of France is"
    body = await post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                               "echo": True, "logprobs": 2})
    choice = body["choices"][0]
    assert choice["text"].startswith(prompt)
    ids = loaded.tokenizer.encode(prompt)
    expected = hf_prompt_logits(hf_model, ids).log_softmax(-1)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][position] - expected[position - 1, ids[position]].item()) < 1e-4
    assert len(logprobs["tokens"]) == len(ids) + 2


async def test_twenty_seeded_json_schema_answers_parse_and_validate(app):
    requests = [post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 100, "temperature": 0.6, "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED_SCHEMA}},
    }) for seed in range(20)]
    answers = []
    for body in await asyncio.gather(*requests):  # batched together, as the engine serves them
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        jsonschema.validate(answer, NESTED_SCHEMA)
        answers.append(answer)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # seeds differ, answers too


async def test_forced_tool_calls_are_valid_calls_of_the_listed_functions(app):
    base = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [WEATHER_TOOL, TIME_TOOL]}
    named = await post(app, "/v1/chat/completions",
                       {**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    call = named["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    required = await post(app, "/v1/chat/completions", {**base, "tool_choice": "required"})
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
