"""`pdserve up`: one prefill worker, one decode worker and the proxy on this machine, as child processes.

Invariants: every child runs in its own session (a Ctrl-C reaches only this
parent, which then stops the children in order: proxy first, then workers),
dies with its parent (PR_SET_PDEATHSIG), and has its log lines prefixed by
its name; if any child dies on its own the others are stopped and `up`
exits non-zero. Torch-free: it only starts processes.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Optional, Sequence

import httpx

from pdserve.api.config import DEFAULT_PORTS, CacheConfig
from pdserve.api.flags import FORWARDED_ARGS, add_worker_flags, parse_device
from pdserve.api.child_process import child_environment, python_module_command
from pdserve.app.children import die_with_parent, free_port, linux_libc
from pdserve.engine.core_share import create_ledger
from proxy.cli import INTERNAL_TOKEN_ENV, LIMIT_FLAGS
from proxy.config import SloConfig

STOP_TIMEOUT_S = 20.0  # workers drain in-flight requests on SIGTERM; past this they are killed


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Which cores each worker may use (None: unpinned) and how many torch threads it runs."""

    prefill_cores: Optional[tuple[int, ...]]
    decode_cores: Optional[tuple[int, ...]]
    prefill_threads: int
    decode_threads: int


def plan_cores(cores: Sequence[int]) -> CorePlan:
    """Split the usable cores between P and D (D gets the odd one: it runs all the time);
    the proxy is light and floats over all of them. With one core nothing is pinned."""
    ordered = tuple(sorted(cores))
    if len(ordered) < 2:
        return CorePlan(None, None, 1, 1)
    half = len(ordered) // 2
    prefill, decode = ordered[:half], ordered[half:]
    return CorePlan(prefill, decode, len(prefill), len(decode))


# Settings `up` decides per child (ports, cores, threads, token, identity) rather than forwarding.
_UP_OWNS = ("--host", "--port", "--internal-port", "--num-threads", "--core-ledger", "--num-threads-alone", "--internal-token",
            "--log-level", "--engine-id", "--advertise-host", "--tp-rank", "--tp-master-addr", "--tp-master-port")


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address all three processes listen on")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (0: any free port)")
    parser.add_argument("--prefill-port", type=int, default=DEFAULT_PORTS["prefill"], help="0: any free port")
    parser.add_argument("--decode-port", type=int, default=DEFAULT_PORTS["decode"], help="0: any free port")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per worker (default: the worker's share of the cores)")
    parser.add_argument("--no-pin", action="store_true",
                        help="neither pin the workers nor hand cores over: each runs --num-threads all the time")
    parser.add_argument("--core-handover", action=argparse.BooleanOptionalAction, default=True,
                        help="(default) unpinned workers that lend each other their cores: each runs its share of "
                             "the threads while the other has work and all of them while it is idle "
                             "(pdserve/engine/core_share.py); --no-core-handover pins each to its half instead")
    parser.add_argument("--disaggregation", choices=("adaptive", "static"), default="adaptive",
                        help="the proxy's choice of P/D or prefill on the decode worker, per request (default "
                             "adaptive here, see pdserve proxy --help)")
    parser.add_argument("--early-first-token", action=argparse.BooleanOptionalAction, default=True,
                        help="the proxy streams P's token 1 to the client as soon as the prefill leg answers "
                             "(--no-early-first-token: D streams it)")
    parser.add_argument("--concurrent-legs", action=argparse.BooleanOptionalAction, default=True,
                        help="(default) the proxy sends the decode leg with the prefill leg (pdserve proxy "
                             "--no-concurrent-legs: in turn)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="the proxy's TTFT objective, fixed part")
    parser.add_argument("--slo-ttft-ms-per-token", type=float, default=None,
                        help="the proxy's TTFT objective, per prompt token")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="the proxy's TPOT objective")
    parser.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                        help=f"shared worker token (default: ${INTERNAL_TOKEN_ENV}, else a random one)")
    parser.add_argument("--policy", default=None, choices=["round_robin", "least_loaded", "prefix", "kv_aware"])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--prefill-device", type=parse_device, default=None,
                        help="the prefill worker's device, e.g. cuda:0 (default: --device)")
    parser.add_argument("--decode-device", type=parse_device, default=None,
                        help="the decode worker's device, e.g. cuda:1 (default: --device); two workers on one "
                             "GPU split --gpu-memory-utilization between them")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                            help=f"ranks of the {role} worker (default: --tensor-parallel-size); its ranks start "
                                 "on this host")
    # Every other worker setting, declared once in pdserve/api/config.py, goes to both workers as given.
    add_worker_flags(parser, "decode", forward=True, exclude=_UP_OWNS)


