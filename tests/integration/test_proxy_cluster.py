"""`pdserve up` as a real process tree (prefill + decode + proxy on the embedded model), driven by
the official openai client: chat and completions, streamed or not, greedy answers equal to a
single worker's; Ctrl-C stops all three."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from bench.lib.launch import up_ports
from tests.integration.cluster import REPO_ROOT, wait_for
from tests.integration.openai_features import CHECKS

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colours are"


class UpProcess:
    """`pdserve up` on free ports, its combined output in a log file."""

    def __init__(self, log_path: str, *extra_args: str):
        self.ports = up_ports()
        self.log_path = log_path
        command = [sys.executable, "-m", "pdserve.app.cli", "up", "--port", str(self.ports["proxy"]),
                   "--prefill-port", str(self.ports["prefill"]), "--decode-port", str(self.ports["decode"]),
                   "--num-blocks", "400", *extra_args]
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout_s: float = 150.0) -> None:
        if not wait_for(lambda: "[up] ready" in self.output() or self.process.poll() is not None, timeout_s, 0.5):
            raise TimeoutError(f"pdserve up not ready in {timeout_s}s:\n{self.output()[-4000:]}")
        if self.process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {self.process.returncode}:\n{self.output()[-4000:]}")

    def child_pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in re.findall(r"\[up\] (\w+)\s+http://\S+\s+\(pid (\d+)", self.output())}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for pid in self.child_pids().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    process = UpProcess(str(tmp_path_factory.mktemp("logs") / "up.log"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url("proxy") + "/v1", api_key="unused", max_retries=0, timeout=120)


def local_chat(up: UpProcess) -> str:
    """The decode worker alone (no kv_transfer_params): the single-worker reference."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    response = httpx.post(up.url("decode") + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def local_completion(up: UpProcess) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    response = httpx.post(up.url("decode") + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def proxy_metric(up: UpProcess, name: str) -> float:
    total = 0.0
    for line in httpx.get(up.url("proxy") + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_metric(up: UpProcess, name: str) -> float:
    total = 0.0
    for line in httpx.get(up.url("decode") + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_up_prints_every_port_and_prefixes_each_process_log(up):
    output = up.output()
    for name in ("prefill", "decode", "proxy"):
        assert f"http://127.0.0.1:{up.ports[name]}" in output
        assert f"[{name}] " in output
    assert f"[up] ready: OpenAI API at {up.url('proxy')}/v1" in output


def test_models_list_through_the_proxy(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_through_the_proxy_equals_the_single_worker_answer(up, client):
    expected = local_chat(up)
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert full.choices[0].message.content == expected and "Paris" in expected
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == expected
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_through_the_proxy_equal_the_single_worker_answer(up, client):
    expected = local_completion(up)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert full.choices[0].text == streamed == expected and expected.strip()


def test_requests_took_both_legs_and_the_ttft_split_is_recorded(up, client):
    before = proxy_metric(up, "pdserve_proxy_ttft_prefill_seconds_count")
    started_before = decode_metric(up, "pdserve_pd_first_token_from_prefill_total")
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert proxy_metric(up, "pdserve_proxy_ttft_prefill_seconds_count") == before + 1
    # Protocol 7 through our proxy (min_tokens moved to decode_min_tokens): D started from P's first token.
    assert decode_metric(up, "pdserve_pd_first_token_from_prefill_total") == started_before + 1
    assert decode_metric(up, "pdserve_pd_first_token_recomputed_total") == 0
    assert proxy_metric(up, "pdserve_proxy_requests_total") >= 5
    assert proxy_metric(up, "pdserve_proxy_backend_errors_total") == 0
    pulled = httpx.get(up.url("decode") + "/metrics", timeout=5).text
    assert re.search(r"^pdserve_transfer_bytes_total\S* [1-9]", pulled, re.M), "decode pulled no KV"


def handoff_counts(up: UpProcess, name: str) -> dict[str, float]:
    """Sample counts of each component of `name` (pdserve_proxy_handoff_seconds on the proxy, mode
    disaggregated; pdserve_pd_handoff_seconds on a worker)."""
    role = "proxy" if name.startswith("pdserve_proxy") else "decode"
    counts: dict[str, float] = {}
    for line in httpx.get(up.url(role) + "/metrics", timeout=5).text.splitlines():
        found = re.match(name + r'_count\{(.*)\} (\S+)$', line)
        if found and (role == "decode" or 'mode="disaggregated"' in found.group(1)):
            component = re.search(r'component="(\w+)"', found.group(1)).group(1)
            counts[component] = float(found.group(2))
    return counts


def test_one_pd_request_publishes_each_handoff_component_and_one_log_line(up):
    from pdserve.api.handoff import PROXY_LOG_COMPONENTS

    proxy_before = handoff_counts(up, "pdserve_proxy_handoff_seconds")
    decode_before = handoff_counts(up, "pdserve_pd_handoff_seconds")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", up.url("proxy") + "/v1/completions", json=body, timeout=120,
                      headers={"X-Request-Id": "handoff-parts-1"}) as response:
        assert response.status_code == 200
        response.read()
    proxy_after = handoff_counts(up, "pdserve_proxy_handoff_seconds")
    assert {c: proxy_after.get(c, 0) - proxy_before.get(c, 0) for c in PROXY_LOG_COMPONENTS} == \
        dict.fromkeys(PROXY_LOG_COMPONENTS, 1)
    decode_after = handoff_counts(up, "pdserve_pd_handoff_seconds")
    assert {c: decode_after.get(c, 0) - decode_before.get(c, 0) for c in ("d_ticket", "d_pull", "d_first_step")} \
        == dict.fromkeys(("d_ticket", "d_pull", "d_first_step"), 1)
    assert wait_for(lambda: "request handoff-parts-1: handoff mode=disaggregated proxy_hop_ms=" in up.output(), 5, 0.1)


def labelled_metric(up: UpProcess, role: str, name: str, label: str) -> float:
    """One labelled sample (`label` as written between the braces, e.g. 'outcome="delivered"'); 0 when absent."""
    for line in httpx.get(up.url(role) + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_concurrent_legs_answer_as_one_worker_does_and_d_computes_no_prompt_token(up):
    """`up`'s proxy sends both legs at once (proxy/both_legs.py): greedy text equals the prefill worker's
    own answer computed alone, P's params reach the waiting decode worker, and D computes none of the prompt."""
    prompt = "A short list of the planets, from the Sun outwards:"  # new to D: whatever D has, it pulled
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    alone = httpx.post(up.url("prefill") + "/v1/completions", json=body, timeout=120)  # one worker, no P/D
    assert alone.status_code == 200, alone.text
    delivered = labelled_metric(up, "proxy", "pdserve_proxy_concurrent_legs_total", 'outcome="delivered"')
    computed = decode_metric(up, "pdserve_engine_computed_prompt_tokens_total")
    full = httpx.post(up.url("proxy") + "/v1/completions", json=body, timeout=120)
    with httpx.stream("POST", up.url("proxy") + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])
    expected = alone.json()["choices"][0]["text"]
    assert full.json()["choices"][0]["text"] == streamed == expected and expected.strip()
    assert labelled_metric(up, "proxy", "pdserve_proxy_concurrent_legs_total", 'outcome="delivered"') == delivered + 2
    assert decode_metric(up, "pdserve_engine_computed_prompt_tokens_total") == computed  # every prompt token pulled
    assert decode_metric(up, "pdserve_pd_recomputed_prompt_tokens_total") == 0


def test_client_kv_transfer_params_are_dropped_not_forwarded(up):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"}}
    response = httpx.post(up.url("proxy") + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    # Straight to the worker, the same body needs the internal token `up` generated.
    assert httpx.post(up.url("decode") + "/v1/completions", json=body, timeout=120).status_code == 401


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_openai_client_feature(client, up, check):
    check(client, up.url("proxy"))


def stream_payloads(lines) -> list[dict]:
    """The JSON events of an SSE answer ([DONE] aside), in order."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def without_identity(payload: dict) -> dict:
    """An event less what differs between two answers to the same request: id, created, cached tokens,
    and logprob values beyond 4 decimals (P and D compute a token's distribution in different batches)."""
    def rounded(value):
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items() if k not in ("id", "created", "prompt_tokens_details")}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return round(value, 4) if isinstance(value, float) else value
    return rounded(payload)


def shows_token(payload: dict) -> bool:
    choice = payload["choices"][0] if payload.get("choices") else {}
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


EARLY_CASES = {
    "chat": ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 12, "logprobs": True, "top_logprobs": 2,
                                      "stream_options": {"include_usage": True}}),
    "completions": ("/v1/completions", {"prompt": "Three things to pack for a day at the beach:", "max_tokens": 12}),
}


@pytest.mark.parametrize("case", EARLY_CASES)
def test_p_first_token_reaches_the_client_before_d_can_pull_and_the_stream_equals_one_worker(up, case):
    """The early first token (proxy/early_stream.py): with the decode worker stopped (SIGSTOP: it can
    neither parse the request nor claim or READ its KV), the client still gets token 1 from P's answer;
    once D goes on, the rest of the stream, and the whole of it, equals the decode worker's own answer
    streamed alone, event for event (role chunk, text, logprobs, finish, usage counting token 1 once)."""
    path, fields = EARLY_CASES[case]
    body = {"model": MODEL, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", up.url("decode") + path, json=body, timeout=120) as alone:
        expected = stream_payloads(alone.iter_lines())
    sent = labelled_metric(up, "proxy", "pdserve_proxy_early_first_token_total", 'outcome="sent",reason=""')
    from_prefill = decode_metric(up, "pdserve_pd_first_token_from_prefill_total")
    decode_pid = up.child_pids()["decode"]
    os.kill(decode_pid, signal.SIGSTOP)
    stopped = True
    try:
        with httpx.stream("POST", up.url("proxy") + path, json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            head = []
            for line in lines:  # up to the first event that shows a token: all of it while D is stopped
                head += stream_payloads([line])
                if head and shows_token(head[-1]):
                    break
            assert head and shows_token(head[-1]), head
            os.kill(decode_pid, signal.SIGCONT)
            stopped = False
            got = head + stream_payloads(lines)
    finally:
        if stopped:
            os.kill(decode_pid, signal.SIGCONT)
    assert [without_identity(p) for p in got] == [without_identity(p) for p in expected]
    assert len({(p["id"], p["created"]) for p in got}) == 1  # one identity, P's events and D's alike
    assert labelled_metric(up, "proxy", "pdserve_proxy_early_first_token_total", 'outcome="sent",reason=""') == sent + 1
    assert decode_metric(up, "pdserve_pd_first_token_from_prefill_total") == from_prefill + 1  # D pulled P's pin


def test_a_stream_that_ends_at_token_1_is_left_to_d_and_p_says_why(up):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", up.url("decode") + "/v1/completions", json=body, timeout=120) as alone:
        expected = [without_identity(p) for p in stream_payloads(alone.iter_lines())]
    label = 'outcome="not_offered",reason="ends_at_one"'
    before = labelled_metric(up, "proxy", "pdserve_proxy_early_first_token_total", label)
    with httpx.stream("POST", up.url("proxy") + "/v1/completions", json=body, timeout=120) as response:
        assert [without_identity(p) for p in stream_payloads(response.iter_lines())] == expected
    assert labelled_metric(up, "proxy", "pdserve_proxy_early_first_token_total", label) == before + 1


HOSTILE_FIELDS = {  # each took a worker (500) or the proxy (500) down a path, and three opened the breaker
    "superscript logit_bias key": ({"logit_bias": {"²": 1}}, "logit_bias"),
    "5,000-digit logit_bias key": ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    "guided_json string 3,000 deep": ({"guided_json": "[" * 3000 + "]" * 3000}, "guided_json"),
}


def test_inputs_that_once_opened_the_breaker_are_400s_and_the_cluster_keeps_serving(up):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    errors_before = proxy_metric(up, "pdserve_proxy_backend_errors_total")
    for _ in range(3):  # nine in all, three times the breaker's threshold
        for name, (fields, param) in HOSTILE_FIELDS.items():
            response = httpx.post(up.url("proxy") + "/v1/completions", json={**body, **fields}, timeout=120)
            assert response.status_code == 400, (name, response.status_code, response.text)
            assert response.json()["error"]["param"] == param, name
    assert proxy_metric(up, "pdserve_proxy_backend_errors_total") == errors_before
    good = httpx.post(up.url("proxy") + "/v1/completions", json=body, timeout=120)
    assert good.status_code == 200, good.text


# Last: it stops the module's cluster.
def test_ctrl_c_stops_all_three_processes(up):
    pids = up.child_pids()
    assert set(pids) == {"prefill", "decode", "proxy"}
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(40) == 0
    for name, pid in pids.items():
        assert wait_for(lambda: not _alive(pid), 5), f"{name} still running"
        with pytest.raises(httpx.ConnectError):
            httpx.get(up.url(name) + "/live", timeout=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
