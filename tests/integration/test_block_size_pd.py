"""P/D between workers of different block sizes (real processes, real NIXL, gloo between ranks):
the decode worker cuts both sides' pages into units of the smaller block and reads each unit of
each row. Greedy parity with transformers on a tiny Llama (4 query / 2 KV heads) and a tiny Gemma 3
whose sliding window is shorter than the prompt, for block sizes 16->32 and 32->16 and the mixed
pair TP 2->1 with blocks 16->32; the decode workers fail rather than recompute, so an answer proves
the KV was pulled, and the decode metrics show D computed only the prompt's last token.

One set of workers per tiny model serves every test here; the decode workers keep a prefix cache (the
partial-hit tests need it), which each test empties before it sends a prompt that must be pulled whole."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import (
    Worker, free_port, page_bytes, reset_prefix_cache, start_workers, stop_all, two_legs, wait_for)
from tests.integration.test_tensor_parallel import NUM_NEW, VOCAB, assert_greedy_parity, tiny_llama, token_ids
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import GEMMA_VOCAB, GEMMA_WINDOW, make_tiny_gemma3, random_prompt

pytestmark = pytest.mark.slow

# (prefill TP, prefill block, decode TP, decode block)
PAIRS = ((1, 16, 1, 32), (1, 32, 1, 16), (2, 16, 1, 32))
# 11 tokens: less than one block of either size; 70 tokens outgrow Gemma's window of 16, and its last
# token reads keys 54..69: P (blocks of 16) hands over from token 48, D (blocks of 32) needs from 32.
PROMPT_LENGTHS = (11, 70)
assert 70 - GEMMA_WINDOW == 54


def worker(role: str, model_dir: str, logs, size: int, block_size: int) -> Worker:
    extra = ["--model", model_dir, "--dtype", "float32", "--num-blocks", "64", "--block-size", str(block_size),
             "-tp", str(size)]
    if role == "decode":
        extra += ["--kv-failure-policy", "fail"]
    return Worker(role, free_port(), str(logs / f"{role}-tp{size}-bs{block_size}.log"), extra)


LLAMA = "llama-4q-2kv"


@pytest.fixture(scope="module", params=[LLAMA, "gemma3-window"])
def shapes(request, tmp_path_factory):
    """Every worker the pairs need, on one tiny model, with its oracle."""
    model_dir = str(tmp_path_factory.mktemp(request.param))
    if request.param == "gemma3-window":
        oracle, vocab = make_tiny_gemma3(model_dir), GEMMA_VOCAB
    else:
        oracle, vocab = tiny_llama(model_dir, 4, 2, True, seed=5), VOCAB
    logs = tmp_path_factory.mktemp(f"{request.param}-logs")
    shapes_needed = {("prefill", tp, bs) for tp, bs, _, _ in PAIRS} | {("decode", tp, bs) for _, _, tp, bs in PAIRS}
    workers = {shape: worker(shape[0], model_dir, logs, shape[1], shape[2]) for shape in sorted(shapes_needed)}
    start_workers(*workers.values())
    yield request.param, oracle, vocab, workers
    stop_all(*workers.values())


def tokens_moved(decode: Worker, length: int, prefill_block: int, decode_block: int) -> int:
    """Token rows a pull moves, summed over groups: a full-attention group every token up to the
    last unit; a sliding group from where both sides' windows have begun (each on its own block
    boundary) up to the last unit. Written from the rule, not from the planner's code."""
    unit = min(prefill_block, decode_block)
    end = -(-length // unit) * unit
    groups = httpx.get(decode.internal_url + "/internal/kv/agent_info", timeout=10).json()["geometry"]["groups"]
    total = 0
    for group in groups:
        start = 0
        if group["kind"] == "sliding":
            first_key = max(0, length - group["window_tokens"])  # what the last prompt token reads first
            start = max(first_key // prefill_block * prefill_block, first_key // decode_block * decode_block)
        total += end - start
    return total


def completion(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}


@pytest.mark.parametrize("prefill_tp, prefill_block, decode_tp, decode_block", PAIRS)
def test_pd_between_block_sizes_matches_transformers_with_the_kv_pulled(shapes, prefill_tp, prefill_block,
                                                                       decode_tp, decode_block):
    _, oracle, vocab, workers = shapes
    prefill, decode = workers["prefill", prefill_tp, prefill_block], workers["decode", decode_tp, decode_block]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    bytes_per_token = page_bytes(decode) // decode_block
    for seed, length in zip((1, 2), PROMPT_LENGTHS):
        prompt = random_prompt(length, vocab, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        descriptors_before = decode.metric("pdserve_transfer_descriptors_total")
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
        reset_prefix_cache(decode)  # another pair sent D this prompt already: all of it must be pulled
        params, response = two_legs(prefill, decode, "/v1/completions", completion(model, prompt),
                                    f"bs-{prefill_block}-{decode_block}-tp{prefill_tp}-{seed}")
        assert response.status_code == 200, response.text
        assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
        # P's block ids count P's blocks: one per started block of P's size in the full-attention group.
        assert len(params["remote_block_ids"][0]) == -(-length // prefill_block)
        moved = decode.metric("pdserve_transfer_bytes_total") - bytes_before
        assert moved == tokens_moved(decode, length, prefill_block, decode_block) * bytes_per_token
        assert decode.metric("pdserve_transfer_descriptors_total") - descriptors_before > 0
        # Pulled, not recomputed: D starts from P's first token (protocol 7) and computes no prompt token
        # (it computed the last one before); every prompt token's KV came across.
        assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before == 0
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)


@pytest.mark.parametrize("shapes", [LLAMA], indirect=True)  # the tiny Llama's workers: full attention only
@pytest.mark.parametrize("prefill_block, decode_block", [(16, 32), (32, 16)])
def test_a_partial_prefix_hit_on_a_decode_worker_of_another_block_size_pulls_only_the_missing_tail(
        shapes, prefill_block, decode_block):
    """D with its prefix cache on: a second prompt sharing the first 64 tokens of an earlier one
    reads only the tokens past them, and the answer still matches transformers."""
    _, oracle, _, workers = shapes
    prefill, decode = workers["prefill", 1, prefill_block], workers["decode", 1, decode_block]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    bytes_per_token = page_bytes(decode) // decode_block
    shared = random_prompt(64, VOCAB, 7)
    first, second = shared + random_prompt(21, VOCAB, 8), shared + random_prompt(21, VOCAB, 9)
    reset_prefix_cache(decode)  # nothing of `shared` cached on D from the other pair's run
    pulled = []
    for index, prompt in enumerate((first, second)):
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        _, response = two_legs(prefill, decode, "/v1/completions", completion(model, prompt),
                               f"prefix-{prefill_block}-{decode_block}-{index}")
        assert response.status_code == 200, response.text
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        pulled.append((cached, (decode.metric("pdserve_transfer_bytes_total") - bytes_before) // bytes_per_token))
    unit, length = min(prefill_block, decode_block), 64 + 21
    end = -(-length // unit) * unit  # the last unit moves whole
    assert pulled[0] == (0, end)
    assert pulled[1] == (64, end - 64)  # the shared tokens came from D's own cache, only the tail travelled
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)