@dataclass(slots=True)
class ChildSpec:
    name: str
    argv: list[str]
    port: int
    cores: Optional[tuple[int, ...]] = None
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment, trimmed


def hands_cores_over(args: argparse.Namespace, cores: Sequence[int]) -> bool:
    """Whether `up` gives its workers a core ledger: by default, on two cores or more."""
    return args.core_handover and not args.no_pin and len(cores) >= 2


def _resolve_port(host: str, port: int, taken: set[int]) -> int:
    """`port`, or a free one (0) that no other child of this `up` has; recorded in `taken`."""
    resolved = port if port != 0 else free_port(host, taken=taken)
    taken.add(resolved)
    return resolved


def _internal_port(host: str, port: int, asked: int, taken: set[int]) -> int:
    """A worker's internal listener: the worker's own default (its port + 1) next to a port given, a free
    one next to a port `up` picked (`port` 0 asked for any)."""
    return _resolve_port(host, 0 if asked == 0 else port + 1, taken)


def build_specs(args: argparse.Namespace, cores: Sequence[int], core_ledger: Optional[str] = None) -> list[ChildSpec]:
    """The three command lines, in start order: prefill, decode, proxy. `core_ledger`: the file
    both workers share with --core-handover (the caller makes it)."""
    plan = plan_cores(cores)
    if args.no_pin or core_ledger is not None:
        plan = CorePlan(None, None, plan.prefill_threads, plan.decode_threads)
    # The token travels in the environment, not in argv, which any local user can list.
    env = {INTERNAL_TOKEN_ENV: args.internal_token or secrets.token_hex(16)}
    base = python_module_command("pdserve.app.cli")
    common = ["--host", args.host, "--log-level", args.log_level]
    forwarded = list(getattr(args, FORWARDED_ARGS, None) or [])
    worker_args = role_worker_args(args, forwarded)
    taken = {port for port in (args.prefill_port, args.decode_port, args.port) if port != 0}
    prefill_port = _resolve_port(args.host, args.prefill_port, taken)
    decode_port = _resolve_port(args.host, args.decode_port, taken)
    proxy_port = _resolve_port(args.host, args.port, taken)
    specs = []
    for role, port, cores_of, threads in (("prefill", prefill_port, plan.prefill_cores, plan.prefill_threads),
                                          ("decode", decode_port, plan.decode_cores, plan.decode_threads)):
        internal_port = _internal_port(args.host, port, getattr(args, f"{role}_port"), taken)
        argv = [*base, role, "--port", str(port), "--internal-port", str(internal_port),
                "--num-threads", str(args.num_threads or threads), *common, *worker_args[role]]
        # The decode worker's own prefills (adaptive disaggregation) must not stall its streams.
        if not any(arg.split("=")[0] == "--max-step-ms" for arg in forwarded):
            argv += ["--max-step-ms", f"{args.slo_tpot_ms or SloConfig().tpot_ms:g}"]
        if core_ledger is not None:
            argv += ["--core-ledger", core_ledger, "--num-threads-alone", str(len(cores))]
        specs.append(ChildSpec(role, argv, port, cores_of, env))
    proxy = [*base, "proxy", "--port", str(proxy_port), *common, *_limit_args(forwarded),
             "--prefill", f"http://{args.host}:{prefill_port}", "--decode", f"http://{args.host}:{decode_port}"]
    if args.policy is not None:
        proxy += ["--policy", args.policy]
    if not args.concurrent_legs:
        proxy += ["--no-concurrent-legs"]
    if not args.early_first_token:
        proxy += ["--no-early-first-token"]
    for flag in ("disaggregation", "slo_ttft_ms", "slo_ttft_ms_per_token", "slo_tpot_ms"):
        if getattr(args, flag, None) is not None:
            proxy += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    specs.append(ChildSpec("proxy", proxy, proxy_port, None, env))
    return specs


