"""The routing benchmark's processes: prefill and decode workers started once, one proxy per policy.

Invariant: every policy starts from the same state: each worker's prefix
cache is emptied (POST /internal/kv/reset_prefix_cache) and the workers are
idle before its proxy starts; counters are read from the workers' /metrics
before and after a run and only their differences are reported. Whatever was
started is stopped on the way out.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from bench.lib.launch import (
    LaunchError, ServerProcess, free_port, internal_url_of, metric_sum, pdserve_argv, wait_workers_idle)

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Pdserve-Internal-Token"
WORKER_COUNTERS = (
    "pdserve_engine_computed_prompt_tokens_total", "pdserve_kv_prefix_cache_queries_tokens_total",
    "pdserve_kv_prefix_cache_hits_tokens_total", "pdserve_transfer_bytes_total", "pdserve_kv_events_total",
    "pdserve_request_prompt_tokens_total",
)
_READY_TIMEOUT_S = 300.0
# Four workers on two cores take seconds per step under load: give the P/D data path's set-up and
# reads room (the defaults fall back to local prefill after 5 and 10 s, which would blur the comparison).
PATIENT_PD = ("--kv-connect-timeout-s", "30", "--kv-handshake-timeout-s", "30", "--kv-pull-timeout-s", "15")


@dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int = 2
    num_decode: int = 2
    num_blocks: int = 512
    num_threads: int = 1
    token: str = "routing-bench"
    log_dir: str = "."


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of all samples of each counter (every label set)."""
    return {name: metric_sum(url, name) for name in names}


class RoutingCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.prefills = [self._worker("prefill", i) for i in range(spec.num_prefill)]
        self.decodes = [self._worker("decode", i) for i in range(spec.num_decode)]
        self.proxy: Optional[ServerProcess] = None

    @property
    def workers(self) -> list[ServerProcess]:
        return [*self.prefills, *self.decodes]

    def _worker(self, role: str, index: int) -> ServerProcess:
        port = free_port()
        argv = pdserve_argv(role, port, "--num-blocks", str(self.spec.num_blocks), "--num-threads",
                            str(self.spec.num_threads), "--log-level", "warning", "--internal-token", self.spec.token,
                            *PATIENT_PD)
        return ServerProcess(f"{role}{index}", argv, port, os.path.join(self.spec.log_dir, f"{role}{index}.log"))

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        for worker in self.workers:
            worker.wait_ready(_READY_TIMEOUT_S)  # a real completion: each worker is warm after it
        self._connect_data_paths()

    def _connect_data_paths(self) -> None:
        """Every decode worker handshakes with and connects to every prefill worker before measuring:
        one proxy per prefill worker, whose round robin over the decode workers visits each of them."""
        for prefill in self.prefills:
            proxy = self.start_proxy("round_robin", prefills=[prefill])
            try:
                for index in range(len(self.decodes)):
                    body = {"prompt": [1000 + index] * 40, "max_tokens": 2, "temperature": 0}
                    httpx.post(proxy.base_url + "/v1/completions", json=body, timeout=120).raise_for_status()
            finally:
                self.stop_proxy()

    def start_proxy(self, policy: str, prefills: Optional[list[ServerProcess]] = None) -> ServerProcess:
        port = free_port()
        prefill_urls = [w.base_url for w in prefills or self.prefills]
        base, peer = policy.removesuffix("+peer"), policy.endswith("+peer")
        argv = pdserve_argv("proxy", port, "--policy", base, "--prefill", *prefill_urls,
                            "--decode", *(w.base_url for w in self.decodes), "--internal-token", self.spec.token,
                            "--log-level", "warning", "--peer-pull" if peer else "--no-peer-pull")
        self.proxy = ServerProcess(f"proxy-{policy}", argv, port, os.path.join(self.spec.log_dir, f"proxy-{policy}.log"))
        self.proxy.start()
        self.proxy.wait_ready(60.0)
        if base == "kv_aware" or peer:
            self._wait_for_routing_info(self.proxy)
        return self.proxy

    def _wait_for_routing_info(self, proxy: ServerProcess, timeout_s: float = 60.0) -> None:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            answer = httpx.post(proxy.base_url + "/internal/routing/explain", json={"prompt": "hi"},
                                headers={TOKEN_HEADER: self.spec.token}, timeout=10).json()
            if answer.get("ready"):
                return
            time.sleep(0.5)
        raise LaunchError("the kv_aware proxy never loaded the workers' routing info")

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None

    def reset(self) -> None:
        """Every worker idle, every prefix cache empty."""
        self.wait_idle()
        for worker in self.workers:
            response = httpx.post(internal_url_of(worker.base_url) + "/internal/kv/reset_prefix_cache",
                                  headers={TOKEN_HEADER: self.spec.token}, timeout=30)
            response.raise_for_status()

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        held = wait_workers_idle({w.name: w.base_url for w in self.workers}, timeout_s)
        if held:
            raise LaunchError(f"the workers did not go idle: {held}")

    def counters(self) -> dict[str, dict[str, float]]:
        return {w.name: scrape(w.base_url, WORKER_COUNTERS) for w in self.workers}

    def peer_pulled_tokens(self) -> float:
        """Prompt tokens the workers pulled from peers so far (peer pulls that landed)."""
        return sum(metric_sum(w.base_url, "pdserve_kv_peer_pull_tokens_total", result="pulled") for w in self.workers)

    def pids(self) -> list[int]:
        processes = [*self.workers, *([self.proxy] if self.proxy else [])]
        return [pid for p in processes for pid in p.pids()]

    def stop(self) -> None:
        self.stop_proxy()
        for worker in self.workers:
            worker.stop()
