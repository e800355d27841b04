"""pdserve workers as llm-d and the Gateway API Inference Extension see them (real processes, real
NIXL over UCX, the embedded SmolLM2): the llm-d routing sidecar's P/D sequence replayed byte for
byte against a prefill and a decode worker, its fallback to decode alone, and the model-server
protocol's gauges (vllm:*) an endpoint picker scrapes, equal to pdserve's own under load.

The sidecar replayed is the `nixlv2` connector of llm-d-inference-scheduler v0.8.0 (commit
05c91f0d655fbd7ea71fc50949c899c360d06f07); `tests/integration/pd_sidecar.py` says which source files
and what each leg carries. The workers run as deploy/llm-d/ runs them: no internal token (the sidecar
carries none), the decode worker behind its sidecar, failing a request rather than recomputing a
prompt whose KV it could not pull (so an answer proves the pull).
"""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import Worker, free_port, start_workers, stop_all, wait_for
from tests.integration.pd_sidecar import (
    PREFILL_HEADER, SidecarReplay, decode_leg_body, go_marshal, go_unmarshal, prefill_leg_body)
from tests.integration.test_prometheus import query as prometheus_query, start_prometheus

MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 400  # 399 usable: the null block is never counted
PINNED_SHARE = 0.05  # P refuses a new remote-decode prefill past 19 pinned blocks (the 503 fallback below)
LONG_CONTEXT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))  # ~32 blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("llm-d-logs")
    common = ["--num-blocks", str(NUM_BLOCKS)]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"),
                     [*common, "--kv-lease-s", "60", "--kv-max-pinned-share", str(PINNED_SHARE)], device)
    # One running request at a time lets the load test below hold a queue without racing the clock;
    # no prefix cache makes every local answer an independent single-worker computation.
    decode = Worker("decode", free_port(), str(logs / "decode.log"),
                    [*common, "--no-prefix-caching", "--kv-failure-policy", "fail", "--max-num-running", "1"], device)
    workers = start_workers(prefill, decode)
    replay = SidecarReplay(decode.url)
    yield prefill, decode, replay
    replay.close()
    stop_all(*workers)


