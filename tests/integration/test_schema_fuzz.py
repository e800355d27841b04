"""Schema fuzzing with a real tool: schemathesis drives the OpenAPI document a worker and the proxy
serve (pdserve/api/openapi.py) against real processes (a colocated worker; the proxy in front of a
prefill and a decode worker), a bounded number of examples per operation, valid and invalid bodies
alike. The property: no 5xx, no hang, and afterwards no request, block or pin left behind.
The fields the schema cannot express are fuzzed by tests/engine/test_fuzz_openai.py (hypothesis)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pdserve.api.openapi import OPENAPI_PATH, PROTOCOL_VERSION_LABEL, openapi_document
from tests.integration.cluster import ProxyProcess, Worker, free_port, start_workers, stop_all, wait_for
from tests.tiny_models import make_tiny_qwen3

pytestmark = pytest.mark.slow

SCHEMA = schemathesis.openapi.from_dict(openapi_document("pdserve worker", PROTOCOL_VERSION_LABEL))
FUZZ = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CALL_TIMEOUT_S = 60  # "no hang": every answer, streams included, well within this


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(model_dir)
    logs = tmp_path_factory.mktemp("fuzz-logs")
    common = ["--model", model_dir, "--dtype", "float32", "--num-blocks", "96", "--max-model-len", "64"]
    pd = ["--kv-lease-s", "6", "--kv-heartbeat-s", "1", "--kv-pull-timeout-s", "2"]
    workers = {role: Worker(role, free_port(), str(logs / f"{role}.log"), common + (pd if role != "serve" else []))
               for role in ("serve", "prefill", "decode")}
    start_workers(*workers.values())
    proxy = ProxyProcess(free_port(), str(logs / "proxy.log"),
                         ["--prefill", workers["prefill"].url, "--decode", workers["decode"].url])
    try:
        assert wait_for(proxy.is_ready, 60), "the proxy did not become ready"
        yield {"worker": workers["serve"].url, "proxy": proxy.url, "workers": workers}
    finally:
        stop_all(proxy, *workers.values())


def call(case, base_url: str) -> None:
    response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}"


def test_both_serve_the_document_that_is_fuzzed(targets):
    for name in ("worker", "proxy"):
        served = httpx.get(targets[name] + OPENAPI_PATH, timeout=10).json()
        assert served["paths"] == SCHEMA.raw_schema["paths"] and served["openapi"] == "3.1.0", name


@SCHEMA.parametrize()
@FUZZ
def test_the_worker_never_answers_a_5xx_whatever_the_body(case, targets):
    call(case, targets["worker"])


@SCHEMA.parametrize()
@FUZZ
def test_the_proxy_never_answers_a_5xx_whatever_the_body(case, targets):
    call(case, targets["proxy"])


def test_after_the_fuzzing_no_request_block_or_pin_is_left(targets):
    """Runs last in this module."""
    workers = targets["workers"]
    # The fuzz reached both sides of the validation on the worker it drove directly.
    served = workers["serve"].metric("pdserve_request_finished_total")
    refused = workers["serve"].metric("pdserve_request_errors_total")
    print(f"worker: {served:.0f} requests ended in the engine, {refused:.0f} refused")
    assert served >= 10 and refused >= 10
    for worker in workers.values():
        assert wait_for(lambda: worker.metric("pdserve_scheduler_running_requests") == 0
                        and worker.metric("pdserve_scheduler_waiting_requests") == 0, 30), worker.role
    assert wait_for(lambda: workers["prefill"].metric("pdserve_transfer_pinned_blocks") == 0, 30)
    for worker in workers.values():
        answer = httpx.post(worker.url + "/v1/completions", timeout=30,
                            json={"model": worker_model(worker), "prompt": [5, 6, 7], "max_tokens": 2})
        assert answer.status_code == 200, (worker.role, answer.text)
    answer = httpx.post(targets["proxy"] + "/v1/completions", timeout=30,
                        json={"model": worker_model(workers["decode"]), "prompt": [5, 6, 7], "max_tokens": 2})
    assert answer.status_code == 200, answer.text


def worker_model(worker: Worker) -> str:
    return httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]
