"""The one process launcher of the benchmarks (and of tests/integration): pdserve workers, the proxy,
any server binary, each a child process on 127.0.0.1 logging to a file; and `free_port`.

Invariant: whatever is started here is stopped on the way out (SIGTERM, then SIGKILL), even when it
never became ready, and a start that fails says why with the tail of the process's log.
"""

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

from pdserve.app.children import free_port as free_local_port  # drawn below the ephemeral range

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port(next_free_too: bool = False) -> int:
    """A port free on 127.0.0.1 now. `next_free_too`: one whose next port is free as well, for a worker
    given only its port (its internal listener takes port + 1 then, as `pdserve up` starts them)."""
    while True:
        port = free_local_port()
        if not next_free_too:
            return port
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
                return port
            except OSError:  # taken: draw again
                continue


def up_ports() -> dict[str, int]:
    """Ports for `pdserve up --port P --prefill-port F --decode-port D`: each worker's port + 1 (its
    internal listener) free too, and no two of the five the same."""
    while True:
        ports = {"proxy": free_port(), "prefill": free_port(next_free_too=True), "decode": free_port(next_free_too=True)}
        taken = [ports["proxy"], ports["prefill"], ports["prefill"] + 1, ports["decode"], ports["decode"] + 1]
        if len(set(taken)) == len(taken):
            return ports


