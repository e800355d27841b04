"""Builds and loads pdserve's native CPU kernels (the `*.cpp` and `*.h` in this folder) once per machine.

Each source compiles to one object, as many at once as there are CPUs, and the objects link
into one library, cached under a hash of everything it is built from.
Invariant: a library is only loaded if it was compiled from these exact sources and headers,
with these flags, for this torch, compiler and CPU; when it cannot be (no compiler, a failed
build, not x86 with AVX2), callers stay on their pure-torch paths and one warning says why.
Processes that need the same library at once (a worker's tensor-parallel ranks, test processes)
build it once: the first takes a lock file beside it, the others wait and load what it built.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))  # the kernels' *.cpp and *.h
LIBRARY_NAMESPACE = "pdserve_cpu"
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_BUILD_TIMEOUT_S = 300.0
# Started first when there are fewer CPUs than sources: it instantiates every op's dispatcher
# templates, ~6 s where the others take 3-4.5 s (2-core CI machine: the build ends ~2 s sooner).
_SLOWEST_SOURCE = "registration.cpp"


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded on this machine."""


def source_paths() -> list[str]:
    """The translation units, sorted: each compiles to one object of the library."""
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "*.cpp")))


def header_paths() -> list[str]:
    """The headers the translation units include, sorted."""
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "*.h")))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _torch_lib() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib")


