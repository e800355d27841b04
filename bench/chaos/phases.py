"""Kills at forced phases: each phase function brings its victim to a named moment (a frozen process,
a read seen on the wire, a stream under way), then SIGKILLs it; `run_kill` restarts it and judges.

Invariant: a phase is reported `forced` only when an observable state proved the moment (a frozen
victim that never ran again, kernel byte counts of its KV read, its own metric): no kill is timed by
a sleep. What `run_kill` reports per kill: survivors that failed, a dead prefill worker, blocks
still held after the lease, recovery time; `MixedLoad` results are charged to kills afterwards.

    decode READ phases (direct legs P -> D, D's pull of a ~1,500-token prompt over UCX/TCP):

      before-read   D frozen (SIGSTOP), the decode leg then sent into its socket: killed with P's pin
                    outstanding and its NIXL connection to P up, the READ never issued
      mid-read      D (the worker and its NIXL agent process, killed together) run in steps of ~1 ms,
                    frozen between them, until 1 MiB of the KV reached their sockets; killed while the
                    kernel holds less than 90% of the KV (P's sends to it still pending). Frozen, D
                    reads nothing and the kernel takes at most a socket buffer more, so a slow probe
                    (`ss`) or a slow machine cannot let the whole read pass between two looks
      after-read    killed as soon as D's `pdserve_transfer_bytes_total` counted the pull (it landed),
                    while D decodes the request
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from bench.chaos.cluster import AUTH, LEASE_S, MODEL, PREFILL, PROXY, ChaosCluster, RecoveryFailed, tcp_bytes_received
from bench.chaos.load import MixedLoad, Result, send
from bench.lib.launch import wait_for
from bench.lib.legs import decode_leg, page_bytes, prefill_leg
from bench.lib.load import Call
from bench.lib.stream import finish, read_lines

COMPLETIONS = "/v1/completions"
READ_PROMPT = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(100))  # ~1,500 tokens, ~70 MB of KV
READ_BODY = {"model": MODEL, "prompt": READ_PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
# A request caught in the prefill worker's prefill; with P dead the decode worker computes it.
PREFILL_CALL = Call(COMPLETIONS, {"model": MODEL, "prompt": "word " * 600, "max_tokens": 4, "temperature": 0},
                    name="long-prompt")
STREAM_CALL = Call(COMPLETIONS, {
    "model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": 48, "ignore_eos": True,
    "temperature": 0, "stream": True}, name="long-stream")
EXTRA_CALLS = (PREFILL_CALL, STREAM_CALL)
READ_PHASES = ("before-read", "mid-read", "after-read")
PHASES = {
    "prefill": ("in-prefill", "under-load"),
    "decode": (*READ_PHASES, "mid-stream", "under-load"),
    "proxy": ("in-flight",),
}
_MIB = 1 << 20


@dataclass
class Kill:
    victim: str  # prefill, decode or proxy
    phase: str
    process: str = ""  # the cluster's name for it (decode-1, ...)
    forced: bool = True
    note: str = ""
    killed_s: float = 0.0
    recovered_s: Optional[float] = None  # monotonic, when everything served again
    survivors_failed: list[str] = field(default_factory=list)
    prefill_died: bool = False
    prefill_log_tail: str = ""
    agent_restarts: int = 0  # NIXL agent processes the surviving workers replaced (a crash they lived through)
    leaked: dict[str, float] = field(default_factory=dict)
    own: list[tuple[Result, str]] = field(default_factory=list)  # the phase's own requests, with baselines

    @property
    def recovery_s(self) -> Optional[float]:
        return None if self.recovered_s is None else self.recovered_s - self.killed_s


@dataclass
class Stage:
    """What a phase works with."""

    cluster: ChaosCluster
    load: MixedLoad
    expected: dict[str, str]  # baselines by call name
    rng: random.Random
    pool: concurrent.futures.ThreadPoolExecutor


# ---------------------------------------------------------------- decode: the READ


def _read_setup(stage: Stage, kill: Kill) -> tuple[dict, int]:
    """A pin on P for the victim's pull; returns its params and the bytes the pull moves."""
    prefill = stage.cluster.workers[PREFILL]
    leg = prefill_leg(prefill, COMPLETIONS, READ_BODY, f"read-{kill.phase}-{time.monotonic_ns()}", AUTH)
    leg.raise_for_status()
    params = leg.json()["kv_transfer_params"]
    num_blocks = sum(len(ids) for ids in params["remote_block_ids"])
    return params, num_blocks * page_bytes(prefill, AUTH)


