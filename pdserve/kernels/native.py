"""Builds and loads pdserve's native CPU kernels (`cpu_kernels.cpp`) once per machine.

Invariant: a library is only loaded if it was compiled from this exact source, with these
flags, for this torch, compiler and CPU; when it cannot be (no compiler, a failed build, not
x86 with AVX2), callers stay on their pure-torch paths and one warning says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
LIBRARY_NAMESPACE = "pdserve_cpu"
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_BUILD_TIMEOUT_S = 300.0


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded on this machine."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compile_command(output_path: str) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    return [
        _compiler(), "-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, SOURCE_PATH, "-o", output_path,
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}",
    ]


def _build_key() -> str:
    """Everything the compiled library depends on, hashed."""
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"no C++ compiler ({_compiler()}): {exc}") from exc
    digest = hashlib.sha256()
    with open(SOURCE_PATH, "rb") as f:
        digest.update(f.read())
    for part in (torch.__version__, version, " ".join(sorted(_cpu_flags())), " ".join(_compile_command("out.so"))):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve", "kernels")


def _build(library_path: str) -> None:
    """Compile into a temporary name, then rename: concurrent builders never see half a file."""
    os.makedirs(os.path.dirname(library_path), exist_ok=True)
    handle, partial_path = tempfile.mkstemp(suffix=".so.partial", dir=os.path.dirname(library_path))
    os.close(handle)
    started_s = time.monotonic()
    try:
        result = subprocess.run(_compile_command(partial_path), capture_output=True, text=True,
                                timeout=_BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {SOURCE_PATH} failed: {result.stderr[-2000:]}")
        os.replace(partial_path, library_path)
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"compiling {SOURCE_PATH} took over {_BUILD_TIMEOUT_S:.0f} s") from exc
    finally:
        if os.path.exists(partial_path):
            os.unlink(partial_path)
    logger.info("compiled native CPU kernels in %.1f s: %s", time.monotonic() - started_s, library_path)


def _register_fakes() -> None:
    """Shapes of each op's output, so that torch.compile can trace through the ops."""

    @torch.library.register_fake(f"{LIBRARY_NAMESPACE}::q4_1_linear")
    def _q4_1(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

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
    def _attention(q, k_cache, v_cache, block_table, key_start, key_end, k_new, v_new, scale):  # noqa: ANN001
        return torch.empty_like(q)


def _load() -> None:
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        raise KernelBuildError(f"the CPU lacks {', '.join(missing)}")
    library_path = os.path.join(cache_dir(), f"cpu_kernels-{_build_key()}.so")
    if not os.path.exists(library_path):
        _build(library_path)
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
