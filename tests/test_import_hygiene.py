"""Dependency direction (house style): the core logic imports neither torch nor nixl,
and nixl has exactly one home. Each module is imported in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NIXL_HOME = REPO_ROOT / "pdserve" / "transfer" / "nixl_transport.py"

TORCH_AND_NIXL_FREE_MODULES = [
    # the contract shared with the proxy (every module of pdserve.api), records, metrics
    "pdserve.api", "pdserve.api.sampling", "pdserve.api.flags", "pdserve.api.validation", "pdserve.api.http_bounds",
    "pdserve.api.structured_protocol", "pdserve.api.tokenize_protocol", "pdserve.api.chat_template",
    "pdserve.api.config", "pdserve.request", "pdserve.api.errors", "pdserve.api.protocol", "pdserve.metrics",
    # the allocator
    "pdserve.kv", "pdserve.kv.specs", "pdserve.kv.hashing", "pdserve.kv.block_pool", "pdserve.kv.prefix",
    "pdserve.kv.manager", "pdserve.kv.sizing", "pdserve.kv.events", "pdserve.kv.events_wire",
    "pdserve.kv.routing_info", "pdserve.kv.offload", "pdserve.kv.offload_writes",
    # scheduling and the P/D logic around the transport
    "pdserve.engine.schedule_types", "pdserve.engine.scheduler", "pdserve.engine.stop_rules",
    "pdserve.engine.request_ids", "pdserve.engine.loop", "pdserve.engine.step_runner", "pdserve.parallel.errors",
    # the P/D package: params, handshake, geometry, both sides, admission, wiring
    "pdserve.pd", "pdserve.api.kv_transfer", "pdserve.pd.handshake", "pdserve.pd.leases", "pdserve.pd.messages",
    "pdserve.pd.geometry", "pdserve.pd.connector", "pdserve.pd.prefill", "pdserve.pd.decode", "pdserve.pd.peers",
    "pdserve.pd.admission", "pdserve.pd.wiring", "pdserve.pd.lending",
    "pdserve.pd.peer_trust", "pdserve.pd.peer_costs", "pdserve.pd.peer_admission", "pdserve.pd.peer_pull",
    # the transport contract, planner and fake
    "pdserve.transfer", "pdserve.transfer.transport", "pdserve.transfer.planner", "pdserve.transfer.fake_transport",
    "pdserve.transfer.token_units", "pdserve.transfer.descriptor_runs", "pdserve.transfer.staging",
    "pdserve.transfer.ranked_transport", "pdserve.transfer.ucx_address",
    "pdserve.kv.head_split", "pdserve.engine.step_budget",
    # the isolated NIXL agent: its engine side, and its process's module (which imports nixl's backend
    # module only inside main, by the name the engine passes)
    "pdserve.transfer.agent_client", "pdserve.transfer.agent_restart", "pdserve.kv.shared_memory",
    "pdserve.transfer.agent_wire", "pdserve.transfer.nixl_records", "pdserve.transfer.agent_process",
    # how children are started; the TP rendezvous and its control records
    "pdserve.api.child_process", "pdserve.parallel.control", "pdserve.parallel.rendezvous",
    # the HTTP layer
    "pdserve.server.app", "pdserve.server.kv_events", "pdserve.server.kv_events_routes",
]


@pytest.mark.parametrize("module", TORCH_AND_NIXL_FREE_MODULES)
def test_core_module_imports_neither_torch_nor_nixl(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r});"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl')))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{module} pulled in {result.stdout.strip()}"


def test_every_module_of_the_engine_package_imports_neither_torch_nor_nixl():
    """The torch line: all of pdserve/engine/ (scheduler, loop, outputs, stats...) loads without torch;
    the model-running side is pdserve/runner/."""
    modules = sorted(f"pdserve.engine.{p.stem}" for p in (REPO_ROOT / "pdserve" / "engine").glob("*.py")
                     if p.stem != "__init__")
    assert {"pdserve.engine.scheduler", "pdserve.engine.loop"} <= set(modules)
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}];"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl')))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"pdserve/engine/ pulled in {result.stdout.strip()}"


def imports_nixl(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "nixl" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nixl":
            return True
    return False


def test_exactly_one_module_of_pdserve_and_proxy_imports_nixl():
    sources = [p for tree in ("pdserve", "proxy") for p in sorted((REPO_ROOT / tree).rglob("*.py"))]
    assert sources, "no source files found"
    importers = [p for p in sources if imports_nixl(p.read_text(encoding="utf-8"))]
    assert importers == [NIXL_HOME]


def test_nixl_import_detector_sees_every_import_form():
    assert imports_nixl("import nixl")
    assert imports_nixl("import os, nixl._api as api")
    assert imports_nixl("def f():\n    from nixl._api import nixl_agent")
    assert not imports_nixl("import nixl_helpers\nfrom .nixl import x\n# import nixl")