def _pause_load_for(stage: Stage, kill: Kill) -> None:
    """The victim's sockets must carry only this READ: no load while it is caught."""
    stage.load.gate.clear()
    if not stage.load.wait_quiet():
        kill.note += "load did not go quiet; "
    worker = stage.cluster.workers[kill.process]
    wait_for(lambda: httpx.get(worker.url + "/load", timeout=5).json()["num_running"] == 0, 30)


def before_read(stage: Stage, kill: Kill) -> None:
    _pause_load_for(stage, kill)
    params, _ = _read_setup(stage, kill)
    worker = stage.cluster.workers[kill.process]
    stage.cluster.freeze(kill.process)
    body = json.dumps({**READ_BODY, "kv_transfer_params": params}).encode()
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: {params['remote_request_id']}\r\n"
            f"X-Pdserve-Internal-Token: {AUTH['X-Pdserve-Internal-Token']}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as conn:
        conn.sendall(head + body)  # the kernel takes it; the frozen worker never reads it
        _kill(stage, kill)


def mid_read(stage: Stage, kill: Kill) -> None:
    _pause_load_for(stage, kill)
    params, kv_bytes = _read_setup(stage, kill)
    cluster = stage.cluster
    pids = cluster.pids(kill.process)  # the worker and its NIXL agent process, which does the read
    worker = cluster.workers[kill.process]
    before = tcp_bytes_received(pids)
    pull = stage.pool.submit(_quietly, decode_leg, worker, COMPLETIONS, READ_BODY, params,
                             params["remote_request_id"], AUTH)
    caught, deadline = False, time.monotonic() + 30
    while not caught and not pull.done() and time.monotonic() < deadline:
        cluster.freeze(kill.process)  # looked at frozen: the read does not move while `ss` runs
        caught = tcp_bytes_received(pids) - before >= _MIB
        if not caught:
            cluster.thaw(kill.process)
            time.sleep(0.001)
    cluster.freeze(kill.process)
    received = _settled(lambda: tcp_bytes_received(pids) - before)
    kill.forced = caught and not pull.done() and _MIB <= received < 0.9 * kv_bytes
    kill.note += f"{received / _MIB:.1f} of {kv_bytes / _MIB:.1f} MiB had arrived; "
    _kill(stage, kill)
    pull.result(timeout=30)


def after_read(stage: Stage, kill: Kill) -> None:
    _pause_load_for(stage, kill)
    params, _ = _read_setup(stage, kill)
    worker = stage.cluster.workers[kill.process]
    pulled = worker.metric("pdserve_transfer_bytes_total")
    pull = stage.pool.submit(_quietly, decode_leg, worker, COMPLETIONS, READ_BODY, params,
                             params["remote_request_id"], AUTH)
    landed = wait_for(lambda: pull.done() or worker.metric("pdserve_transfer_bytes_total") > pulled, 30,
                      interval_s=0.002)
    kill.forced = landed and not pull.done()  # it landed, the request still decoding
    _kill(stage, kill)
    pull.result(timeout=30)


# ---------------------------------------------------------------- decode: streams and load


def mid_stream(stage: Stage, kill: Kill) -> None:
    """A stream through the proxy; once tokens flow, the decode worker running it dies."""
    stage.load.gate.clear()
    stage.load.wait_quiet()
    cluster = stage.cluster
    result = Result(class_name=STREAM_CALL.name, sent_s=time.monotonic())
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", cluster.proxy.url + COMPLETIONS, json=STREAM_CALL.body) as response:
        result.status = response.status_code
        lines = response.iter_lines()
        try:
            read_lines(result, lines, max_events=3)
            running = [n for n in cluster.decode_names if _load(cluster, n)["num_running"] > 0]
            kill.process = running[0] if running else kill.process
            kill.forced = len(running) == 1
            _kill(stage, kill)
            read_lines(result, lines)
        except httpx.HTTPError as error:
            result.error = result.error or type(error).__name__
    kill.own.append((finish(result, time.monotonic()), stage.expected[STREAM_CALL.name]))


def under_load(stage: Stage, kill: Kill) -> None:
    """Killed while the proxy has requests outstanding on it, whatever phase they are in."""
    cluster, worker = stage.cluster, stage.cluster.workers[kill.process]
    busy = wait_for(lambda: cluster.proxy.metric("pdserve_proxy_backend_in_flight_requests",
                                                 backend=worker.url) > 0, 30, interval_s=0.005)
    kill.forced = busy
    _kill(stage, kill)


# ---------------------------------------------------------------- prefill and proxy