def chat_body(question: str, max_tokens: int = 24, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def completion_body(prompt: str, max_tokens: int = 24, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def answer_text(path: str, status_code: int, body: bytes) -> str:
    """The answer's text, streamed (SSE deltas joined) or not."""
    assert status_code == 200, body[-2000:]
    text = body.decode()
    if not text.startswith("data:"):
        choice = json.loads(text)["choices"][0]
        return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    parts = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"]
            if choice:
                parts.append((choice[0].get("delta", {}).get("content") if path.endswith("chat/completions")
                              else choice[0].get("text")) or "")
    assert text.rstrip().endswith("data: [DONE]")
    return "".join(parts)


def single_worker_answer(decode: Worker, path: str, body: dict) -> str:
    """The greedy answer of one worker alone (D, no prefix cache: computed from scratch)."""
    alone = {key: value for key, value in body.items() if key != "stream_options"}
    response = httpx.post(decode.url + path, json={**alone, "stream": False}, timeout=120)
    return answer_text(path, response.status_code, response.content)


def no_pins(prefill: Worker) -> bool:
    return prefill.metric("pdserve_transfer_pinned_blocks") == 0


# ---- the sidecar's bytes, checked against what its Go source writes ----------------------------

def test_replay_writes_each_leg_as_the_sidecar_source_does():
    client = (b'{"model": "m", "messages": [{"role": "user", "content": "a <b> & c"}], "max_tokens": 32,'
              b' "temperature": 0.0, "top_p": 1e-7, "stream": true, "stream_options": {"include_usage": true}}')
    prefill_request, prefill_bytes = prefill_leg_body(client)
    assert prefill_bytes == (
        b'{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_block_ids":null,'
        b'"remote_engine_id":null,"remote_host":null,"remote_port":null},"max_completion_tokens":1,"max_tokens":1,'
        b'"messages":[{"content":"a \\u003cb\\u003e \\u0026 c","role":"user"}],"model":"m","stream":false,'
        b'"temperature":0,"top_p":1e-7}')
    params = go_unmarshal(b'{"remote_block_ids": [[3, 4]], "lease_s": 30.0, "remote_port": 8000}')
    assert decode_leg_body(client, prefill_request, params) == (
        b'{"kv_transfer_params":{"lease_s":30,"remote_block_ids":[[3,4]],"remote_port":8000},"max_tokens":32,'
        b'"messages":[{"content":"a \\u003cb\\u003e \\u0026 c","role":"user"}],"model":"m","stream":true,'
        b'"stream_options":{"include_usage":true},"temperature":0,"top_p":1e-7}')
    # No stream and no token field in the client's body: the decode leg has none either.
    bare = b'{"model": "m", "prompt": "x"}'
    request, _ = prefill_leg_body(bare)
    assert decode_leg_body(bare, request, None) == b'{"kv_transfer_params":null,"model":"m","prompt":"x"}'
    assert go_marshal(go_unmarshal(b'[1e21, 1e20, 123456789012345678, -0.0, "\\u2028"]')) == \
        b'[1e+21,100000000000000000000,123456789012345680,-0,"\\u2028"]'


# ---- the P/D sequence against real workers ------------------------------------------------------

CASES = [
    ("/v1/chat/completions", False, chat_body("What is the capital of France?")),
    ("/v1/chat/completions", True, chat_body("Name three colours.", stream_options={"include_usage": True})),
    ("/v1/completions", False, completion_body("The three primary colours are", max_completion_tokens=20)),
    ("/v1/completions", True, completion_body("Once upon a time, in a land far away,")),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, stream, body", CASES, ids=["chat", "chat-stream", "completions", "completions-stream"])
def test_sidecar_pd_sequence_answers_as_one_worker_with_the_kv_pulled(cluster, device, path, stream, body):
    prefill, decode, replay = cluster
    want = single_worker_answer(decode, path, body)
    assert wait_for(lambda: no_pins(prefill), 30), "an earlier test's KV is still pinned"
    computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    headers = [(PREFILL_HEADER, f"127.0.0.1:{prefill.port}")]
    if stream:  # a client id of its own: the sidecar adds its id after it, and both legs keep the first
        headers.append(("x-request-id", f"client-{path.rsplit('/', 1)[1]}"))
    answer = replay.post(path, json.dumps({**body, "stream": stream}).encode(), headers)
    assert [leg.url for leg in answer.legs] == [prefill.url + path, decode.url + path]
    got = answer_text(path, answer.status_code, answer.body)
    if device == "cpu":  # in bf16 a prompt computed as one chunk may round differently from pulled KV
        assert got == want
    # The KV was pulled, not recomputed: D started from P's first token (protocol 7), no prompt token computed.
    assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before == 0
    assert decode.metric("pdserve_transfer_bytes_total") > bytes_before
    assert wait_for(lambda: no_pins(prefill), 30), "D's read released P's pin"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["unreachable", "no-header"])
def test_sidecar_without_a_usable_prefill_worker_answers_from_decode_alone(cluster, device, how):
    prefill, decode, replay = cluster
    path, body = "/v1/chat/completions", chat_body("Write a haiku about the sea.", stream=True)
    want = single_worker_answer(decode, path, body)
    computed_before = decode.metric("pdserve_engine_computed_prompt_tokens_total")
    headers = [(PREFILL_HEADER, f"127.0.0.1:{free_port()}")] if how == "unreachable" else []
    answer = replay.post(path, json.dumps(body).encode(), headers)
    got = answer_text(path, answer.status_code, answer.body)
    assert answer.legs[-1].body == json.dumps(body).encode(), "decode alone gets the client's own bytes"
    if device == "cpu":
        assert got == want
    assert decode.metric("pdserve_engine_computed_prompt_tokens_total") - computed_before > 1, "D prefilled it"


@pytest.mark.slow
def test_sidecar_falls_back_to_decode_alone_when_the_prefill_worker_answers_503(cluster, device):
    """P at its pinned-blocks limit refuses a remote-decode prefill (503): the sidecar's fallback."""
    prefill, decode, replay = cluster
    assert wait_for(lambda: no_pins(prefill), 30)
    _, holder = prefill_leg_body(json.dumps(completion_body(LONG_CONTEXT)).encode())
    held = httpx.post(prefill.url + "/v1/completions", content=holder, timeout=120,
                      headers={"content-type": "application/json", "x-request-id": "llm-d-holder"})
    assert held.status_code == 200, held.text
    assert prefill.metric("pdserve_transfer_pinned_blocks") > NUM_BLOCKS * PINNED_SHARE
    try:
        path, body = "/v1/completions", completion_body("The capital of Italy is")
        want = single_worker_answer(decode, path, body)
        refusals_before = prefill.metric("pdserve_transfer_pinned_refusals_total")
        answer = replay.post(path, json.dumps(body).encode(), [(PREFILL_HEADER, f"127.0.0.1:{prefill.port}")])
        assert prefill.metric("pdserve_transfer_pinned_refusals_total") == refusals_before + 1
        assert len(answer.legs) == 2 and answer.legs[1].body == json.dumps(body).encode()
        got = answer_text(path, answer.status_code, answer.body)
        if device == "cpu":
            assert got == want
    finally:
        params = held.json()["kv_transfer_params"]
        release = {key: params[key]
                   for key in ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")}
        assert httpx.post(prefill.internal_url + "/internal/kv/release", json=release, timeout=10).status_code == 202
        assert wait_for(lambda: no_pins(prefill), 30)


@pytest.mark.slow
def test_sidecar_hands_a_prefill_4xx_to_the_client_without_decoding(cluster):
    prefill, _, replay = cluster
    body = chat_body("Hello?") | {"model": "not-served-here"}
    answer = replay.post("/v1/chat/completions", json.dumps(body).encode(),
                         [(PREFILL_HEADER, f"127.0.0.1:{prefill.port}")])
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    assert len(answer.legs) == 1


# ---- what the endpoint picker scrapes -----------------------------------------------------------

def scrape(worker: Worker) -> dict[str, list[tuple[dict, float]]]:
    """One /metrics scrape, as the EPP reads it (Prometheus text format): name -> [(labels, value)]."""
    text = httpx.get(worker.url + "/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def one(samples: dict, name: str) -> float:
    (labels, value), = samples[name]
    assert labels == {}, name
    return value


def assert_gie_gauges_equal_ours(samples: dict) -> None:
    """Within one scrape: the protocol's gauges carry our values (one record makes both)."""
    assert one(samples, "vllm:num_requests_waiting") == one(samples, "pdserve_scheduler_waiting_requests")
    assert one(samples, "vllm:num_requests_running") == one(samples, "pdserve_scheduler_running_requests")
    group_usage = sum(value for _, value in samples["pdserve_kv_usage_ratio"])
    assert one(samples, "vllm:kv_cache_usage_perc") == pytest.approx(group_usage, rel=1e-12, abs=0)
    (labels, value), = samples["vllm:cache_config_info"]
    assert value == 1 and labels == {"block_size": "16", "num_gpu_blocks": str(NUM_BLOCKS - 1)}
    assert one(samples, "pdserve_kv_pool_blocks") == NUM_BLOCKS - 1
    (labels, _), = samples["vllm:lora_requests_info"]
    assert labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def _pinned_share(prefill: Worker) -> tuple[float, float]:
    samples = scrape(prefill)
    return one(samples, "vllm:kv_cache_usage_perc"), prefill.metric("pdserve_transfer_pinned_blocks") / (NUM_BLOCKS - 1)


@pytest.mark.slow
def test_gie_gauges_equal_ours_on_a_loaded_prefill_and_decode_worker(cluster, device):
    prefill, decode, replay = cluster
    assert wait_for(lambda: no_pins(prefill), 30)
    for worker in (prefill, decode):
        assert_gie_gauges_equal_ours(scrape(worker))
    path, body = "/v1/chat/completions", chat_body("What is two plus two?")
    want = single_worker_answer(decode, path, body)
    results = []
    long_answer = chat_body("Count from one to ten thousand.", max_tokens=3000, ignore_eos=True, stream=True)
    with httpx.stream("POST", decode.url + path, json=long_answer, timeout=120) as running:
        # The long answer holds D's one running slot until this block leaves (which aborts it) ...
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the answer
        assert next(line for line in lines if line.startswith("data: {"))
        # ... so the sidecar's decode leg queues on D, its prompt's KV pinned on P meanwhile.
        sidecar = threading.Thread(target=lambda: results.append(replay.post(
            path, json.dumps(body).encode(), [(PREFILL_HEADER, f"127.0.0.1:{prefill.port}")])))
        sidecar.start()
        assert wait_for(lambda: one(scrape(decode), "vllm:num_requests_waiting") == 1, 60)
        samples = scrape(decode)
        assert_gie_gauges_equal_ours(samples)
        assert one(samples, "vllm:num_requests_running") == 1
        assert one(samples, "vllm:kv_cache_usage_perc") > 0
        # P: nothing queued or running, its pool in use only by the pin: usage is the pinned share.
        samples = scrape(prefill)
        assert_gie_gauges_equal_ours(samples)
        assert one(samples, "vllm:num_requests_running") == one(samples, "vllm:num_requests_waiting") == 0
        assert wait_for(lambda: (lambda usage, pinned: usage == pinned > 0)(*_pinned_share(prefill)), 10)
    sidecar.join(120)
    answer, = results
    got = answer_text(path, answer.status_code, answer.body)
    if device == "cpu":
        assert got == want
    assert wait_for(lambda: no_pins(prefill) and one(scrape(prefill), "vllm:kv_cache_usage_perc") == 0, 30)


def query(port: int, promql: str) -> float:
    """The instant vector's sum; NaN when empty or while Prometheus still starts (503, not JSON)."""
    try:
        return prometheus_query(port, promql)
    except ValueError:
        return math.nan


@pytest.mark.slow
def test_prometheus_stores_both_families_as_written(cluster, tmp_path):
    """A real Prometheus (which asks for OpenMetrics) keeps the protocol's names, colons included."""
    prefill, decode, _ = cluster
    port = free_port()
    prometheus = start_prometheus(tmp_path, {"prefill": f"127.0.0.1:{prefill.port}",
                                             "decode": f"127.0.0.1:{decode.port}"}, port)
    try:
        assert wait_for(lambda: query(port, 'count({__name__=~"vllm:.+", job=~"prefill|decode"})') == 10, 30)
        for job in ("prefill", "decode"):
            assert query(port, f'vllm:cache_config_info{{job="{job}", num_gpu_blocks="{NUM_BLOCKS - 1}"}}') == 1
            assert query(port, f'vllm:num_requests_running{{job="{job}"}} - '
                               f'pdserve_scheduler_running_requests{{job="{job}"}}') == 0
            assert query(port, f'vllm:kv_cache_usage_perc{{job="{job}"}} - on (job) '
                               f'sum by (job) (pdserve_kv_usage_ratio{{job="{job}"}})') == 0
        assert math.isnan(query(port, 'count({__name__=~"vllm_.+"})')), "a colon rewritten to an underscore"
    finally:
        prometheus.terminate()
        prometheus.wait(10)


ISSUE_36_ROUTES = [("GET", "/internal/kv/agent_info"), ("GET", "/internal/kv/routing_info"),
                   ("GET", "/internal/kv/events"), ("POST", "/internal/kv/reset_prefix_cache")]


def route_status(url: str, method: str, path: str) -> int:
    with httpx.stream(method, url + path, timeout=10) as response:  # a stream is closed once its head came
        return response.status_code


def test_the_ports_a_sidecar_forwards_to_answer_404_for_internal_routes_without_a_token(cluster):
    """Issue 36: the sidecar forwards every path it does not handle to D's serving port, and P's pool
    port is open to the decode pods; neither serves /internal/* any more. The internal listeners do
    (tokenless on loopback, as here; the manifests keep them to label-selected peers)."""
    prefill, decode, _ = cluster
    for worker in (prefill, decode):
        for method, path in ISSUE_36_ROUTES:
            assert route_status(worker.url, method, path) == 404, (worker.role, path)
            assert route_status(worker.internal_url, method, path) == 200, (worker.role, path)
