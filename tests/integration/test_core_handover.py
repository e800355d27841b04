"""`pdserve up --core-handover` as a real process tree: the workers are unpinned and share a core
ledger; a worker runs every core while the other is idle and its own share while the other has
work. The order is forced, not timed: the test marks the decode worker busy in the ledger itself
before the prefill worker's step, and reads the thread gauge each worker exported for its steps."""

from __future__ import annotations

import mmap
import os
import re

import httpx
import pytest

from pdserve.engine.core_share import LEDGER_BYTES, ROLE_SLOTS
from tests.integration.cluster import wait_for
from tests.integration.test_proxy_cluster import MODEL, UpProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a core hand-over needs two cores")
    process = UpProcess(str(tmp_path_factory.mktemp("logs") / "up.log"), "--core-handover",
                        "--disaggregation", "static")
    try:
        process.wait_ready()
        # The proxy answers before its first health poll of the prefill worker; until then it would
        # send every prompt to the decode worker alone, and the prefill worker would never step.
        assert wait_for(lambda: prefill_is_healthy(process), 60), "the proxy never saw the prefill worker ready"
        yield process
    finally:
        process.stop()


def prefill_is_healthy(up: UpProcess) -> bool:
    try:
        text = httpx.get(up.url("proxy") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    return re.search(r'^pdserve_proxy_backend_healthy\{[^}]*role="prefill"[^}]*\} 1\.0$', text, re.M) is not None


def threads(up: UpProcess, role: str) -> float:
    text = httpx.get(up.url(role) + "/metrics", timeout=5).text
    return float(re.search(r"^pdserve_engine_cpu_threads (\S+)$", text, re.M).group(1))


def ledger_of(up: UpProcess) -> mmap.mmap:
    pid = up.child_pids()["prefill"]
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    path = argv[argv.index("--core-ledger") + 1]
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), LEDGER_BYTES)


def complete(up: UpProcess) -> str:
    body = {"model": MODEL, "prompt": "The three primary colours are", "max_tokens": 8, "temperature": 0}
    response = httpx.post(up.url("proxy") + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_workers_are_unpinned_and_each_runs_every_core_while_the_other_is_idle(up):
    cores = len(os.sched_getaffinity(0))
    for role in ("prefill", "decode"):
        assert os.sched_getaffinity(up.child_pids()[role]) == os.sched_getaffinity(0)
    complete(up)  # P prefills while D idles, then D decodes while P idles
    assert threads(up, "prefill") == threads(up, "decode") == cores
    ledger = ledger_of(up)
    # Both say they are idle again at the end of their last step (which may end just after the answer left).
    assert wait_for(lambda: ledger[ROLE_SLOTS["prefill"]] == ledger[ROLE_SLOTS["decode"]] == 0, 10)


def test_the_prefill_worker_narrows_to_its_share_while_the_decode_worker_has_work(up):
    cores = len(os.sched_getaffinity(0))
    ledger = ledger_of(up)
    ledger[ROLE_SLOTS["decode"]] = 1  # D "busy" before P's step (D writes its byte only when it changes)
    answer = complete(up)
    assert threads(up, "prefill") == cores // 2
    assert threads(up, "decode") == cores  # P had finished (and said so) before D's steps
    assert wait_for(lambda: ledger[ROLE_SLOTS["decode"]] == 0, 10)  # D wrote its own byte back
    assert complete(up) == answer  # the thread count never changes an answer
    assert threads(up, "prefill") == cores
