"""The allocator side of `pdserve.kv` stays importable without torch or nixl."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCH_FREE_MODULES = [
    "pdserve.kv",
    "pdserve.kv.specs",
    "pdserve.kv.hashing",
    "pdserve.kv.block_pool",
    "pdserve.kv.prefix",
    "pdserve.kv.manager",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_kv_module_imports_neither_torch_nor_nixl(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r});"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl')))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == "[]"