def _compile_command(source_path: str, object_path: str) -> list[str]:
    """One translation unit to one object file."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    return [
        _compiler(), "-O3", "-march=native", "-fopenmp", "-std=c++20", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c", source_path, "-o", object_path,
    ]


def _link_command(object_paths: list[str], output_path: str) -> list[str]:
    torch_lib = _torch_lib()
    return [
        _compiler(), "-fopenmp", "-shared", *object_paths, "-o", output_path,
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}",
    ]


def _object_name(source_path: str) -> str:
    return os.path.splitext(os.path.basename(source_path))[0] + ".o"


def _build_key() -> str:
    """Everything the compiled library depends on, hashed: every source and header (by name and
    content, in sorted order), torch, the compiler, the CPU and the commands."""
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"no C++ compiler ({_compiler()}): {exc}") from exc
    digest = hashlib.sha256()
    for path in sorted(source_paths() + header_paths()):
        with open(path, "rb") as f:
            content = f.read()
        digest.update(f"{os.path.basename(path)}\0{len(content)}\0".encode())
        digest.update(content)
    sources = source_paths()
    commands = [_compile_command(path, _object_name(path)) for path in sources]
    commands.append(_link_command([_object_name(path) for path in sources], "out.so"))
    for part in (torch.__version__, version, " ".join(sorted(_cpu_flags())), *(" ".join(c) for c in commands)):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve", "kernels")


def _run_step(command: list[str], what: str, deadline_s: float) -> None:
    """Runs one compiler command; a failure or overrun raises naming `what` (the source or library)."""
    timeout_s = max(1.0, deadline_s - time.monotonic())
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"{what} took over {_BUILD_TIMEOUT_S:.0f} s (the whole build's limit)") from exc
    except OSError as exc:
        raise KernelBuildError(f"{what} failed: {exc}") from exc
    if result.returncode != 0:
        raise KernelBuildError(f"{what} failed: {result.stderr[-2000:]}")


def _build(library_path: str) -> None:
    """Compile each source into an object in a private folder (as many at once as there are CPUs),
    link them into a temporary name, then rename: concurrent builders never see half a file."""
    sources = source_paths()
    if not sources:
        raise KernelBuildError(f"no C++ sources in {SOURCE_DIR}")
    os.makedirs(os.path.dirname(library_path), exist_ok=True)
    work_dir = tempfile.mkdtemp(suffix=".build", dir=os.path.dirname(library_path))
    partial_path = os.path.join(work_dir, "library.so.partial")
    objects = [os.path.join(work_dir, _object_name(path)) for path in sources]
    started_s = time.monotonic()
    deadline_s = started_s + _BUILD_TIMEOUT_S
    try:
        workers = max(1, min(len(sources), os.cpu_count() or 1))
        slowest_first = sorted(range(len(sources)), key=lambda i: os.path.basename(sources[i]) != _SLOWEST_SOURCE)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            started = {i: pool.submit(_run_step, _compile_command(sources[i], objects[i]), f"compiling {sources[i]}",
                                      deadline_s) for i in slowest_first}
            steps = [started[i] for i in range(len(sources))]
            failures = []
            for source, step in zip(sources, steps):
                try:
                    step.result()
                except KernelBuildError as exc:
                    failures.append((source, exc))
        if failures:
            names = ", ".join(os.path.basename(source) for source, _ in failures)
            raise KernelBuildError(f"{len(failures)} of {len(sources)} sources failed to compile ({names}); "
                                   f"the first: {failures[0][1]}") from failures[0][1]
        _run_step(_link_command(objects, partial_path), f"linking {library_path} from {', '.join(sources)}",
                  deadline_s)
        os.replace(partial_path, library_path)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    logger.info("compiled native CPU kernels (%d sources) in %.1f s: %s", len(sources),
                time.monotonic() - started_s, library_path)


def build_once(library_path: str, build: Callable[[str], None], wait_s: float = _BUILD_TIMEOUT_S + 60.0,
               poll_s: float = 0.2) -> None:
    """`build(library_path)` unless the file exists, one process at a time: the others wait on an
    flock of `<library>.lock` (the kernel lets it go when its holder exits, however), then find the
    library built. A holder that outlasts `wait_s` is waited for no longer: this process builds too
    (each build writes its own temporary files and renames, so two at once stay safe)."""
    os.makedirs(os.path.dirname(library_path), exist_ok=True)
    fd = os.open(library_path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    locked = False
    try:
        deadline_s = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline_s:
                    logger.warning("another process has built %s for over %.0f s; building it here too",
                                   library_path, wait_s)
                    break
                time.sleep(poll_s)
        if not os.path.exists(library_path):
            build(library_path)
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _register_fakes() -> None:
    """Shapes of each op's output, so that torch.compile can trace through the ops."""

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q4_1_linear")
    def _q4_1(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q4_1_linear_with")
    def _q4_1_with(x: torch.Tensor, blocks: torch.Tensor, lanes: int, digits: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q4_1_row_tiles")
    def _q4_1_row_tiles(blocks: torch.Tensor) -> torch.Tensor:
        pairs = (blocks.shape[1] // 20 + 1) // 2
        return blocks.new_empty((blocks.shape[0] // 16, pairs * 640))

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q4_1_tiled_linear")
    def _q4_1_tiled(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], tiles.shape[0] * 16))

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q8_0_linear")
    def _q8_0(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::dequantize_blocks")
    def _dequantize(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
        return blocks.new_empty((blocks.shape[0], blocks.shape[1] // block_bytes * 32), dtype=torch.float32)

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::greedy_tokens")
    def _greedy(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((logits.shape[0], 1), dtype=torch.float64)

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::paged_decode_attention")
    def _attention(q, k_cache, v_cache, block_table, key_start, key_end, k_new, v_new, scale, sinks=None):  # noqa: ANN001
        return torch.empty_like(q)


def _load() -> None:
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        raise KernelBuildError(f"the CPU lacks {', '.join(missing)}")
    library_path = os.path.join(cache_dir(), f"cpu_kernels-{_build_key()}.so")
    if not os.path.exists(library_path):
        build_once(library_path, _build)
    torch.ops.load_library(library_path)
    _register_fakes()


@functools.lru_cache(maxsize=1)  # loading a library into the process is once-only by nature
def cpu_kernels_error() -> Optional[str]:
    """None when the native CPU kernels are loaded and usable; otherwise why they are not."""
    try:
        _load()
    except (KernelBuildError, OSError, RuntimeError) as exc:
        logger.warning("native CPU kernels unavailable, using the slower torch paths: %s", exc)
        return str(exc)
    return None


def cpu_kernels_available() -> bool:
    return cpu_kernels_error() is None


def ops() -> torch._ops._OpNamespace:
    """`torch.ops.pdserve_cpu`; only call after `cpu_kernels_available()` returned True."""
    return getattr(torch.ops, LIBRARY_NAMESPACE)
