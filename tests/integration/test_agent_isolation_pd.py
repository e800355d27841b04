"""A prefill or decode worker whose NIXL agent process crashes serves on (issue 22, part 5): real
workers, real NIXL, real HTTP. The crash is forced (SIGSEGV to the agent process, the signal the
reproduced NIXL crash died of), never timed; what happens next is waited for by state.

    prefill worker --- its agent process dies --> /live stays 200, the agent is replaced:
        pdserve_transfer_agent_restarts_total 1, the handshake names a new epoch and agent
        a pin made before the crash: D finds it stale, computes the prompt itself (same answer)
        a pin made after: D handshakes again and pulls it from the new agent (same answer)
    decode worker --- its agent process dies --> its next pull reconnects through a new agent
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.integration.cluster import Worker, decode_leg, free_port, prefill_leg, start_workers, stop_all, wait_for
from tests.integration.prompts import aligned_chat_prompt
from tests.process_guard import living_descendants

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "isolation-token"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}


def body() -> dict:
    return {"model": MODEL, "prompt": aligned_chat_prompt("Name three rivers of Europe."), "max_tokens": 12,
            "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    if device != "cpu":
        pytest.skip("agent isolation serves host-memory pools (auto keeps a GPU pool's agent inline)")
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "200", "--internal-token", TOKEN]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), [*common, "--kv-lease-s", "6"], device)
    decode = Worker("decode", free_port(), str(logs / "decode.log"), [*common, "--no-prefix-caching"], device)
    start_workers(prefill, decode)
    yield prefill, decode
    stop_all(prefill, decode)


def agent_pid(worker: Worker) -> int:
    agents = [pid for pid in living_descendants(worker.process.pid)
              if b"pdserve.transfer.agent_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(agents) == 1, agents
    return agents[0]


def handshake(worker: Worker) -> httpx.Response:
    return httpx.get(worker.internal_url + "/internal/kv/agent_info", headers=AUTH, timeout=10)


def crash_agent(worker: Worker) -> dict:
    """SIGSEGV the worker's agent process; return the handshake once a new agent serves."""
    before = handshake(worker).json()
    old = agent_pid(worker)
    os.kill(old, signal.SIGSEGV)
    wait_for(lambda: worker.metric("pdserve_transfer_agent_restarts_total") >= 1
             and handshake(worker).status_code == 200 and handshake(worker).json()["epoch"] != before["epoch"], 60)
    assert worker.process.poll() is None
    assert httpx.get(worker.url + "/live", timeout=10).status_code == 200
    after = handshake(worker).json()
    assert after["transport"]["agent_name"] != before["transport"]["agent_name"]
    assert agent_pid(worker) != old
    return after


def pd_answer(prefill: Worker, decode: Worker, request_id: str, params: dict | None = None) -> tuple[str, dict]:
    if params is None:
        first = prefill_leg(prefill, "/v1/completions", body(), request_id, AUTH)
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
    response = decode_leg(decode, "/v1/completions", body(), params, request_id, AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], params


def test_a_prefill_worker_lives_through_its_agent_crash_and_serves_pd_from_the_new_agent(cluster):
    prefill, decode = cluster
    local = httpx.post(decode.url + "/v1/completions", json=body(), timeout=120).json()["choices"][0]["text"]
    text, _ = pd_answer(prefill, decode, "before-crash")
    assert text == local
    stale = prefill_leg(prefill, "/v1/completions", body(), "pinned-before-crash", AUTH).json()["kv_transfer_params"]
    pulled = decode.metric("pdserve_transfer_bytes_total")
    after = crash_agent(prefill)
    assert after["epoch"].startswith(stale["remote_epoch"] + ".")
    # The pin of the dead agent names the old epoch: P hands out no ticket for it, and D answers 409
    # kv_params_stale (as for a restarted P: the proxy runs the prefill leg again) and reads nothing.
    refused = decode_leg(decode, "/v1/completions", body(), stale, "pinned-before-crash", AUTH)
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "kv_params_stale", refused.text
    assert decode.metric("pdserve_transfer_bytes_total") == pulled
    # A new pin names the new epoch: D handshakes again and pulls it through P's new agent.
    text, params = pd_answer(prefill, decode, "after-crash")
    assert text == local and params["remote_epoch"] == after["epoch"]
    assert decode.metric("pdserve_transfer_bytes_total") > pulled
    wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)  # the stale pin's lease ran out


def test_a_decode_worker_lives_through_its_agent_crash_and_pulls_again(cluster):
    prefill, decode = cluster
    local = httpx.post(decode.url + "/v1/completions", json=body(), timeout=120).json()["choices"][0]["text"]
    crash_agent(decode)
    pulled = decode.metric("pdserve_transfer_bytes_total")
    text, _ = pd_answer(prefill, decode, "decode-agent-replaced")
    assert text == local
    assert decode.metric("pdserve_transfer_bytes_total") > pulled
