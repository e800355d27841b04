"""The command line and environment of a pdserve child process, which nothing in the working directory can subvert.

Every child pdserve starts (`pdserve up`'s workers and proxy, a tensor-parallel worker's
other ranks, a worker's NIXL agent process) runs `python -P -m <module>`: no implicit
working directory on `sys.path`, so a stray `pdserve/` or `torch.py` there is never
imported. Its environment is the parent's trimmed to what a worker reads
(`child_environment`), with `PYTHONPATH` kept only in its absolute entries (an empty or
relative entry means the working directory again). Here, below every package that
starts a child, so the transfer layer and the composition roots share one rule.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

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
