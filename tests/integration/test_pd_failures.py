"""Dead and restarted peers: nothing leaks, nothing hangs, no wrong tokens."""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.integration.cluster import (
    Worker, decode_leg, free_port, prefill_leg, same_path_reference, start_workers, stop_all, two_legs, wait_for)
from tests.integration.prompts import aligned_chat_prompt

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LEASE_S = 4.0
STORY = "Once upon a time in a small village by the sea, there lived"


@functools.cache
def story() -> dict:
    """The request body of every test here; its prompt ends one token past a block boundary
    (the same-path reference needs it)."""
    return {"model": MODEL, "prompt": aligned_chat_prompt(STORY), "max_tokens": 16, "temperature": 0, "logprobs": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "300"]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), [*common, "--kv-lease-s", str(LEASE_S)], device)
    recompute = Worker("decode", free_port(), str(logs / "decode-recompute.log"), [*common, "--no-prefix-caching"],
                       device)
    fail = Worker("decode", free_port(), str(logs / "decode-fail.log"),
                  [*common, "--no-prefix-caching", "--kv-failure-policy", "fail", "--kv-pull-timeout-s", "5"], device)
    start_workers(prefill, recompute, fail)
    current = {"prefill": prefill, "recompute": recompute, "fail": fail}
    yield current
    stop_all(*current.values())  # tests replace a restarted prefill worker here: stop that one too


def pd_logprobs(response) -> list[float]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def local_text(decode: Worker) -> str:
    response = httpx.post(decode.url + "/v1/completions", json=story(), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_prefill_restart_is_rehandshaked_transparently(cluster, tmp_path):
    prefill, decode = cluster["prefill"], cluster["recompute"]
    expected = same_path_reference(prefill, "/v1/completions", story(), "reference")["choices"][0]["logprobs"]
    _, first = two_legs(prefill, decode, "/v1/completions", story(), "before-restart")
    assert pd_logprobs(first) == expected["token_logprobs"]
    handshakes = decode.metric("pdserve_transfer_handshakes_total")
    prefill.stop()
    restarted = Worker("prefill", prefill.port, prefill.log_path, prefill.extra_args, prefill.device,
                       internal_port=prefill.internal_port)
    start_workers(restarted)
    cluster["prefill"] = restarted
    # The restart emptied P's prefix cache: warm it as before, so that P samples the first token (which D
    # starts from, protocol 7) on the reference's path again.
    assert same_path_reference(restarted, "/v1/completions", story(), "reference-again")["choices"][0][
        "logprobs"] == expected
    params, second = two_legs(restarted, decode, "/v1/completions", story(), "after-restart")
    assert pd_logprobs(second) == expected["token_logprobs"]
    assert decode.metric("pdserve_transfer_handshakes_total") == handshakes + 1
    assert decode.metric("pdserve_transfer_failures_total") == 0


def test_stale_epoch_after_restart_is_a_4xx(cluster):
    prefill, decode = cluster["prefill"], cluster["recompute"]
    params = prefill_leg(prefill, "/v1/completions", story(), "stale").json()["kv_transfer_params"]
    stale = dict(params, remote_epoch="deadbeefdeadbeef")
    response = decode_leg(decode, "/v1/completions", story(), stale, "stale")
    assert response.status_code == 409, response.text
    assert response.json()["error"]["type"] == "kv_params_stale"


def test_prefill_killed_after_returning_params_recompute_and_fail_policies(cluster, tmp_path):
    prefill = cluster["prefill"]
    recompute, fail = cluster["recompute"], cluster["fail"]
    expected = local_text(recompute)
    params_a = prefill_leg(prefill, "/v1/completions", story(), "orphan-a").json()["kv_transfer_params"]
    params_b = prefill_leg(prefill, "/v1/completions", story(), "orphan-b").json()["kv_transfer_params"]
    prefill.kill()

    recomputed = decode_leg(recompute, "/v1/completions", story(), params_a, "orphan-a")
    assert recomputed.status_code == 200, recomputed.text
    assert recomputed.json()["choices"][0]["text"] == expected

    failed = decode_leg(fail, "/v1/completions", story(), params_b, "orphan-b")
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["type"] == "kv_pull_failed"

    for decode in (recompute, fail):  # both stay healthy and serve local requests
        assert httpx.get(decode.url + "/health", timeout=5).status_code == 200
        assert local_text(decode) == expected

    restarted = Worker("prefill", prefill.port, prefill.log_path, prefill.extra_args, prefill.device,
                       internal_port=prefill.internal_port)
    start_workers(restarted)
    cluster["prefill"] = restarted


def test_decode_killed_before_pulling_lets_prefill_reclaim_within_the_lease(cluster):
    """Runs last in this module: the decode worker it kills is the module's fail-policy one (starting one
    of its own to kill cost a worker start)."""
    prefill, doomed = cluster["prefill"], cluster["fail"]
    response = prefill_leg(prefill, "/v1/completions", story(), "doomed")
    assert response.status_code == 200
    assert prefill.metric("pdserve_transfer_pinned_blocks") > 0
    doomed.kill()
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, timeout_s=LEASE_S + 3)
    assert httpx.get(prefill.url + "/health", timeout=5).status_code == 200