def spawn(command: list[str], log_path: str, env: Optional[dict[str, str]] = None, **popen: object) -> subprocess.Popen:
    """A child on this interpreter's repository root (importable through PYTHONPATH), output appended to its log."""
    python_path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=dict(os.environ, PYTHONPATH=python_path, **(env or {})), **popen)


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` at `url`/metrics whose labels include `labels` (all by default)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(
                f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class _Child:
    """kill and stop (SIGTERM, then SIGKILL after `stop_wait_s`) of a launched process in `self.process`."""

    stop_wait_s = 10.0
    process: Optional[subprocess.Popen]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_wait_s)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Worker(_Child):
    stop_wait_s = 15.0  # not a field: a worker drains and stops its NIXL agent before it exits
    role: str
    port: int
    log_path: str
    extra_args: list[str] = field(default_factory=list)
    device: str = "cpu"  # tests take it from the `device` fixture (tests/conftest.py)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    process: Optional[subprocess.Popen] = None
    # The listener of the /internal/* routes (KV handshake, release, routing info, KV events): a free
    # port of its own, picked once, so a restarted worker keeps it.
    internal_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        # free_port() closes its socket, so two calls may name the same port: never both of a worker's.
        while self.internal_port == self.port:
            self.internal_port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def internal_url(self) -> str:
        return f"http://127.0.0.1:{self.internal_port}"

    def start(self) -> "Worker":
        # One torch thread each: several workers share this host's few cores.
        command = [sys.executable, "-m", "pdserve.app.cli", self.role, "--host", "127.0.0.1", "--port", str(self.port),
                   "--internal-port", str(self.internal_port), "--log-level", "info", "--num-threads", "1",
                   "--device", self.device, *self.extra_args]
        self.process = spawn(command, self.log_path, self.env)
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

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-num_chars:]

    def metric(self, name: str) -> float:
        return metric_sum(self.url, name)


class ProxyProcess(_Child):
    """`pdserve proxy` as a real process, its output in a log file."""

    def __init__(self, port: int, log_path: str, args: list[str]):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.args = args
        self.process: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> "ProxyProcess":
        self.process = spawn([sys.executable, "-m", "pdserve.app.cli", "proxy", "--port", str(self.port), *self.args],
                             self.log_path)
        return self

    def health(self, token: Optional[str] = None) -> dict:
        headers = {"X-Pdserve-Internal-Token": token} if token else {}
        return httpx.get(self.url + "/health", headers=headers, timeout=2).json()

    def is_ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.url, name, **labels)


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


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


_HELD = ("num_running", "num_waiting", "num_waiting_for_kv", "num_pinned_blocks", "kv_usage")  # fields of GET /load


def wait_workers_idle(urls: dict[str, str], timeout_s: float) -> dict[str, float]:
    """Waits (at most `timeout_s`) until no worker runs, queues, pins or uses anything; returns what each
    worker by name still holds (the sum of its /load's counts and KV usage), empty once all are idle."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        held = {name: sum(httpx.get(url + "/load", timeout=5).json()[key] for key in _HELD)
                for name, url in urls.items()}
        held = {name: value for name, value in held.items() if value}
        if not held or time.monotonic() > deadline_s:
            return held
        time.sleep(0.2)


class LaunchError(RuntimeError):
    """A system under test exited early or never became ready."""


STOP_TIMEOUT_S = 40.0  # `up` stops its proxy, then drains both workers
_PROBE = {"prompt": [1000, 1001, 1002, 1003], "max_tokens": 2, "temperature": 0.0}


@dataclass
class ServerProcess:
    """Any server under test (`pdserve up`/`serve`/a worker/the proxy, llama-server, transformers serve).

    `ready="completion"` waits for a real completion (liveness endpoints answer before the model has
    loaded); `ready="health"` for /health. `own_session` puts it in its own process group, which
    `stop` signals whole (servers that start children of their own)."""

    name: str
    argv: list[str]
    port: int
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    ready: str = "completion"
    own_session: bool = False
    process: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self.process = spawn(list(self.argv), self.log_path, self.env, stdin=subprocess.DEVNULL,
                             start_new_session=self.own_session)
        return self

    def _answers(self) -> bool:
        try:
            if self.ready == "health":
                return httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200
            return httpx.post(f"{self.base_url}/v1/completions", json=_PROBE, timeout=60.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float) -> "ServerProcess":
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise LaunchError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            if self._answers():
                return self
            time.sleep(0.5 if self.ready == "health" else 1.0)
        raise LaunchError(f"{self.name} not ready in {timeout_s:.0f} s: {self.log_tail()}")

    def model_id(self) -> str:
        """The (first) model the server lists."""
        return httpx.get(f"{self.base_url}/v1/models", timeout=30.0).raise_for_status().json()["data"][0]["id"]

    def pids(self) -> list[int]:
        """This process and all its descendants (the workers and proxy of `up`)."""
        return [self.process.pid, *descendant_pids(self.process.pid)] if self.process else []

    def log_tail(self, num_chars: int = 800) -> str:
        try:
            with open(self.log_path, "rb") as log:
                return " ".join(log.read().decode("utf-8", "replace")[-num_chars:].split())
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (pdserve shuts down cleanly on it), SIGKILL on a hang; then any pdserve child left."""
        if self.process is None or self.process.poll() is not None:
            return
        children = descendant_pids(self.process.pid)
        signal_of = (lambda sig: os.killpg(self.process.pid, sig)) if self.own_session else self.process.send_signal
        signal_of(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_of(signal.SIGKILL)
            self.process.wait()
        for pid in children:  # `up` stops its children itself; this only catches ones it left behind
            _kill_if_pdserve(pid)


def pdserve_argv(command: str, port: int, *args: str) -> list[str]:
    """`pdserve <command>` as this interpreter runs it; a worker gets a free internal port of its own
    (its default, --port + 1, may be taken on a host where every port was picked free)."""
    internal = ["--internal-port", str(free_port())] if command in ("serve", "prefill", "decode") else []
    return [sys.executable, "-m", "pdserve.app.cli", command, "--port", str(port), *internal, *args]


def internal_url_of(url: str, timeout_s: float = 10.0) -> str:
    """The internal listener (/internal/* routes) of the pdserve worker serving at `url`, at the port
    its GET /load names."""
    port = int(httpx.get(url + "/load", timeout=timeout_s).json()["internal_port"])
    return str(httpx.URL(url).copy_with(port=port)).rstrip("/")


def _process_state(pid: int) -> Optional[tuple[str, int]]:
    """(state, parent pid) from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]  # the name may hold spaces and ')'
        return state, int(ppid)
    except (OSError, ValueError, IndexError):
        return None


def descendant_pids(root_pid: int) -> list[int]:
    """Every living (not exited) descendant of `root_pid`, from /proc (empty where /proc is missing)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for pid in pids:
        found = _process_state(pid)
        if found is not None and found[0] not in ("Z", "X"):
            children.setdefault(found[1], []).append(pid)
    descendants, frontier = [], [root_pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        descendants += kids
        frontier += kids
    return descendants


def _kill_if_pdserve(pid: int) -> None:
    """Kills a leftover child, after checking the pid still names a pdserve process (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pdserve.app." not in f.read():  # a worker, proxy or `up` (cli), or a TP rank (ranks)
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass
