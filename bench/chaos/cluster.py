"""The chaos cluster: one prefill worker, decode workers and a proxy as real processes on 127.0.0.1
(real NIXL over UCX on TCP, real HTTP, the embedded SmolLM2), each killable and restartable alone.

Invariant: `restart` brings back a process on its old port with its old flags, and returns only once
the proxy sees every worker healthy again and every decode worker has pulled KV from the prefill
worker (its NIXL connection to the current prefill epoch is up), so the next kill starts from a
cluster that serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from bench.lib.launch import (
    ProxyProcess, Worker, descendant_pids, free_port, start_workers, wait_for, wait_workers_idle)
from bench.lib.legs import two_legs

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "chaos-loop-token"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}
LEASE_S = 5.0
PREFILL = "prefill"
PROXY = "proxy"
# A probe each decode worker answers after a restart: its handshake with the prefill worker is done.
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@dataclass
class ChaosCluster:
    """Processes by name: "prefill", "decode-0", "decode-1", ... and "proxy"."""

    log_dir: str
    device: str = "cpu"
    num_decode: int = 2
    workers: dict[str, Worker] = field(default_factory=dict)
    proxy: Optional[ProxyProcess] = None

    @property
    def decode_names(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.num_decode)]

    def start(self) -> "ChaosCluster":
        common = ["--num-blocks", "400", "--internal-token", TOKEN, "--kv-lease-s", str(LEASE_S),
                  "--header-timeout-s", "2", "--body-timeout-s", "5"]
        # UCX over TCP (as between pods): a read of a long prompt takes long enough to be caught in
        # flight. A native crash prints every thread's Python stack into the log (faulthandler).
        env = {"UCX_TLS": "tcp", "PYTHONFAULTHANDLER": "1"}
        self.workers[PREFILL] = Worker("prefill", free_port(), self._log(PREFILL), common, self.device, env)
        for name in self.decode_names:
            self.workers[name] = Worker("decode", free_port(), self._log(name), [
                *common, "--kv-pull-timeout-s", "2", "--kv-heartbeat-s", "1", "--kv-allowed-peers", "127.0.0.1"],
                self.device, env)
        start_workers(*self.workers.values())
        self.proxy = ProxyProcess(free_port(), self._log(PROXY), [
            "--prefill", self.workers[PREFILL].url, "--decode", *(self.workers[n].url for n in self.decode_names),
            "--internal-token", TOKEN, "--health-interval-s", "0.25", "--breaker-failures", "3",
            "--breaker-cooldown-s", "2", "--retry-after-s", "1", "--header-timeout-s", "2"])
        self.wait_recovered(60)
        return self

    def _log(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for worker in self.workers.values():
            worker.stop()

    # ---- processes -------------------------------------------------------------------

    def process(self, name: str) -> Optional[subprocess.Popen]:
        return self.proxy.process if name == PROXY else self.workers[name].process

    def pid(self, name: str) -> int:
        return self.process(name).pid

    def is_running(self, name: str) -> bool:
        return self.process(name) is not None and self.process(name).poll() is None

    def pids(self, name: str) -> list[int]:
        """The process and its descendants (a worker's NIXL agent process)."""
        return [self.pid(name), *descendant_pids(self.pid(name))]

    def freeze(self, name: str) -> None:
        for pid in self.pids(name):
            os.kill(pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        for pid in self.pids(name):
            os.kill(pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        """SIGKILL of the process and its agent process together, as a pod or OOM kill does (also of
        frozen ones: a stopped process dies of SIGKILL at once)."""
        if name == PROXY:
            self.proxy.kill()
            return
        for pid in descendant_pids(self.pid(name)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.workers[name].kill()

    def exit_code(self, name: str) -> Optional[int]:
        return self.process(name).poll()

    def restart(self, name: str, timeout_s: float = 90.0, wait: bool = True) -> None:
        if name == PROXY:
            self.proxy.start()
        else:
            old = self.workers[name]
            worker = Worker(old.role, old.port, old.log_path, old.extra_args, old.device, old.env,
                            internal_port=old.internal_port)
            start_workers(worker)
            self.workers[name] = worker
        if wait:
            self.wait_recovered(timeout_s)

    def wait_recovered(self, timeout_s: float) -> None:
        """Every process up, the proxy sees all workers healthy, every decode worker pulls from P."""
        deadline = time.monotonic() + timeout_s
        if not wait_for(self.proxy.is_ready, timeout_s):
            raise RecoveryFailed("the proxy is not ready")
        if not wait_for(self.all_healthy_in_proxy, max(1.0, deadline - time.monotonic()), interval_s=0.1):
            raise RecoveryFailed(f"the proxy does not see every worker healthy: {self.proxy.health(TOKEN)}")
        for name in self.decode_names:
            params, response = two_legs(self.workers[PREFILL], self.workers[name], "/v1/completions", PROBE,
                                        f"probe-{name}-{time.monotonic_ns()}", AUTH)
            if response.status_code != 200:
                raise RecoveryFailed(f"{name} did not answer a P/D probe: {response.text[:300]}")
        through_proxy = httpx.post(self.proxy.url + "/v1/completions", json=PROBE, timeout=60)
        if through_proxy.status_code != 200:
            raise RecoveryFailed(f"the proxy did not answer a probe: {through_proxy.text[:300]}")

    def all_healthy_in_proxy(self) -> bool:
        try:
            health = self.proxy.health(TOKEN)
        except (httpx.HTTPError, ValueError):
            return False
        backends = [b for role in ("prefill", "decode") for b in health.get(role, [])]
        return len(backends) == 1 + self.num_decode and all(
            b.get("healthy") and b.get("available") for b in backends)

    def survivors_live(self, victim: str) -> list[str]:
        """Names of the processes other than `victim` that are dead or whose /live is not 200."""
        failed = []
        for name, worker in self.workers.items():
            if name != victim and not (self.is_running(name) and _status(worker.url + "/live") == 200):
                failed.append(name)
        # The proxy's liveness, not its readiness: with its only decode worker dead it is rightly not
        # ready (503 on /health), and that is no cascade.
        if victim != PROXY and not (self.is_running(PROXY) and _status(self.proxy.url + "/live") == 200):
            failed.append(PROXY)
        return failed

    def wait_idle(self, timeout_s: float) -> dict[str, float]:
        """Waits for nothing pinned, used or running anywhere; returns what is still held (empty: idle)."""
        return wait_workers_idle({name: worker.url for name, worker in self.workers.items()}, timeout_s)

    def log_tail(self, name: str, num_chars: int = 6000) -> str:
        with open(self._log(name), "rb") as f:
            f.seek(max(0, os.path.getsize(self._log(name)) - num_chars))
            return f.read().decode(errors="replace")


class RecoveryFailed(RuntimeError):
    """A restarted cluster did not get back to serving in time."""


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def tcp_bytes_received(pids: list[int]) -> int:
    """Bytes the kernel received on every TCP socket of `pids` (UCX's reads dominate: HTTP is small)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = any(f"pid={pid}," in line for pid in pids)
        elif mine:
            for part in line.split():
                if part.startswith("bytes_received:"):
                    total += int(part.split(":", 1)[1])
    return total
