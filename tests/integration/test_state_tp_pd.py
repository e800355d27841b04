"""P/D of a recurrent-state model between workers of different TP sizes (real processes, real NIXL,
gloo between ranks): a tiny Qwen3.5 (three Gated DeltaNet layers, one full-attention layer) from a
prefill worker of TP 1 to a decode worker of TP 2, from TP 2 to TP 1, and from TP 2 to TP 2. Each
decode rank pulls its KV heads and, of every DeltaNet layer, the byte ranges of its heads' conv
window parts and recurrent state from the prefill rank(s) holding them. The decode workers fail
rather than recompute, so an answer proves the KV and the state were pulled; greedy tokens equal
transformers', D computes only the last prompt token, and the bytes pulled are counted here from the
model's shape alone. A prefill worker of two ranks resumes a shared prefix from its snapshot, every
rank restoring its share (rank 0 sends the step's page copies to the others)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import Worker, free_port, page_bytes, start_workers, stop_all, two_legs, wait_for
from tests.integration.test_tensor_parallel import assert_greedy_parity, token_ids
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import QWEN3_5_VOCAB, make_tiny_qwen3_5, random_prompt

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

BLOCK = 16
PROMPT_TOKENS = 45  # three blocks, the last one partial
NUM_NEW = 4
PAIRS = ((1, 2), (2, 1), (2, 2))  # (prefill TP, decode TP)


def worker(role: str, model_dir: str, logs, size: int) -> Worker:
    extra = ["--model", model_dir, "--dtype", "float32", "--num-blocks", "64", "--block-size", str(BLOCK),
             "-tp", str(size)]
    if role == "decode":
        extra += ["--kv-failure-policy", "fail"]
    return Worker(role, free_port(), str(logs / f"qwen3_5-{role}-tp{size}.log"), extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A prefill and a decode worker at TP 1 and at TP 2, with the oracle and its config."""
    model_dir = str(tmp_path_factory.mktemp("qwen3_5"))
    oracle = make_tiny_qwen3_5(model_dir)
    logs = tmp_path_factory.mktemp("state-tp-pd-logs")
    workers = {(role, size): worker(role, model_dir, logs, size) for role in ("prefill", "decode") for size in (1, 2)}
    start_workers(*workers.values())
    yield oracle, workers
    stop_all(*workers.values())


def expected_pull_bytes(config, num_tokens: int) -> int:
    """From the model's shape: every full-attention layer's K and V of all KV heads for the prompt's
    blocks, and every DeltaNet layer's whole state once (conv window of q, k, v; recurrent state), all
    float32, however the ranks of either side split them."""
    kinds = config.layer_types
    num_blocks = -(-num_tokens // BLOCK)
    attention = kinds.count("full_attention") * num_blocks * BLOCK * 2 * config.num_key_value_heads * config.head_dim
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * (config.linear_conv_kernel_dim - 1)
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return 4 * (attention + kinds.count("linear_attention") * (conv + recurrent))


@pytest.mark.parametrize("prefill_size, decode_size", PAIRS)
def test_qwen3_5_through_pd_between_tp_sizes_matches_transformers_with_the_state_pulled(
        cluster, prefill_size, decode_size):
    oracle, workers = cluster
    prefill, decode = workers["prefill", prefill_size], workers["decode", decode_size]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = random_prompt(PROMPT_TOKENS, QWEN3_5_VOCAB, 10 * prefill_size + decode_size)  # new to both prefix caches
    want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
    params, response = two_legs(prefill, decode, "/v1/completions", body, f"state-tp-{prefill_size}-{decode_size}")
    assert params["tp_size"] == prefill_size
    assert response.status_code == 200, response.text
    assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
    assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before == 1
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    moved = decode.metric("pdserve_transfer_bytes_total") - bytes_before
    if prefill_size == decode_size:  # equal pages: each rank's pages move whole, from the same rank
        assert moved == sum(len(ids) for ids in params["remote_block_ids"]) * decode_size * page_bytes(decode)
    else:
        assert moved == expected_pull_bytes(oracle.config, len(prompt))
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)


def test_a_prefill_worker_of_two_ranks_resumes_a_shared_prefix_from_its_snapshot_on_every_rank(cluster):
    """Every rank restores its share of the snapshot (rank 0 sends the page copies along with the step)."""
    oracle, workers = cluster
    prefill, decode = workers["prefill", 2], workers["decode", 1]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    shared = random_prompt(2 * BLOCK, QWEN3_5_VOCAB, 40)  # P keeps a snapshot at its last full block
    computed = []
    for seed in (41, 42):
        prompt = shared + random_prompt(PROMPT_TOKENS - 2 * BLOCK, QWEN3_5_VOCAB, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        before = prefill.metric("pdserve_engine_computed_prompt_tokens_total")
        _, response = two_legs(prefill, decode, "/v1/completions", body, f"state-tp-prefix-{seed}")
        assert response.status_code == 200, response.text
        assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
        computed.append(prefill.metric("pdserve_engine_computed_prompt_tokens_total") - before)
    assert computed == [PROMPT_TOKENS, PROMPT_TOKENS - 2 * BLOCK]
