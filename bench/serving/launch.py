"""Starts the systems the comparison drives: `pdserve up` (prefill + decode + proxy) and one
colocated `pdserve serve`, each a child process logging to a file.

Invariant: a system counts as ready only once a real completion went through
it end to end, and whatever was started is stopped on the way out (SIGTERM,
then SIGKILL), even when it never became ready.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import httpx

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STOP_TIMEOUT_S = 40.0  # `up` stops its proxy, then drains both workers


class LaunchError(RuntimeError):
    """A system under test exited early or never answered a completion."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pd_cluster_argv(port: int, num_blocks: int) -> list[str]:
    """`pdserve up`: it pins prefill and decode to half of the cores each and gives each that many threads."""
    return [sys.executable, "-m", "pdserve.app.cli", "up", "--port", str(port), "--prefill-port", "0",
            "--decode-port", "0", "--num-blocks", str(num_blocks), "--log-level", "warning"]


def colocated_argv(port: int, num_blocks: int, num_threads: int) -> list[str]:
    return [sys.executable, "-m", "pdserve.app.cli", "serve", "--port", str(port), "--num-blocks", str(num_blocks),
            "--num-threads", str(num_threads), "--log-level", "warning"]


@dataclass
class ServerProcess:
    name: str
    argv: Sequence[str]
    port: int
    log_path: str
    process: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        logger.info("starting %s: %s", self.name, " ".join(self.argv))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(list(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT)

    def wait_ready(self, timeout_s: float) -> None:
        """Polls with a tiny completion: liveness endpoints answer before the model has loaded."""
        deadline_s = time.monotonic() + timeout_s
        body = {"prompt": [1000, 1001, 1002, 1003], "max_tokens": 2, "temperature": 0.0}
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise LaunchError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=60.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise LaunchError(f"{self.name} did not answer a completion in {timeout_s:.0f} s: {self.log_tail()}")

    def pids(self) -> list[int]:
        """This process and all its descendants (the workers and proxy of `up`)."""
        return [self.process.pid, *descendant_pids(self.process.pid)] if self.process else []

    def log_tail(self, num_chars: int = 800) -> str:
        try:
            with open(self.log_path, "rb") as log:
                return " ".join(log.read().decode("utf-8", "replace")[-num_chars:].split())
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (both `up` and `serve` shut down cleanly on it), SIGKILL on a hang."""
        if self.process is None or self.process.poll() is not None:
            return
        children = descendant_pids(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", self.name, _STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
        for pid in children:  # `up` stops its children itself; this only catches ones it left behind
            _kill_if_alive(pid)


def _parent_pid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendant_pids(root_pid: int) -> list[int]:
    """Every living descendant of `root_pid`, from /proc (empty where /proc is missing)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for pid in pids:
        parent = _parent_pid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found, frontier = [], [root_pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def _kill_if_alive(pid: int) -> None:
    """Kills a leftover child, after checking the pid still names a pdserve process (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pdserve.app.cli" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass
