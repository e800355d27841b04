"""Starts real pdserve worker processes on 127.0.0.1 for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Worker:
    role: str
    port: int
    log_path: str
    extra_args: list[str] = field(default_factory=list)
    device: str = "cpu"  # tests take it from the `device` fixture (tests/conftest.py)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Worker":
        # One torch thread each: several workers share this host's few cores.
        command = [sys.executable, "-m", "pdserve.app.cli", self.role, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "info", "--num-threads", "1", "--device", self.device, *self.extra_args]
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **self.env)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> "Worker":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.role} worker not ready in {timeout_s}s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-num_chars:]

    def metric(self, name: str) -> float:
        """Sum of every sample of a metric (all label sets) from /metrics."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


class ProxyProcess:
    """`pdserve proxy` as a real process, its output in a log file."""

    def __init__(self, port: int, log_path: str, args: list[str]):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.args = args
        self.process: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> "ProxyProcess":
        command = [sys.executable, "-m", "pdserve.app.cli", "proxy", "--port", str(self.port), *self.args]
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        return self

    def health(self, token: Optional[str] = None) -> dict:
        headers = {"X-Pdserve-Internal-Token": token} if token else {}
        return httpx.get(self.url + "/health", headers=headers, timeout=2).json()

    def is_ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if not (line.startswith(name + " ") or line.startswith(name + "{")):
                continue
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_workers(*workers: Worker) -> list[Worker]:
    """Start all, then wait for all (they load their models in parallel)."""
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.wait_ready()
    except Exception:
        for worker in workers:
            worker.kill()
        raise
    return list(workers)


def stop_all(*processes: Worker | ProxyProcess, timeout_s: float = 15.0) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL past `timeout_s`): a worker takes seconds
    to exit after it drained (its NIXL agent process, its engine thread), and stopping a cluster's
    processes one after the other made each teardown the sum of those seconds. One signal each: a second
    SIGTERM tells a worker to skip its drain."""
    by_pid = {each.process.pid: each for each in processes if each.process is not None and each.process.poll() is None}
    running = list(by_pid.values())  # a process listed twice is signalled once
    for each in running:
        each.process.terminate()
    deadline = time.monotonic() + timeout_s
    for each in running:
        try:
            each.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            each.kill()


REMOTE_DECODE = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def prefill_leg(prefill: Worker, path: str, body: dict, request_id: str, headers: Optional[dict] = None) -> httpx.Response:
    """The proxy's first hop, as the wire protocol describes it."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return httpx.post(prefill.url + path, json=leg, headers={"X-Request-Id": request_id, **(headers or {})}, timeout=120)


def decode_leg(decode: Worker, path: str, body: dict, params: dict, request_id: str,
               headers: Optional[dict] = None) -> httpx.Response:
    return httpx.post(decode.url + path, json={**body, "kv_transfer_params": params},
                      headers={"X-Request-Id": request_id, **(headers or {})}, timeout=120)


def two_legs(prefill: Worker, decode: Worker, path: str, body: dict, request_id: str,
             headers: Optional[dict] = None) -> tuple[dict, httpx.Response]:
    first = prefill_leg(prefill, path, body, request_id, headers)
    first.raise_for_status()
    params = first.json()["kv_transfer_params"]
    return params, decode_leg(decode, path, body, params, request_id, headers)


def page_bytes(worker: Worker, headers: Optional[dict] = None) -> int:
    """Bytes of one page of a P or D worker's pool (one rank's, for a tensor-parallel worker)."""
    info = httpx.get(worker.url + "/internal/kv/agent_info", headers=headers or {}, timeout=10).json()
    return int(info["geometry"]["page_bytes"])


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def same_path_reference(worker: Worker, path: str, body: dict, request_id: str, headers: Optional[dict] = None,
                        block_size: int = 16) -> dict:
    """What a P/D answer must equal bit for bit (tokens and logprobs), on any device and dtype.

    `worker` (the prefill worker, prefix caching on) answers `body` twice by itself. The
    prompt ends one token past a block boundary, so the second time every prompt token
    but the last is a prefix-cache hit and the last one is computed as a single-token
    step over cached KV: the same KV bytes a decode worker pulls, the same attention
    path and dtype it computes that token with. An independent run (the prompt as one
    chunk) would take another attention path, and in bf16 may round differently."""
    first = httpx.post(worker.url + path, json=body, timeout=120,
                       headers={"X-Request-Id": f"{request_id}-warm", **(headers or {})})
    first.raise_for_status()
    second = httpx.post(worker.url + path, json=body, headers={"X-Request-Id": request_id, **(headers or {})},
                        timeout=120)
    second.raise_for_status()
    answer = second.json()
    num_prompt = answer["usage"]["prompt_tokens"]
    assert (num_prompt - 1) % block_size == 0, f"a {num_prompt}-token prompt does not end one past a block"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == num_prompt - 1, answer["usage"]
    return answer
