"""D starts from the first token P sampled (protocol 7), in one process: real prefill, decode and colocated
engines of one tiny Qwen3, pages over the fake transport. Greedy, seeded and penalised answers equal the
colocated worker's, the first token's logprobs too, and D computes no prompt token; a request asking
logprobs P did not record makes D compute the first token itself, counted by reason."""

from __future__ import annotations

import pytest

from tests.engine.inprocess import DECODE_REQUEST, complete, metric_value, tiny_qwen3_trio

# Lengths 29, 33, 36: the last block holds 1, 1 and 4 of the prompt's tokens (block size 4).
PROMPTS = [[11 + (7 * i + j) % 250 for j in range(length)] for i, length in enumerate((29, 33, 36))]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 8, "temperature": 0.8, "seed": 1234, "ignore_eos": True}
PENALISED = {**SEEDED, "presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3}

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with tiny_qwen3_trio(str(tmp_path_factory.mktemp("qwen3"))) as trio:
        yield trio


async def through_pd(prefill, decode, body: dict, request_id: str) -> dict:
    """The two legs as vLLM's proxy sends them: P with max_tokens 1, then D with P's params."""
    answer = await complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST}, request_id)
    return await complete(decode, {**body, "kv_transfer_params": answer["kv_transfer_params"]}, request_id)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALISED], ids=["greedy", "seeded", "penalised"])
async def test_pd_answers_equal_the_colocated_worker_and_decode_computes_no_prompt_token(workers, sampling):
    colocated, prefill, decode = workers
    computed_before = metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total")
    started_before = metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total")
    for index, prompt in enumerate(PROMPTS):
        body = {**sampling, "prompt": prompt}
        local = await complete(colocated, body)
        remote = await through_pd(prefill, decode, body, f"{sampling['temperature']}-{len(sampling)}-{index}")
        assert remote["choices"][0]["text"] == local["choices"][0]["text"]
        assert remote["usage"]["completion_tokens"] == sampling["max_tokens"]  # token 1 counted like any token
    assert metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total") == computed_before
    assert metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total") == started_before + len(PROMPTS)


async def test_the_first_tokens_logprobs_equal_the_colocated_workers(workers):
    colocated, prefill, decode = workers
    body = {**GREEDY, "prompt": PROMPTS[0], "logprobs": 3}
    started_before = metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total")
    local = (await complete(colocated, body))["choices"][0]["logprobs"]
    remote = (await through_pd(prefill, decode, body, "logprobs"))["choices"][0]["logprobs"]
    assert metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total") == started_before + 1
    assert remote["tokens"] == local["tokens"]
    assert remote["token_logprobs"] == pytest.approx(local["token_logprobs"], abs=1e-5)
    assert list(remote["top_logprobs"][0]) == list(local["top_logprobs"][0])
    assert list(remote["top_logprobs"][0].values()) == pytest.approx(list(local["top_logprobs"][0].values()), abs=1e-5)


async def test_a_one_token_answer_is_ps_token_with_nothing_computed_on_decode(workers):
    colocated, prefill, decode = workers
    body = {**GREEDY, "prompt": PROMPTS[1], "max_tokens": 1}
    computed_before = metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total")
    started_before = metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total")
    remote = await through_pd(prefill, decode, body, "one-token")
    assert remote["choices"][0]["text"] == (await complete(colocated, body))["choices"][0]["text"]
    assert remote["choices"][0]["finish_reason"] == "length"
    assert remote["usage"]["completion_tokens"] == 1
    assert metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total") == computed_before
    assert metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total") == started_before + 1


async def test_logprobs_p_did_not_record_make_decode_compute_the_first_token_counted(workers):
    """P's leg asked no logprobs, D's asks 2 alternatives: P's ticket cannot give them, so D computes the
    last prompt token itself (as before protocol 7) and counts why; the answer still equals colocated."""
    colocated, prefill, decode = workers
    body = {**GREEDY, "prompt": PROMPTS[2]}
    answer = await complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST}, "mismatch")
    computed_before = metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total")
    wanted = {**body, "logprobs": 2}
    remote = await complete(decode, {**wanted, "kv_transfer_params": answer["kv_transfer_params"]}, "mismatch")
    local = await complete(colocated, wanted)
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    assert remote["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        local["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    recomputed = decode.metrics.transfer.first_token_recomputed.labels(reason="logprobs_mismatch")._value.get()
    assert recomputed == 1
    assert metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total") == computed_before + 1


async def test_a_stop_string_in_ps_token_ends_the_answer_as_on_a_colocated_worker(workers):
    colocated, prefill, decode = workers
    body = {**GREEDY, "prompt": PROMPTS[0]}
    first_text = (await complete(colocated, {**body, "max_tokens": 1}))["choices"][0]["text"]
    assert first_text.strip(), "the tiny model's first token must decode to text for this test"
    stopped = {**body, "stop": [first_text.strip()]}
    local = (await complete(colocated, stopped))["choices"][0]
    remote = (await through_pd(prefill, decode, stopped, "stop-string"))["choices"][0]
    assert (remote["text"], remote["finish_reason"]) == (local["text"], local["finish_reason"]) == (
        first_text[: first_text.index(first_text.strip())], "stop")


def _handoff_count(worker, component: str) -> float:
    return worker.metrics.registry.get_sample_value("pdserve_pd_handoff_seconds_count", {"component": component}) or 0


async def test_each_worker_observes_its_handoff_components_and_p_returns_its_own(workers):
    _, prefill, decode = workers
    parts_p, parts_d = ("p_queue", "p_compute", "p_pin"), ("d_ticket", "d_pull", "d_first_step")
    before = {c: _handoff_count(prefill, c) for c in parts_p} | {c: _handoff_count(decode, c) for c in parts_d}
    body = {**GREEDY, "prompt": PROMPTS[2], "max_tokens": 3}
    answer = await complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST}, "handoff")
    assert sorted(answer["kv_transfer_params"]["handoff_s"]) == sorted(parts_p)
    await complete(decode, {**body, "kv_transfer_params": answer["kv_transfer_params"]}, "handoff")
    assert {c: _handoff_count(prefill, c) - before[c] for c in parts_p} == dict.fromkeys(parts_p, 1)
    assert {c: _handoff_count(decode, c) - before[c] for c in parts_d} == dict.fromkeys(parts_d, 1)
