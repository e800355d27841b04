"""P/D of models with recurrent state (real processes, real NIXL): a tiny Qwen3.5 (Gated DeltaNet
and full attention) and a tiny Nemotron-H (Mamba2, MLP and attention blocks), one prefill and one
decode worker each. The decode workers fail rather than recompute, so an answer proves the KV and
the state were pulled; greedy tokens equal transformers', D computes only the last prompt token,
and the bytes pulled are the attention blocks plus one page per state group, counted here from the
handshake's groups. A second prompt sharing a prefix recomputes on P only the tokens after its
latest snapshot. A decode worker of block 32 (another state paging: two DeltaNet layers a page, not
one) serves a prefill worker of block 16, pulling each layer's state into its own slot, equal to
transformers too."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import (Worker, free_port, page_bytes, start_workers, stop_all,
                                       two_legs, wait_for)
from tests.integration.test_tensor_parallel import token_ids
from tests.models.hf_oracle import hf_greedy_generate
from tests.tiny_models import NEMOTRON_H_VOCAB, QWEN3_5_VOCAB, make_tiny_nemotron_h, make_tiny_qwen3_5, random_prompt

pytestmark = pytest.mark.slow

NUM_NEW = 4
BLOCK = 16
SHARED_TOKENS = 32  # two blocks: the first prompt's last full block, where P keeps a snapshot
TAIL_TOKENS = 13


def worker(role: str, model_dir: str, logs, name: str, block_size: int = BLOCK) -> Worker:
    extra = ["--model", model_dir, "--dtype", "float32", "--num-blocks", "64", "--block-size", str(block_size)]
    if role == "decode":
        extra += ["--kv-failure-policy", "fail"]
    return Worker(role, free_port(), str(logs / f"{name}-{role}-bs{block_size}.log"), extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Both models' workers, started at once, with their oracles."""
    logs = tmp_path_factory.mktemp("state-pd-logs")
    qwen_dir, nemotron_dir = (str(tmp_path_factory.mktemp(name)) for name in ("qwen3_5", "nemotron_h"))
    oracles = {"qwen3_5": (make_tiny_qwen3_5(qwen_dir), QWEN3_5_VOCAB),
               "nemotron_h": (make_tiny_nemotron_h(nemotron_dir), NEMOTRON_H_VOCAB)}
    workers = {(name, role): worker(role, directory, logs, name)
               for name, directory in (("qwen3_5", qwen_dir), ("nemotron_h", nemotron_dir))
               for role in ("prefill", "decode")}
    workers["qwen3_5", "decode32"] = worker("decode", qwen_dir, logs, "qwen3_5", block_size=2 * BLOCK)
    start_workers(*workers.values())
    yield oracles, workers
    stop_all(*workers.values())


def completion(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}


