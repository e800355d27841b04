"""D computes a P/D prompt itself after all (its pull failed, policy recompute) yet goes on from the first token
P sampled, in one process: real prefill, decode and colocated engines of one tiny Qwen3, pages over the fake
transport. P's ticket is forced to carry a token D's own sampler would not draw (a sampled draw that came out
otherwise on P), so an answer that starts from D's own draw cannot pass: the recomputed answer must equal the
pulled one, token 1 and its logprobs included, and the seeded continuation too."""

from __future__ import annotations

import pytest

from tests.engine.inprocess import DECODE_REQUEST, complete, metric_value, tiny_qwen3_trio
from tests.tiny_models import QWEN_VOCAB

BLOCK_SIZE = 4  # tests/engine/inprocess.py
PROMPT = [11 + (5 * j) % 250 for j in range(30)]
# Sampled (not greedy), yet top_k 1 makes D's own draw its argmax: P's forced token is never D's pick.
TOP_ONE = {"max_tokens": 6, "temperature": 1.0, "top_k": 1, "logprobs": 2, "ignore_eos": True}
SEEDED = {"max_tokens": 6, "temperature": 0.9, "seed": 77, "ignore_eos": True}

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with tiny_qwen3_trio(str(tmp_path_factory.mktemp("qwen3"))) as trio:
        yield trio


def force_first_token(prefill, params: dict) -> int:
    """Replace the token in P's pinned ticket by another one (as if P's sampled draw had come out otherwise)."""
    lease = prefill.built.kv_side.connector.leases._leases[params["remote_request_id"]]
    first = lease.ticket.first_token
    forced = 3 + (first.token_id - 3 + QWEN_VOCAB // 2) % (QWEN_VOCAB - 3)
    assert forced != first.token_id
    lease.ticket = lease.ticket.model_copy(update={"first_token": first.model_copy(update={"token_id": forced})})
    return forced


async def through_pd(prefill, decode, body: dict, request_id: str, *, pull_fails: bool) -> dict:
    answer = await complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST}, request_id)
    params = answer["kv_transfer_params"]
    force_first_token(prefill, params)
    decode.transport.fail_reads = pull_fails  # the READ fails on D's engine thread: D prefills the prompt
    try:
        return await complete(decode, {**body, "kv_transfer_params": params}, request_id)
    finally:
        decode.transport.fail_reads = False


def counters(decode) -> tuple[float, float, float, float]:
    transfer = decode.metrics.transfer
    return (metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total"),
            metric_value(decode.metrics, "pdserve_pd_first_token_kept_recomputing_total"),
            transfer.recomputed_prompt_tokens.labels(reason="pull_failed")._value.get(),
            metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total"))


@pytest.mark.parametrize("sampling", [TOP_ONE, SEEDED], ids=["sampled-top-one-with-logprobs", "seeded"])
async def test_a_recomputed_prompt_goes_on_from_ps_token_as_the_pulled_path_does(workers, sampling):
    colocated, prefill, decode = workers
    body = {**sampling, "prompt": PROMPT}
    own = (await complete(colocated, body, f"own-{len(sampling)}"))["choices"][0]
    before = counters(decode)
    pulled = (await through_pd(prefill, decode, body, f"pulled-{len(sampling)}", pull_fails=False))["choices"][0]
    after_pull = counters(decode)
    recomputed_answer = await through_pd(prefill, decode, body, f"recomputed-{len(sampling)}", pull_fails=True)
    recomputed = recomputed_answer["choices"][0]
    after_recompute = counters(decode)

    assert pulled["text"] != own["text"]  # P's forced token 1 shapes the answer: D's own draw would not give it
    assert recomputed["text"] == pulled["text"]
    assert recomputed_answer["usage"]["completion_tokens"] == sampling["max_tokens"]
    if "logprobs" in sampling:  # token 1's as P's ticket gave them, the rest D's own, alike on both paths
        assert recomputed["logprobs"]["tokens"] == pulled["logprobs"]["tokens"]
        assert recomputed["logprobs"]["token_logprobs"] == pytest.approx(pulled["logprobs"]["token_logprobs"],
                                                                         abs=1e-5)
        assert recomputed["logprobs"]["top_logprobs"][0] == pulled["logprobs"]["top_logprobs"][0]
    # The pulled leg started from P's pages; the failed one computed the prompt (and token 1) and kept P's token.
    assert (after_pull[0] - before[0], after_pull[1] - before[1], after_pull[3] - before[3]) == (1, 0, 0)
    assert (after_recompute[0] - after_pull[0], after_recompute[1] - after_pull[1]) == (0, 1)
    assert after_recompute[2] - after_pull[2] == len(PROMPT)
    # It computed the prompt's tail here: the pulled leg left the prompt's full blocks in D's prefix cache.
    assert after_recompute[3] - after_pull[3] == len(PROMPT) % BLOCK_SIZE
