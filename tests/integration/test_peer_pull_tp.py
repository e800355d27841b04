"""Peer pulls between workers of different TP sizes and block sizes, with real processes and real NIXL
(gloo between a worker's ranks): a TP=2 prefill worker paging 4-token blocks lends a prefix to a TP=1
one paging 8-token blocks through a peer hint, and the other way round. The puller computes only the
rest of the prompt (its metrics say so), each of its ranks having read its KV heads of the holder's
pinned blocks from the holder ranks holding them; its greedy answer is transformers' (the whole prompt
computed from scratch), and the holder holds nothing pinned afterwards.

One pair of workers on one tiny Llama (4 query / 2 KV heads) serves both directions; each direction
sends prompts of its own, so neither finds the other's blocks in its own cache."""

from __future__ import annotations

import httpx
import pytest

from bench.lib.launch import metric_sum
from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint
from tests.integration.cluster import Worker, free_port, start_workers, stop_all, wait_for
from tests.integration.test_tensor_parallel import NUM_NEW, VOCAB, assert_greedy_parity, tiny_llama, token_ids
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import random_prompt

pytestmark = pytest.mark.slow

TOKEN = "peer-pull-tp-token"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}
SMALL_BLOCK, LARGE_BLOCK = 4, 8  # the TP=2 worker's, the TP=1 worker's
NUM_PULLED = 5 * LARGE_BLOCK  # the prefix's whole blocks of either size
PREFIX_TOKENS = NUM_PULLED + 3


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """{TP size: prefill worker} on one tiny model, with its transformers oracle."""
    model_dir = str(tmp_path_factory.mktemp("llama-4q-2kv"))
    oracle = tiny_llama(model_dir, 4, 2, True, seed=7)
    logs = tmp_path_factory.mktemp("logs")

    def prefill(tp_size: int, block_size: int) -> Worker:
        return Worker("prefill", free_port(), str(logs / f"prefill-tp{tp_size}.log"),
                      ["--model", model_dir, "--dtype", "float32", "--num-blocks", "96", "--block-size",
                       str(block_size), "-tp", str(tp_size), "--internal-token", TOKEN,
                       # every hint of a block or more is followed, whatever this machine's prices say
                       "--peer-pull-min-tokens", str(LARGE_BLOCK), "--peer-pull-decision", "threshold"])

    by_tp = {2: prefill(2, SMALL_BLOCK), 1: prefill(1, LARGE_BLOCK)}
    start_workers(*by_tp.values())
    try:
        yield oracle, by_tp
    finally:
        stop_all(*by_tp.values())


def complete(worker: Worker, prompt: list[int], headers: dict) -> list[int]:
    model = httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    response = httpx.post(worker.url + "/v1/completions", json=body, headers={**AUTH, **headers}, timeout=120)
    assert response.status_code == 200, response.text
    return token_ids(response.json()["choices"][0]["logprobs"]["tokens"])


def hint_for(holder: Worker, num_tokens: int) -> dict:
    hint = PeerHint(host="127.0.0.1", port=holder.internal_port, num_tokens=num_tokens)
    return {PEER_HINT_HEADER: hint.to_header()}


@pytest.mark.parametrize("holder_tp, puller_tp", [(2, 1), (1, 2)])
def test_a_prefix_lent_between_tp_sizes_is_read_not_computed_and_answers_as_transformers(workers, holder_tp,
                                                                                         puller_tp):
    oracle, by_tp = workers
    holder, puller = by_tp[holder_tp], by_tp[puller_tp]
    prefix = random_prompt(PREFIX_TOKENS, VOCAB, seed=holder_tp)
    complete(holder, prefix, {})  # the holder computes and caches the prefix
    longer = prefix + random_prompt(2 * LARGE_BLOCK + 1, VOCAB, seed=10 + holder_tp)

    def counted(name: str, **labels: str) -> float:
        return metric_sum(puller.url, name, **labels)

    computed_before = counted("pdserve_engine_computed_prompt_tokens_total")
    pulled_before = counted("pdserve_kv_peer_pull_tokens_total", result="pulled")
    refused_before = counted("pdserve_kv_peer_pull_tokens_total", result="refused")
    hits_before = counted("pdserve_kv_prefix_cache_hits_by_medium_tokens_total", medium="peer")
    lent_before = metric_sum(holder.url, "pdserve_kv_peer_pinned_tokens_total", medium="device")
    answer = complete(puller, longer, hint_for(holder, len(prefix)))
    assert counted("pdserve_kv_peer_pull_tokens_total", result="refused") == refused_before
    assert counted("pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before == NUM_PULLED
    assert counted("pdserve_engine_computed_prompt_tokens_total") - computed_before == len(longer) - NUM_PULLED
    assert counted("pdserve_kv_prefix_cache_hits_by_medium_tokens_total", medium="peer") - hits_before == NUM_PULLED
    assert metric_sum(holder.url, "pdserve_kv_peer_pinned_tokens_total", medium="device") - lent_before == NUM_PULLED
    assert wait_for(lambda: metric_sum(holder.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10), \
        "the holder still holds the puller's pin"
    want, margins = hf_greedy_with_margins(oracle, longer, NUM_NEW)
    assert_greedy_parity(answer, want, margins)
