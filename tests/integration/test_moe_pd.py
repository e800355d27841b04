"""P/D with real NIXL on tiny random MoE checkpoints: gpt-oss (sinks, a sliding window shorter than the
prompt alternating with full layers, 6 experts top-2) and Qwen3-MoE (one dense layer). The decode
worker's greedy tokens equal transformers' (float32 on the CPU), and the prefill worker's own answer
over the same KV; the window group moves only its live window; a prompt sharing a prefix with an
earlier one is a prefix-cache hit on the prefill worker and still gives transformers' tokens."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import (
    Worker, free_port, page_bytes, same_path_reference, start_workers, stop_all, two_legs)
from tests.models.hf_oracle import hf_greedy_generate
from tests.tiny_models import (
    GPT_OSS_VOCAB, GPT_OSS_WINDOW, QWEN_MOE_VOCAB, make_tiny_gpt_oss, make_tiny_qwen3_moe, random_prompt,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
NUM_TOKENS = 24
FAMILIES = {"gpt_oss": (make_tiny_gpt_oss, GPT_OSS_VOCAB), "qwen3_moe": (make_tiny_qwen3_moe, QWEN_MOE_VOCAB)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def cluster(request, tmp_path_factory, device):
    if device != "cpu":
        pytest.skip("parity with transformers is checked in float32 on the CPU")
    make, vocab = FAMILIES[request.param]
    model_dir = str(tmp_path_factory.mktemp(request.param))
    hf_model = make(model_dir)
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    common = ["--model", model_dir, "--block-size", str(BLOCK_SIZE), "--num-blocks", "300", "--dtype", "float32"]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), common, device)
    decode = Worker("decode", free_port(), str(logs / "decode.log"), [*common, "--no-prefix-caching"], device)
    workers = start_workers(prefill, decode)
    yield request.param, hf_model, vocab, prefill, decode
    stop_all(*workers)


def _token_ids(choice: dict) -> list[int]:
    """The word-level test tokenizer spells id i (i >= 3) as "w<i>"."""
    return [int(token[1:]) for token in choice["logprobs"]["tokens"]]


def _body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}


def test_moe_pd_matches_transformers_and_moves_only_the_live_window(cluster):
    family, hf_model, vocab, prefill, decode = cluster
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for seed, length in ((1, 97), (2, 61)):  # one token past a block boundary: see same_path_reference
        prompt = random_prompt(length, vocab, seed)
        body = _body(model, prompt)
        expected = same_path_reference(prefill, "/v1/completions", body, f"{family}-ref-{seed}", block_size=BLOCK_SIZE)
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        params, response = two_legs(prefill, decode, "/v1/completions", body, f"{family}-{seed}")
        assert response.status_code == 200, response.text
        got = response.json()["choices"][0]
        assert got["text"] == expected["choices"][0]["text"]
        assert got["logprobs"]["token_logprobs"] == expected["choices"][0]["logprobs"]["token_logprobs"]
        assert _token_ids(got) == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)

        info = httpx.get(prefill.internal_url + "/internal/kv/agent_info", timeout=10).json()
        kinds = [group["kind"] for group in info["geometry"]["groups"]]
        num_prompt_blocks = -(-length // BLOCK_SIZE)
        for kind, ids in zip(kinds, params["remote_block_ids"]):
            if kind == "full":
                assert len(ids) == num_prompt_blocks
            else:  # only gpt-oss has a window group
                assert 0 < len(ids) <= -(-GPT_OSS_WINDOW // BLOCK_SIZE) + 1 < num_prompt_blocks
        assert kinds == (["full", "sliding"] if family == "gpt_oss" else ["full"])
        sent = sum(len(ids) for ids in params["remote_block_ids"])
        assert decode.metric("pdserve_transfer_bytes_total") - bytes_before == sent * page_bytes(decode)


def test_moe_pd_with_a_prefix_cache_hit_on_the_prefill_worker(cluster):
    family, hf_model, vocab, prefill, decode = cluster
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    shared = random_prompt(48, vocab, 30)
    first, second = shared + random_prompt(13, vocab, 31), shared + random_prompt(17, vocab, 32)
    _, response = two_legs(prefill, decode, "/v1/completions", _body(model, first), f"{family}-prefix-a")
    assert response.status_code == 200, response.text
    hits_before = prefill.metric("pdserve_kv_prefix_cache_hits_tokens_total")
    _, response = two_legs(prefill, decode, "/v1/completions", _body(model, second), f"{family}-prefix-b")
    assert response.status_code == 200, response.text
    assert prefill.metric("pdserve_kv_prefix_cache_hits_tokens_total") - hits_before >= 40
    assert _token_ids(response.json()["choices"][0]) == hf_greedy_generate(hf_model, second, NUM_TOKENS)