def in_prefill(stage: Stage, kill: Kill) -> None:
    """P frozen, then a request sent: it dies before it could answer whatever it was given."""
    cluster = stage.cluster
    cluster.freeze(PREFILL)
    with httpx.Client(timeout=60) as client:
        pending = stage.pool.submit(send, client, cluster.proxy.url, PREFILL_CALL, f"in-prefill-{time.monotonic_ns()}")
        kill.forced = wait_for(lambda: pending.done() or cluster.proxy.metric(
            "pdserve_proxy_backend_in_flight_requests", role="prefill") > 0, 30, interval_s=0.01)
        _kill(stage, kill)
        kill.own.append((pending.result(), stage.expected[PREFILL_CALL.name]))


def proxy_in_flight(stage: Stage, kill: Kill) -> None:
    cluster = stage.cluster
    kill.forced = wait_for(lambda: cluster.proxy.metric("pdserve_proxy_backend_in_flight_requests") > 0, 30,
                           interval_s=0.005)
    stage.load.gate.clear()  # no new requests at a dead proxy; those in flight die with it
    _kill(stage, kill)


PHASE_FUNCTIONS: dict[tuple[str, str], Callable[[Stage, Kill], None]] = {
    ("decode", "before-read"): before_read, ("decode", "mid-read"): mid_read,
    ("decode", "after-read"): after_read, ("decode", "mid-stream"): mid_stream,
    ("decode", "under-load"): under_load, ("prefill", "in-prefill"): in_prefill,
    ("prefill", "under-load"): under_load, ("proxy", "in-flight"): proxy_in_flight,
}


# ---------------------------------------------------------------- one kill, start to end


def run_kill(stage: Stage, victim: str, phase: str) -> Kill:
    """Kill at `phase`, restart, wait for recovery, then (load paused) for nothing held after the lease."""
    cluster = stage.cluster
    process = {"prefill": PREFILL, "proxy": PROXY}.get(victim) or stage.rng.choice(cluster.decode_names)
    kill = Kill(victim, phase, process)
    restarts_before = _agent_restarts(cluster, kill.process)
    try:
        PHASE_FUNCTIONS[(victim, phase)](stage, kill)
        kill.survivors_failed = cluster.survivors_live(kill.process)
        _note_prefill_death(cluster, kill)
        cluster.restart(kill.process)
        kill.recovered_s = time.monotonic()
    except RecoveryFailed as error:
        kill.note += f"no recovery: {error}; "
    finally:
        stage.load.gate.clear()
        stage.load.wait_quiet()
    kill.survivors_failed = sorted(set(kill.survivors_failed) | set(cluster.survivors_live(kill.process)))
    _note_prefill_death(cluster, kill)
    kill.leaked = cluster.wait_idle(LEASE_S + 5)
    _note_prefill_death(cluster, kill)
    kill.agent_restarts = sum(max(0, _agent_restarts(cluster, kill.process).get(name, 0) - count)
                              for name, count in restarts_before.items())
    stage.load.gate.set()
    return kill


def _agent_restarts(cluster: ChaosCluster, victim: str) -> dict[str, int]:
    """Agent restarts each worker but the victim has counted (a worker that restarted counts from 0)."""
    counts = {}
    for name, worker in cluster.workers.items():
        if name != victim and cluster.is_running(name):
            try:
                counts[name] = int(worker.metric("pdserve_transfer_agent_restarts_total"))
            except Exception:  # noqa: BLE001 - a worker that does not answer now counts nothing
                continue
    return counts


def _note_prefill_death(cluster: ChaosCluster, kill: Kill) -> None:
    """A prefill worker that died of someone else's death: record its log, bring it back."""
    if kill.process == PREFILL or cluster.is_running(PREFILL):
        return
    kill.prefill_died = True
    kill.prefill_log_tail = cluster.log_tail(PREFILL) + f"\n[exit code {cluster.exit_code(PREFILL)}]"
    if PREFILL not in kill.survivors_failed:
        kill.survivors_failed.append(PREFILL)
    cluster.restart(PREFILL, wait=False)  # the victim's own restart waits for the whole cluster


def _kill(stage: Stage, kill: Kill) -> None:
    kill.killed_s = time.monotonic()
    stage.cluster.kill(kill.process)
    if kill.process != PROXY:
        stage.load.gate.set()  # the survivors take the load at once, while they see their peer gone


def _load(cluster: ChaosCluster, name: str) -> dict:
    return httpx.get(cluster.workers[name].url + "/load", timeout=5).json()


def _settled(read: Callable[[], int], interval_s: float = 0.02, timeout_s: float = 5.0) -> int:
    """A counter's value once it stops moving (three equal reads in a row)."""
    deadline, last, same = time.monotonic() + timeout_s, read(), 0
    while same < 2 and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = read()
        same = same + 1 if now == last else 0
        last = now
    return last


def _quietly(function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except httpx.HTTPError as error:
        return error

