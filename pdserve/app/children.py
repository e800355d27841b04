"""What the child processes a composition root starts share: a free local port, dying with the parent,
and a command line and environment that nothing in the working directory can subvert.

`pdserve up` starts prefill, decode and proxy; a tensor-parallel worker starts its other
ranks. Either way a child must not outlive the process that started it, it runs
`python -P -m <module>` (no implicit working directory on `sys.path`: a stray
`pdserve/` or `torch.py` there is never imported), and its environment is the
parent's trimmed to what a worker reads (`child_environment`), with `PYTHONPATH`
kept only in its absolute entries (an empty or relative entry means the working
directory again).
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from typing import Mapping, Optional

_PR_SET_PDEATHSIG = 1
# What a child keeps of its parent's environment: the system basics, Python's own switches that change
# no import, and the libraries' and pdserve's settings (by prefix). Anything else (cloud credentials,
# LD_PRELOAD, PYTHONSTARTUP, PYTHONHOME...) stays with the parent.
KEPT_VARIABLES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "LD_LIBRARY_PATH",
    "XDG_CACHE_HOME", "VIRTUAL_ENV", "CC", "CXX", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
    "PYTHONDONTWRITEBYTECODE",
})
KEPT_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "UCX_", "NIXL_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                 "TORCH_", "PYTORCH_", "HF_", "TRITON_", "PDSERVE_")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def linux_libc() -> Optional[ctypes.CDLL]:
    """The C library on Linux (for prctl), else None. Load it before forking: a child set-up may
    only call it."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent(libc: ctypes.CDLL, signal_number: int) -> None:
    """In a child between fork and exec: have Linux send it `signal_number` when its parent ends,
    however the parent ends."""
    libc.prctl(_PR_SET_PDEATHSIG, signal_number)


def python_module_command(module: str, *args: str) -> list[str]:
    """`python -P -m module args...`: the working directory is not put on the child's `sys.path`."""
    return [sys.executable, "-P", "-m", module, *args]


def child_environment(extra: Mapping[str, str] = {}, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` trimmed to `KEPT_VARIABLES` and `KEPT_PREFIXES`, `PYTHONPATH` to its absolute entries,
    then `extra` on top."""
    kept = {name: value for name, value in environ.items()
            if name in KEPT_VARIABLES or name.startswith(KEPT_PREFIXES)}
    search_path = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(entry)]
    if search_path:
        kept["PYTHONPATH"] = os.pathsep.join(search_path)
    return {**kept, **extra}
