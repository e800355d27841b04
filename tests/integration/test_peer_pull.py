"""Peer pulls with real processes and real NIXL: two prefill workers of the embedded model. Worker A
computes a long prompt; the same prompt and more goes to worker B with a peer hint naming A: B reads
A's blocks of the prefix, computes only the new part, answers what A answers (greedy, token for
token), and A holds nothing pinned afterwards. A hint naming a dead peer, or sent without the internal
token, costs only a computed prompt with the same answer."""

from __future__ import annotations

import httpx
import pytest

from bench.lib.launch import metric_sum
from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint
from tests.integration.cluster import Worker, free_port, start_workers, stop_all, wait_for

pytestmark = pytest.mark.slow

TOKEN = "peer-pull-token"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}
BLOCK = 16
PREFIX = [200 + (i * 37) % 900 for i in range(7 * BLOCK + 5)]  # 7 full blocks and a partial one


@pytest.fixture(scope="module")
def workers(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "200", "--internal-token", TOKEN, "--peer-pull-min-tokens", "32"]
    a, b = (Worker("prefill", free_port(), str(logs / f"{name}.log"), common, device) for name in "ab")
    started = start_workers(a, b)
    try:
        yield a, b
    finally:
        stop_all(a, b, *started)


def complete(worker: Worker, prompt: list[int], headers: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = httpx.post(worker.url + "/v1/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return response.json()


def hint_for(worker: Worker, num_tokens: int, port: int = 0) -> dict:
    hint = PeerHint(host="127.0.0.1", port=port or worker.internal_port, num_tokens=num_tokens)
    return {PEER_HINT_HEADER: hint.to_header()}


def computed(worker: Worker) -> float:
    return metric_sum(worker.url, "pdserve_engine_computed_prompt_tokens_total")


def test_a_prefix_held_by_a_peer_is_pulled_not_computed(workers):
    a, b = workers
    complete(a, PREFIX, AUTH)
    longer = PREFIX + [300 + i for i in range(3 * BLOCK)]
    before = computed(b)
    answer = complete(b, longer, {**AUTH, **hint_for(a, len(PREFIX))})
    num_pulled = 7 * BLOCK  # A's full blocks of the prefix
    assert computed(b) - before == len(longer) - num_pulled
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") == num_pulled
    assert metric_sum(b.url, "pdserve_kv_prefix_cache_hits_by_medium_tokens_total", medium="peer") == num_pulled
    assert wait_for(lambda: metric_sum(a.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10), \
        "A still holds the peer's pin"
    assert metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total") == num_pulled
    reference = complete(a, longer, AUTH)  # A computes the new part over its own cached prefix
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    # B now holds the pulled blocks as its own: the same prompt again computes only its last token.
    again_before = computed(b)
    complete(b, longer, AUTH)
    assert computed(b) - again_before == len(longer) - (len(longer) - 1) // BLOCK * BLOCK


def test_a_dead_or_unauthenticated_hint_costs_only_a_recompute(workers):
    a, b = workers
    prompt = [150 + (i * 11) % 700 for i in range(6 * BLOCK + 3)]
    complete(a, prompt, AUTH)
    reference = complete(a, prompt, AUTH)
    failed_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="failed")
    before = computed(b)
    dead = complete(b, prompt, {**AUTH, **hint_for(a, len(prompt), port=free_port())})
    assert dead["choices"][0]["text"] == reference["choices"][0]["text"]
    assert computed(b) - before == len(prompt)
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="failed") - failed_before == 6 * BLOCK
    # Without the token the hint is ignored: nothing is asked of A (the prompt is cached on B by now).
    pinned_before = metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total")
    other = prompt[:-1] + [999]
    unauthenticated = complete(b, other, hint_for(a, len(other)))
    assert unauthenticated["usage"]["prompt_tokens"] == len(other)
    assert metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total") == pinned_before
