"""The MoE families at TP=2 as real processes (gloo between the ranks): greedy parity with
transformers in float32 for a tiny gpt-oss (4 query / 2 KV heads split one KV head a rank, sinks
going with their query heads, a 16-token window shorter than the prompt, 6 experts top-2 sliced
over the ranks) and a tiny Qwen3-MoE (one dense layer among the sparse ones); then P/D with real
NIXL from a TP=2 gpt-oss prefill worker to a TP=1 decode worker, window blocks included."""

from __future__ import annotations

import pytest

from tests.integration.cluster import start_workers, stop_all, two_legs
from tests.integration.test_tensor_parallel import (
    NUM_NEW, assert_greedy_parity, greedy, token_ids, tp_worker, worker_model)
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import (
    GPT_OSS_VOCAB, GPT_OSS_WINDOW, QWEN_MOE_VOCAB, make_tiny_gpt_oss, make_tiny_qwen3_moe, random_prompt,
)

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

FAMILIES = {"gpt_oss": (make_tiny_gpt_oss, GPT_OSS_VOCAB), "qwen3_moe": (make_tiny_qwen3_moe, QWEN_MOE_VOCAB)}


@pytest.fixture(scope="module")
def moe_tp2(tmp_path_factory):
    """{family: (oracle, vocab, TP=2 serve worker)} plus, under "pd", a TP=2 gpt-oss prefill worker
    and a TP=1 decode worker that fails rather than recomputes (an answer proves the pull)."""
    logs = tmp_path_factory.mktemp("moe-tp-logs")
    found, workers = {}, []
    for family, (make, vocab) in FAMILIES.items():
        directory = str(tmp_path_factory.mktemp(family))
        worker = tp_worker("serve", directory, logs, family, "-tp", "2")
        found[family] = (make(directory), vocab, worker, directory)
        workers.append(worker)
    gpt_dir = found["gpt_oss"][3]
    prefill = tp_worker("prefill", gpt_dir, logs, "prefill", "-tp", "2")
    decode = tp_worker("decode", gpt_dir, logs, "decode", "--kv-failure-policy", "fail", "--no-prefix-caching")
    found["pd"] = (prefill, decode)
    start_workers(*workers, prefill, decode)
    yield found
    stop_all(*workers, prefill, decode)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_at_tp2_greedy_matches_transformers(moe_tp2, family):
    oracle, vocab, worker, _ = moe_tp2[family]
    for seed, length in ((1, 9), (2, 3 * GPT_OSS_WINDOW + 5)):  # the second prompt outgrows gpt-oss's window
        prompt = random_prompt(length, vocab, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        assert_greedy_parity(greedy(worker, prompt), want, margins)
    assert worker.metric("pdserve_engine_tensor_parallel_ranks") == 2


def test_gpt_oss_pd_from_tp2_prefill_to_tp1_decode_matches_transformers(moe_tp2):
    oracle = moe_tp2["gpt_oss"][0]
    prefill, decode = moe_tp2["pd"]
    prompt = random_prompt(3 * GPT_OSS_WINDOW + 7, GPT_OSS_VOCAB, 4)
    want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
    body = {"model": worker_model(decode), "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    params, response = two_legs(prefill, decode, "/v1/completions", body, "moe-tp-pd")
    assert params["tp_size"] == 2
    assert response.status_code == 200, response.text
    assert_greedy_parity(token_ids(response.json()["choices"][0]["logprobs"]["tokens"]), want, margins)
    assert decode.metric("pdserve_transfer_bytes_total") > bytes_before
