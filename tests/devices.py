"""The devices tests run on: the CPU always, CUDA when this machine has it.

One list, used by the `device` fixture (tests/conftest.py) and by module-scoped
fixtures that start workers, so a test written once runs on both and a CUDA
case is skipped cleanly in CI.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_params() -> list:
    """pytest params: "cpu", and "cuda" marked `gpu` and skipped without CUDA."""
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=[
            pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CUDA")]),
    ]
