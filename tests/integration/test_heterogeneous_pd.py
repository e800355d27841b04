"""P/D between workers of different TP sizes (real processes, real NIXL, gloo between ranks):
each decode rank pulls its KV heads from the prefill ranks that hold them. Greedy parity with
transformers on a tiny Llama (4 query / 2 KV heads) and a tiny Gemma 3 whose sliding window is
shorter than the prompt, for TP pairs 1->2, 2->1 and 2->2; the decode workers fail rather than
recompute, so an answer proves the KV was pulled.

One set of workers per tiny model serves every test here; the decode workers keep a prefix cache (the
partial-hit test needs it), which each test empties before it sends a prompt that must be pulled whole."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import (
    Worker, free_port, page_bytes, reset_prefix_cache, start_workers, stop_all, two_legs, wait_for)
from tests.integration.test_tensor_parallel import NUM_NEW, VOCAB, assert_greedy_parity, tiny_llama, token_ids
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import GEMMA_VOCAB, GEMMA_WINDOW, make_tiny_gemma3, random_prompt

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
PAIRS = ((1, 2), (2, 1), (2, 2))  # (prefill TP, decode TP)


def worker(role: str, model_dir: str, logs, size: int) -> Worker:
    extra = ["--model", model_dir, "--dtype", "float32", "--num-blocks", "160", "--block-size", str(BLOCK_SIZE),
             "-tp", str(size)]
    if role == "decode":
        extra += ["--kv-failure-policy", "fail"]
    return Worker(role, free_port(), str(logs / f"{role}-tp{size}.log"), extra)


LLAMA = "llama-4q-2kv"


@pytest.fixture(scope="module", params=[LLAMA, "gemma3-window"])
def shapes(request, tmp_path_factory):
    """A prefill and a decode worker at TP=1 and at TP=2 on one tiny model, with its oracle."""
    model_dir = str(tmp_path_factory.mktemp(request.param))
    if request.param == "gemma3-window":
        oracle, vocab = make_tiny_gemma3(model_dir), GEMMA_VOCAB
    else:
        oracle, vocab = tiny_llama(model_dir, 4, 2, True, seed=3), VOCAB
    logs = tmp_path_factory.mktemp(f"{request.param}-logs")
    workers = {(role, size): worker(role, model_dir, logs, size) for role in ("prefill", "decode") for size in (1, 2)}
    start_workers(*workers.values())
    yield oracle, vocab, workers
    stop_all(*workers.values())


@pytest.mark.parametrize("prefill_size, decode_size", PAIRS)
def test_pd_between_tp_sizes_matches_transformers_with_the_kv_pulled(shapes, prefill_size, decode_size):
    oracle, vocab, workers = shapes
    prefill, decode = workers["prefill", prefill_size], workers["decode", decode_size]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for seed, length in ((1, 11), (2, 3 * GEMMA_WINDOW + 2)):  # the second outgrows Gemma's window
        prompt = random_prompt(length, vocab, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        before = decode.metric("pdserve_transfer_descriptors_total")
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
        reset_prefix_cache(decode)  # another pair sent D this prompt already: all of it must be pulled
        params, response = two_legs(prefill, decode, "/v1/completions", body,
                                    f"het-{prefill_size}-{decode_size}-{seed}")
        assert params["tp_size"] == prefill_size
        assert response.status_code == 200, response.text
        assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
        # Each decode rank reads each block once from every prefill rank holding its heads (2 KV heads):
        # its whole page, whatever the split; head ranges of pages never merge across blocks, whole
        # pages adjacent on both sides do (equal TP).
        sources = max(decode_size, prefill_size)
        sent = sum(len(ids) for ids in params["remote_block_ids"])
        assert decode.metric("pdserve_transfer_bytes_total") - bytes_before == sent * decode_size * page_bytes(decode)
        descriptors = decode.metric("pdserve_transfer_descriptors_total") - before
        if prefill_size == decode_size:
            assert sources <= descriptors <= sent * sources
        else:
            assert descriptors == sent * sources > 0
        # Pulled, not recomputed: D starts from P's first token (protocol 7) and computes no prompt token
        # (it computed the last one before); every prompt token's KV came across.
        assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before == 0
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)


@pytest.mark.parametrize("shapes", [LLAMA], indirect=True)  # the tiny Llama's workers
def test_a_partial_prefix_hit_on_a_decode_worker_of_another_tp_size_pulls_only_the_missing_tail(shapes):
    """P at TP=1, D at TP=2 with its prefix cache on: a second prompt sharing the first blocks of an
    earlier one reads only the blocks past the shared ones, and the answer still matches transformers."""
    oracle, _, workers = shapes
    prefill, decode = workers["prefill", 1], workers["decode", 2]
    model = httpx.get(decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    shared = random_prompt(6 * BLOCK_SIZE, VOCAB, 7)
    first, second = shared + random_prompt(9, VOCAB, 8), shared + random_prompt(9, VOCAB, 9)
    reset_prefix_cache(decode)  # nothing of `shared` cached on D from another test's run
    pulled = []
    for index, prompt in enumerate((first, second)):
        body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        params, response = two_legs(prefill, decode, "/v1/completions", body, f"prefix-{index}")
        assert response.status_code == 200, response.text
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        sent = sum(len(ids) for ids in params["remote_block_ids"])
        pulled.append((cached, sent, (decode.metric("pdserve_transfer_bytes_total") - bytes_before)
                       / (2 * page_bytes(decode))))
    (cached_first, sent_first, blocks_first), (cached_second, sent_second, blocks_second) = pulled
    assert cached_first == 0 and blocks_first == sent_first
    assert cached_second == 6 * BLOCK_SIZE  # the shared blocks, from D's own cache
    assert blocks_second == sent_second - 6 > 0  # only the tail travelled
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)