def expected_pull_bytes(decode: Worker, length: int, cached_tokens: int) -> int:
    """What a pull moves, from the rule: every full-attention block of the prompt D's own cache does not
    hold, and one page per state group unless D holds the state before the last token itself."""
    groups = httpx.get(decode.internal_url + "/internal/kv/agent_info", timeout=10).json()["geometry"]["groups"]
    num_pages = 0
    for group in groups:
        assert group["kind"] in ("full", "state"), group
        if group["kind"] == "full":
            num_pages += -(-length // BLOCK) - cached_tokens // BLOCK
        else:
            num_pages += 0 if cached_tokens >= length - 1 else 1
    return num_pages * page_bytes(decode)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_pd_of_a_state_model_matches_transformers_with_the_state_pulled(cluster, name):
    oracles, workers = cluster
    (oracle, vocab), prefill, decode = oracles[name], workers[name, "prefill"], workers[name, "decode"]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    groups = httpx.get(decode.internal_url + "/internal/kv/agent_info", timeout=10).json()["geometry"]["groups"]
    assert any(group["kind"] == "state" for group in groups)
    shared = random_prompt(SHARED_TOKENS, vocab, 1)
    prompts = [shared + random_prompt(TAIL_TOKENS, vocab, 2), shared + random_prompt(TAIL_TOKENS, vocab, 3)]
    prefill_computed = []
    for index, prompt in enumerate(prompts):
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        decode_computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
        prefill_computed_before = prefill.metric("pdserve_engine_computed_prompt_tokens_total")
        params, response = two_legs(prefill, decode, "/v1/completions", completion(model, prompt), f"{name}-{index}")
        assert response.status_code == 200, response.text
        assert token_ids(response.json()["choices"][0]["logprobs"]["tokens"]) == hf_greedy_generate(
            oracle, prompt, NUM_NEW)
        # The ticket's state lists name one page each (P's handoff page).
        assert [len(ids) for ids, group in zip(params["remote_block_ids"], groups) if group["kind"] == "state"] == [
            1] * sum(group["kind"] == "state" for group in groups)
        assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - decode_computed_before == 1
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        moved = decode.metric("pdserve_transfer_bytes_total") - bytes_before
        assert moved == expected_pull_bytes(decode, len(prompt), cached)
        prefill_computed.append(prefill.metric("pdserve_engine_computed_prompt_tokens_total") - prefill_computed_before)
    length = SHARED_TOKENS + TAIL_TOKENS
    assert prefill_computed == [length, length - SHARED_TOKENS]  # the second resumed from the snapshot at 32
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)


def state_pages(groups: list[dict]) -> list[list[int]]:
    return [group["layer_ids"] for group in groups if group["kind"] == "state"]


def expected_cross_block_pull_bytes(prefill_info: dict, decode_info: dict, length: int) -> int:
    """From both handshakes: every full-attention group's units of the smaller block covering the prompt
    (K and V rows of every KV head and layer slot; float32), and each state layer's state once, however
    either side pages it (no padding travels)."""
    unit_tokens = min(prefill_info["geometry"]["block_size"], decode_info["geometry"]["block_size"])
    document = decode_info["compatibility"]
    rows = document["num_kv_heads"] * document["group_size"] * 2
    groups = decode_info["geometry"]["groups"]
    num_full = sum(group["kind"] == "full" for group in groups)
    attention = num_full * -(-length // unit_tokens) * rows * unit_tokens * document["head_dim"] * 4
    state = 0
    for group in groups:
        if group["kind"] == "state":
            shape = group["state"]
            elements = shape["conv_channels"] * shape["conv_window"]
            recurrent = 1
            for size in shape["recurrent_shape"]:
                recurrent *= size
            state += len(group["layer_ids"]) * (elements + recurrent) * 4
    return attention + state


def test_qwen3_5_through_pd_from_block_16_to_block_32_matches_transformers(cluster):
    oracles, workers = cluster
    (oracle, vocab), prefill, decode = oracles["qwen3_5"], workers["qwen3_5", "prefill"], workers["qwen3_5", "decode32"]
    prefill_info, decode_info = (httpx.get(worker.internal_url + "/internal/kv/agent_info", timeout=10).json()
                                 for worker in (prefill, decode))
    # The state groups follow the block size (one DeltaNet layer a page at 16, two at 32): D pulls layer by layer.
    assert state_pages(prefill_info["geometry"]["groups"]) == [[0], [1], [2]]
    assert state_pages(decode_info["geometry"]["groups"]) == [[0, 2], [1]]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = random_prompt(SHARED_TOKENS + TAIL_TOKENS, vocab, 4)
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
    params, response = two_legs(prefill, decode, "/v1/completions", completion(model, prompt), "qwen3_5-16-32")
    assert response.status_code == 200, response.text
    assert token_ids(response.json()["choices"][0]["logprobs"]["tokens"]) == hf_greedy_generate(oracle, prompt, NUM_NEW)
    assert len(params["remote_block_ids"]) == len(prefill_info["geometry"]["groups"])  # P's own groups
    assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before == 1
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    moved = decode.metric("pdserve_transfer_bytes_total") - bytes_before
    assert moved == expected_cross_block_pull_bytes(prefill_info, decode_info, len(prompt))
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)
