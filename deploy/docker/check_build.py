"""Build-time check of the worker image: which torch and which nixl build it carries.

    python3 check_build.py --variant cpu|cuda

Prints torch's version and CUDA version, the nixl build that `import nixl`
selected (nixl ships one per CUDA major and picks the one matching torch), and
whether that build's UCX has its CUDA and RDMA transports. Exits non-zero when
the image is not what TORCH_VARIANT asked for, so a CPU wheel in a CUDA image,
or a nixl build for another CUDA major, fails the build instead of the first
KV transfer. Needs no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# UCX plugin libraries inside a nixl build's bundled libs, and what they carry.
_UCX_PLUGINS = {"libuct_cuda": "cuda_copy/cuda_ipc", "libuct_ib": "rc/ud verbs"}


def inspect_build() -> dict:
    """What this Python environment would serve with."""
    import torch

    import nixl

    backend = sys.modules["nixl._api"].__name__.split(".")[0]  # e.g. nixl_cu12
    libs = Path(sys.modules[backend].__file__).parent.parent / f"{backend}.libs" / "ucx"
    plugins = {name: any(libs.glob(f"{name}.so*")) for name in _UCX_PLUGINS}
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "nixl_build": backend,
            "nixl_module": nixl.__name__, "ucx_plugins": plugins}


def problems(report: dict, variant: str) -> list[str]:
    """Why `report` does not fit a `variant` image (empty when it does)."""
    found = []
    cuda = report["torch_cuda"]
    if variant == "cpu" and cuda is not None:
        found.append(f"TORCH_VARIANT=cpu but torch {report['torch']} is built for CUDA {cuda}")
    if variant == "cuda":
        if cuda is None:
            found.append(f"TORCH_VARIANT=cuda but torch {report['torch']} has no CUDA: check TORCH_CUDA_INDEX_URL")
        elif report["nixl_build"] != f"nixl_cu{cuda.split('.')[0]}":
            found.append(f"torch is built for CUDA {cuda} but nixl selected {report['nixl_build']}")
        if not report["ucx_plugins"].get("libuct_cuda"):
            found.append(f"{report['nixl_build']} carries no UCX CUDA transports (libuct_cuda)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["cpu", "cuda"], required=True)
    args = parser.parse_args(argv)
    report = inspect_build()
    print(f"torch {report['torch']}, torch.version.cuda = {report['torch_cuda']}")
    print(f"nixl build selected: {report['nixl_build']}")
    for name, present in report["ucx_plugins"].items():
        print(f"UCX {_UCX_PLUGINS[name]} ({name}): {'present' if present else 'missing'}")
    found = problems(report, args.variant)
    for problem in found:
        print(f"check_build: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
