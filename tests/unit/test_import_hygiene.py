"""The core logic stays torch-free and nixl-free (house style: dependency direction)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE_MODULES = [
    "pdserve.config",
    "pdserve.request",
    "pdserve.errors",
    "pdserve.protocol",
    "pdserve.kv.specs",
    "pdserve.kv.hashing",
    "pdserve.kv.block_pool",
    "pdserve.kv.manager",
    "pdserve.engine.schedule_types",
    "pdserve.engine.scheduler",
    "pdserve.engine.stop_rules",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_core_module_imports_without_torch_or_nixl(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        "heavy = sorted(m for m in ('torch', 'nixl') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} pulled in {result.stdout.strip()}"
