"""The whole decode path in one process: HTTP app -> engine -> P/D side -> fake transport, against a
real prefill worker's app and a colocated run of the same tiny model (the real-NIXL tests stay in
tests/integration)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import yaml

from pdserve.api.kv_transfer import KV_RECOMPUTED_HEADER
from pdserve.api.sampling import SamplingParams
from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric
from tests.engine.inprocess import DECODE_REQUEST, metric_value, start_worker
from tests.tiny_models import make_tiny_qwen3

ALERTS_PATH = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
METRIC_NAME = re.compile(r"\b(pdserve_[a-z0-9_]+)")

PROMPTS = [[11 + (7 * i + j) % 250 for j in range(30 + 5 * i)] for i in range(4)]
BODY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return directory


@pytest.fixture
def fabric():
    return FakeFabric()


@pytest.fixture
def colocated(qwen_dir, fabric):
    worker = start_worker("colocated", qwen_dir, fabric)
    yield worker
    worker.close()


@pytest.fixture
def prefill(qwen_dir, fabric):
    worker = start_worker("prefill", qwen_dir, fabric)
    yield worker
    worker.close()


async def local_text(worker, prompt, **extra) -> str:
    async with worker.client() as client:
        response = await client.post("/v1/completions", json={**BODY, "prompt": prompt, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def prefill_params(prefill, prompt, request_id: str) -> dict:
    async with prefill.client() as client:
        response = await client.post("/v1/completions", headers={"X-Request-Id": request_id},
                                     json={**BODY, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


async def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def test_full_decode_path_in_process_equals_a_local_run(qwen_dir, fabric, colocated, prefill):
    decode = start_worker("decode", qwen_dir, fabric, prefill_app=prefill.app)
    try:
        for index, prompt in enumerate(PROMPTS[:2]):
            request_id = f"trace-{index}"
            params = await prefill_params(prefill, prompt, request_id)
            assert params["remote_request_id"] == request_id, "P's lease table must use the client's id"
            async with decode.client() as client:
                response = await client.post("/v1/completions", headers={"X-Request-Id": request_id},
                                             json={**BODY, "prompt": prompt, "kv_transfer_params": params})
            assert response.status_code == 200, response.text
            assert response.headers["x-request-id"] == request_id
            assert KV_RECOMPUTED_HEADER.lower() not in response.headers  # the KV was pulled
            assert response.json()["choices"][0]["text"] == await local_text(colocated, prompt)
        assert metric_value(decode.metrics, "pdserve_transfer_descriptors_total") > 0
        assert await wait_until(lambda: prefill.built.engine.load_report().num_pinned_blocks == 0)
        assert metric_value(decode.metrics, "pdserve_transfer_failures_total") == 0
        # D starts from P's first token (protocol 7): it computes no prompt token (it computed the last one
        # of each prompt before).
        assert metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total") == 0
        assert metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total") == 2
    finally:
        decode.close()


async def test_a_pd_leg_computed_on_decode_says_so_to_the_proxy_and_is_counted(qwen_dir, fabric, colocated, prefill):
    decode = start_worker("decode", qwen_dir, fabric, prefill_app=prefill.app)
    other_prompt = [token + 1 for token in PROMPTS[0]]  # as long as PROMPTS[0], other tokens
    try:
        mismatched = await prefill_params(prefill, PROMPTS[0], "mismatch")
        answers = {}
        for name, prompt, params in (("prompt_mismatch", other_prompt, mismatched),
                                     ("pull_failed", PROMPTS[1], await prefill_params(prefill, PROMPTS[1], "fails"))):
            decode.transport.fail_reads = name == "pull_failed"  # the READ fails on the engine thread
            async with decode.client() as client:
                answers[name] = await client.post("/v1/completions", json={**BODY, "prompt": prompt,
                                                                            "kv_transfer_params": params})
            assert answers[name].status_code == 200, answers[name].text
            assert answers[name].headers[KV_RECOMPUTED_HEADER] == "1", name
            assert answers[name].json()["choices"][0]["text"] == await local_text(colocated, prompt), name
            recomputed = decode.metrics.transfer.recomputed_prompt_tokens.labels(reason=name)._value.get()
            assert recomputed == len(prompt), name
        # D told P at once that it will not read the other prompt's pin (a failed READ's pin waits for its lease).
        assert await wait_until(lambda: "mismatch" not in prefill.built.kv_side.connector.leases)
    finally:
        decode.close()


async def _stream_gaps(worker, prompt, max_tokens: int, started: asyncio.Event) -> list[float]:
    """Inter-token gaps of one local request read straight from the engine's stream (an in-memory
    HTTP transport would buffer the SSE body); `started` is set after its fifth token."""
    engine = worker.built.engine
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = GenerationRequest(engine.request_ids.reserve(None), tuple(prompt), sampling)
    gaps, last = [], None
    stream = engine.generate(request)
    try:
        async for output in stream:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) == 5:
                started.set()
    finally:
        await stream.aclose()
    assert len(gaps) == max_tokens - 1
    return gaps


async def test_a_prefill_worker_whose_data_path_never_connects_does_not_delay_local_streams(
        qwen_dir, fabric, prefill):
    # The order is forced, no clock is raced: P's HTTP answers but its data path stays silent (the connect
    # timeout is far away) while a whole local stream runs to its end; only then does P's agent go away and
    # the waiting requests fail. An engine thread that waited on the connect would never finish the stream.
    decode = start_worker("decode", qwen_dir, fabric, prefill_app=prefill.app,
                          transfer={"connect_timeout_s": 3600.0, "failure_policy": "fail"})
    decode.transport.hold_connects = True
    try:
        params = [await prefill_params(prefill, prompt, f"dead-{i}") for i, prompt in enumerate(PROMPTS)]
        await local_text(decode, PROMPTS[1])  # the app's first-request work is not what is measured

        async def remote(index: int):
            async with decode.client() as client:
                return await client.post("/v1/completions", json={**BODY, "prompt": PROMPTS[index],
                                                                  "kv_transfer_params": params[index]})

        waiting = [asyncio.create_task(remote(i)) for i in range(len(PROMPTS))]
        assert await wait_until(lambda: decode.transport.num_pending_connects == 1, timeout_s=60)
        gaps = await asyncio.wait_for(_stream_gaps(decode, PROMPTS[0], 200, asyncio.Event()), timeout=300)
        assert len(gaps) == 199 and decode.transport.num_pending_connects == 1
        assert not any(task.done() for task in waiting), "a request went on without its data path"

        fabric.kill(prefill.transport.agent_name)
        decode.transport.hold_connects = False
        for response in await asyncio.gather(*waiting):
            assert response.status_code == 503 and response.json()["error"]["type"] == "kv_pull_failed"
        attempts = decode.transport.num_connect_attempts
        assert attempts == 1  # the four requests waited on one connection
        # The dead peer is remembered: the next request fails without another attempt.
        response = await remote(0)
        assert response.status_code == 503 and "unreachable" in response.json()["error"]["message"]
        assert decode.transport.num_connect_attempts == attempts
    finally:
        decode.close()


async def test_the_proxys_release_call_frees_a_pinned_prefill_at_once(prefill):
    params = await prefill_params(prefill, PROMPTS[0], "released-early")
    assert metric_value(prefill.metrics, "pdserve_transfer_pinned_blocks") > 0
    release = {"remote_request_id": params["remote_request_id"], "remote_engine_id": params["remote_engine_id"],
               "remote_epoch": params["remote_epoch"], "remote_pin_nonce": params["remote_pin_nonce"]}
    async with prefill.client() as client:
        bare = await client.post("/internal/kv/release", json={**release, "remote_pin_nonce": None})
        stale = await client.post("/internal/kv/release", json={**release, "remote_epoch": "0" * 16})
        malformed = await client.post("/internal/kv/release", json={"remote_request_id": 5})
        oversized = await client.post("/internal/kv/release", json={**release, "padding": "x" * 10_000})
        accepted = await client.post("/internal/kv/release", json=release)
    assert stale.status_code == 409 and malformed.status_code == 400 and bare.status_code == 400
    assert oversized.status_code == 413  # read up to its bound, never whole
    assert accepted.status_code == 202
    assert await wait_until(lambda: metric_value(prefill.metrics, "pdserve_transfer_pinned_blocks") == 0)
    assert await wait_until(lambda: prefill.built.kv_manager.pool.num_in_use_by_group(0) == 0)
    assert "released-early" not in prefill.built.engine.request_ids


async def test_a_prefill_worker_refuses_remote_decode_prefills_past_its_pinned_limit(qwen_dir, fabric):
    prefill = start_worker("prefill", qwen_dir, fabric, num_blocks=64, transfer={"max_pinned_share": 0.25})
    try:
        limit = metric_value(prefill.metrics, "pdserve_transfer_pinned_limit_blocks")
        assert limit == int(0.25 * 63)
        pinned = []
        async with prefill.client() as client:
            for index in range(10):
                response = await client.post("/v1/completions", headers={"X-Request-Id": f"pin-{index}"}, json={
                    **BODY, "prompt": PROMPTS[3], "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST})
                if response.status_code != 200:
                    break
                pinned.append(response.json()["kv_transfer_params"])
                assert metric_value(prefill.metrics, "pdserve_transfer_pinned_blocks") <= limit
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert pinned and metric_value(prefill.metrics, "pdserve_transfer_pinned_refusals_total") >= 1
        async with prefill.client() as client:  # local requests still run
            assert (await client.post("/v1/completions", json={**BODY, "prompt": PROMPTS[0]})).status_code == 200
            scrape = (await client.get("/metrics")).text
        assert_pinned_alert_would_fire(scrape, limit)
    finally:
        prefill.close()


def assert_pinned_alert_would_fire(scrape: str, limit: float) -> None:
    """The pinned alerts of deploy/prometheus/alerts.yml read series this worker's /metrics really serves,
    and the one for the limit sees a refusal although pinned blocks sit below 90% of the limit (long prompts)."""
    samples = {}
    for line in scrape.splitlines():
        if line and not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            samples[name_and_labels.split("{", 1)[0]] = float(value)
    rules = yaml.safe_load(ALERTS_PATH.read_text())
    exprs = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    used = {name for alert, expr in exprs.items() if "Pinned" in alert for name in METRIC_NAME.findall(expr)}
    assert "pdserve_transfer_pinned_refusals_total" in used and used <= samples.keys(), used - samples.keys()
    assert samples["pdserve_transfer_pinned_limit_blocks"] == limit
    assert samples["pdserve_transfer_pinned_refusals_total"] >= 1
    assert 0 < samples["pdserve_transfer_pinned_blocks"] < 0.9 * limit, "a refusal below the limit's last 10%"
    assert "pdserve_transfer_pinned_blocks" not in exprs["PdserveKVPinnedBlocksAtLimit"], "it would miss this refusal"
