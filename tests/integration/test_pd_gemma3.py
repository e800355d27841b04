"""P/D on a tiny random Gemma 3 whose sliding window is shorter than the prompt: the same
tokens and logprobs as the prefill worker's own answer over the same KV, and sliding-window
groups move only their live window."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import (
    Worker, free_port, page_bytes, same_path_reference, start_workers, stop_all, two_legs)
from tests.tiny_models import GEMMA_VOCAB, GEMMA_WINDOW, make_tiny_gemma3, random_prompt

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    model_dir = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_gemma3(model_dir)
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", model_dir, "--block-size", str(BLOCK_SIZE), "--num-blocks", "300"]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), common, device)
    decode = Worker("decode", free_port(), str(logs / "decode.log"), [*common, "--no-prefix-caching"], device)
    workers = start_workers(prefill, decode)
    yield prefill, decode
    stop_all(*workers)


def test_gemma3_pd_matches_the_same_kv_on_the_same_path_and_moves_only_the_live_window(cluster):
    prefill, decode = cluster
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for seed, length in ((1, 97), (2, 61)):  # one token past a block boundary: see same_path_reference
        prompt = random_prompt(length, GEMMA_VOCAB, seed)
        body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        expected = same_path_reference(prefill, "/v1/completions", body, f"gemma-ref-{seed}", block_size=BLOCK_SIZE)
        descriptors_before = decode.metric("pdserve_transfer_descriptors_total")
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
        params, response = two_legs(prefill, decode, "/v1/completions", body, f"gemma-{seed}")
        assert response.status_code == 200, response.text
        got, want = response.json()["choices"][0], expected["choices"][0]
        assert got["text"] == want["text"]
        assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
        assert response.json()["usage"]["completion_tokens"] == 32
        # Protocol 7: D started from P's first token; its first step wrote that token's KV (full and
        # sliding groups alike), so it computed no prompt token.
        assert decode.metric("pdserve_engine_computed_prompt_tokens_total") == computed_before
        local = httpx.post(decode.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert got["text"] == local["text"]  # and a colocated run (D alone, no prefix cache) agrees

        info = httpx.get(prefill.internal_url + "/internal/kv/agent_info", timeout=10).json()
        kinds = [group["kind"] for group in info["geometry"]["groups"]]
        num_prompt_blocks = -(-length // BLOCK_SIZE)
        window_blocks = -(-GEMMA_WINDOW // BLOCK_SIZE) + 1
        for kind, ids in zip(kinds, params["remote_block_ids"]):
            if kind == "full":
                assert len(ids) == num_prompt_blocks
            else:
                assert 0 < len(ids) <= window_blocks < num_prompt_blocks
        sent = sum(len(ids) for ids in params["remote_block_ids"])
        assert decode.metric("pdserve_transfer_bytes_total") - bytes_before == sent * page_bytes(decode)
        assert 1 <= decode.metric("pdserve_transfer_descriptors_total") - descriptors_before <= sent
        num_sliding = kinds.count("sliding")
        unclipped = num_prompt_blocks * len(kinds)
        assert sent <= unclipped - (num_prompt_blocks - window_blocks) * num_sliding


SAMPLED = {
    "seeded": {"temperature": 0.8, "seed": 7},
    "penalised": {"temperature": 0.8, "seed": 11, "presence_penalty": 0.8, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.2},
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_gemma3_pd_seeded_and_penalised_answers_equal_the_same_kv_run_and_d_computes_no_prompt_token(cluster, name):
    """Issue 38's parity on Gemma 3 beyond greedy: P samples token 1, D draws from index 1 on (seeded draws
    are keyed by seed and draw index, penalties count P's token), so the P/D answer equals the prefill
    worker's own over the same KV, the first token's logprobs too, and D computes no prompt token."""
    prefill, decode = cluster
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = random_prompt(73, GEMMA_VOCAB, 11 + len(name))  # one token past a block boundary
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "logprobs": 2, **SAMPLED[name]}
    expected = same_path_reference(prefill, "/v1/completions", body, f"gemma-ref-{name}", block_size=BLOCK_SIZE)
    computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
    started_before = decode.metric("pdserve_pd_first_token_from_prefill_total")
    _, response = two_legs(prefill, decode, "/v1/completions", body, f"gemma-{name}")
    assert response.status_code == 200, response.text
    got, want = response.json()["choices"][0], expected["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][0] == want["logprobs"]["token_logprobs"][0]
    assert got["logprobs"]["top_logprobs"][0] == want["logprobs"]["top_logprobs"][0]
    assert decode.metric("pdserve_engine_computed_prompt_tokens_total") == computed_before
    assert decode.metric("pdserve_pd_first_token_from_prefill_total") == started_before + 1
