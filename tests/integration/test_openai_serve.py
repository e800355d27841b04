"""`pdserve serve` as a real process on the embedded model, driven by the official
openai client: chat and completions, streaming and not; disconnects free blocks."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.openai_features import CHECKS
from tests.integration.cluster import Worker, free_port, start_workers, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    worker = Worker("serve", free_port(), str(tmp_path_factory.mktemp("logs") / "serve.log"), ["--num-blocks", "300"])
    start_workers(worker)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list_names_the_embedded_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_streaming_and_not_give_the_same_greedy_answer(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_streaming_and_not_with_token_id_prompt(client):
    full = client.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].text.strip()
    by_ids = client.completions.create(model=MODEL, prompt=[504, 1545, 3325], max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 3


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=3)


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True, "stream": True,
        }) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
    assert wait_for(lambda: httpx.get(server.url + "/load", timeout=5).json()["num_running"] == 0, timeout_s=10)
    load = httpx.get(server.url + "/load", timeout=5).json()
    assert load["kv_usage"] == 0.0
    assert server.metric("pdserve_request_finished_total") >= 1


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_openai_client_feature(client, server, check):
    check(client, server.url)