def _limit_args(forwarded: list[str]) -> list[str]:
    """The request bounds among the forwarded worker flags: the proxy applies the same ones."""
    limit_flags = {spec.flag for spec in LIMIT_FLAGS}  # all take a value
    pairs = zip(forwarded, forwarded[1:])
    return [item for flag, value in pairs if flag in limit_flags for item in (flag, value)]


def _last_value(argv: Sequence[str], flag: str) -> Optional[str]:
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    return values[-1] if values else None


def _with_value(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """`argv` without any `flag VALUE` pair, then `flag value`."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == flag:
            skip = not skip
            continue
        kept.append(arg)
    return [*kept, flag, value]


def role_worker_args(args: argparse.Namespace, forwarded: list[str]) -> dict[str, list[str]]:
    """Each worker's flags: the forwarded ones, its own --device and --tensor-parallel-size when
    `--prefill-device` / `--decode-device` or `--prefill-tensor-parallel-size` /
    `--decode-tensor-parallel-size` name them, and half the GPU share each when both land on one GPU
    (auto and cuda mean cuda:0 there; on the CPU the share is unused)."""
    shared = _last_value(forwarded, "--device") or "auto"
    per_role, devices = {}, {}
    for role in ("prefill", "decode"):
        own = getattr(args, f"{role}_device", None)
        per_role[role] = _with_value(forwarded, "--device", own) if own else list(forwarded)
        ranks = getattr(args, f"{role}_tensor_parallel_size", None)
        if ranks is not None:
            per_role[role] = _with_value(per_role[role], "--tensor-parallel-size", str(ranks))
        devices[role] = {"auto": "cuda:0", "cuda": "cuda:0"}.get(own or shared, own or shared)
    if devices["prefill"] == devices["decode"]:
        share = float(_last_value(forwarded, "--gpu-memory-utilization")
                      or CacheConfig.model_fields["gpu_memory_utilization"].default)
        for role in per_role:
            per_role[role] = _with_value(per_role[role], "--gpu-memory-utilization", f"{share / 2:g}")
    offload_dir = _last_value(_split_equals(forwarded), "--kv-offload-dir")
    if offload_dir is not None:  # a file tier is one worker's (it locks its directory): one each
        for role in per_role:
            per_role[role] = _with_value(_split_equals(per_role[role]), "--kv-offload-dir",
                                         os.path.join(offload_dir, role))
    return per_role


def _split_equals(argv: Sequence[str]) -> list[str]:
    """`--flag=value` spelled as `--flag value`, so that flags are found whichever way they were typed."""
    split: list[str] = []
    for arg in argv:
        split += arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]
    return split


def _child_setup(cores: Optional[tuple[int, ...]], libc: Optional[ctypes.CDLL]) -> Callable[[], None]:
    """Runs in the child between fork and exec: pin it, and have it killed if `up` dies."""

    def setup() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if libc is not None:
            die_with_parent(libc, signal.SIGTERM)

    return setup


# Access-log lines of the proxy's once-a-second health polls: noise on a console.
_POLL_ACCESS_LINES = ('"GET /load HTTP/1.1" 200', '"GET /health HTTP/1.1" 200')


class PrefixedOutput:
    """Writes whole lines from several children to one stream, each with its name in front."""

    def __init__(self, out: IO[str]):
        self._out = out
        self._lock = threading.Lock()

    def write_line(self, name: str, line: str) -> None:
        if any(marker in line for marker in _POLL_ACCESS_LINES):
            return
        with self._lock:
            self._out.write(f"[{name}] {line.rstrip()}\n")
            self._out.flush()

    def pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.write_line(name, raw.decode(errors="replace"))
        stream.close()


@dataclass
class LocalCluster:
    specs: list[ChildSpec]
    output: PrefixedOutput
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _pumps: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        libc = linux_libc()
        # Every child is forked before any pump thread exists (preexec_fn and threads do not mix).
        for spec in self.specs:
            self.processes[spec.name] = subprocess.Popen(
                spec.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=child_environment({"PYTHONUNBUFFERED": "1", **spec.env}), start_new_session=True,
                preexec_fn=_child_setup(spec.cores, libc))
        for name, process in self.processes.items():
            pump = threading.Thread(target=self.output.pump, args=(name, process.stdout), daemon=True,
                                    name=f"up-log-{name}")
            pump.start()
            self._pumps.append(pump)

    def exited(self) -> Optional[tuple[str, int]]:
        """(name, status) of a child that is no longer running, if any."""
        for name, process in self.processes.items():
            status = process.poll()
            if status is not None:
                return name, status
        return None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the proxy first (no new requests), then the workers; SIGKILL stragglers."""
        for name in ("proxy", "decode", "prefill"):
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.output.write_line("up", f"{name} did not stop in {timeout_s:.0f}s; killing it")
                process.kill()
                process.wait()
        for pump in self._pumps:
            pump.join(timeout=2)


def _usable_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _is_ready(proxy_url: str) -> bool:
    try:
        return httpx.get(proxy_url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _banner(cluster: LocalCluster, host: str) -> list[str]:
    lines = []
    for spec in cluster.specs:
        pinned = f", cores {','.join(map(str, spec.cores))}" if spec.cores is not None else ""
        pid = cluster.processes[spec.name].pid
        lines.append(f"{spec.name:8s} http://{host}:{spec.port}  (pid {pid}{pinned})")
    return lines


def run_local_cluster(args: argparse.Namespace) -> int:
    """Start, wait for readiness, print the endpoint, and supervise until Ctrl-C or a child's death."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # our readiness probes are not news
    output = PrefixedOutput(sys.stdout)
    cores = _usable_cores()
    ledger_dir = tempfile.mkdtemp(prefix="pdserve-up-") if hands_cores_over(args, cores) else None
    core_ledger = os.path.join(ledger_dir, "core-ledger") if ledger_dir is not None else None
    if core_ledger is not None:
        create_ledger(core_ledger)
    cluster = LocalCluster(build_specs(args, cores, core_ledger), output)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop_requested.is_set():  # a second Ctrl-C: no more patience
            for process in cluster.processes.values():
                process.kill()
        stop_requested.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        for line in _banner(cluster, args.host):
            output.write_line("up", line)
        return supervise(cluster, args.host, stop_requested)
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ledger_dir is not None:
            shutil.rmtree(ledger_dir, ignore_errors=True)


def supervise(cluster: LocalCluster, host: str, stop_requested: threading.Event) -> int:
    proxy_url = f"http://{host}:{cluster.specs[-1].port}"
    ready = False
    while not stop_requested.wait(0.25):
        gone = cluster.exited()
        if gone is not None:
            cluster.output.write_line("up", f"{gone[0]} exited with status {gone[1]}; stopping the others")
            return 1
        if not ready and _is_ready(proxy_url):
            ready = True
            cluster.output.write_line("up", f"ready: OpenAI API at {proxy_url}/v1 (Ctrl-C stops all)")
    cluster.output.write_line("up", "stopping")
    return 0
