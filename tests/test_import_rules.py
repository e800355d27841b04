"""The import rules of the house, checked on the source so they cannot drift:

* no import cycle among the modules of pdserve/ and proxy/, counting every import
  (function-level and `if TYPE_CHECKING:` ones too), nor among pdserve's packages
  (imports go one way: api <- kv <- transfer <- request <- pd <- engine <- server <- app);
* the proxy imports pdserve only through `pdserve.api` (the contract) and the
  torch-free `pdserve.kv` (the hash chain, prefix rule and event format kv_aware
  routing shares with the workers), and loading all of it pulls in neither torch nor nixl;
* the contract (`pdserve.api`) imports nothing of pdserve outside itself;
* `pdserve.pd` never imports `pdserve.engine` (the request record sits below both);
* the torch line: `pdserve.engine` never imports `pdserve.runner`, and the runner reaches the engine only
  through its contracts (the schedule records and the `StepRunner` protocol);
* nothing imports the composition roots (`pdserve.app`) but the `python -m pdserve` entry point.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.import_graph import import_cycles, import_graph, imports_of, project_modules, subpackages_imported_by

REPO_ROOT = Path(__file__).resolve().parents[1]
PROXY_MAY_IMPORT = {"pdserve.api", "pdserve.kv"}


def importers_of(graph: dict[str, set[str]], prefix: str, *, outside: str) -> dict[str, list[str]]:
    """{module outside `outside`: the modules under `prefix` it imports}."""
    found = {}
    for importer, targets in graph.items():
        if importer == outside or importer.startswith(outside + "."):
            continue
        hits = sorted(t for t in targets if t == prefix or t.startswith(prefix + "."))
        if hits:
            found[importer] = hits
    return found


def test_no_import_cycle_among_the_modules_of_pdserve_and_proxy():
    graph = import_graph(REPO_ROOT)
    assert len(graph) > 100, "the source tree was not found"
    assert import_cycles(graph) == []


def package_graph(graph: dict[str, set[str]], root: str) -> dict[str, set[str]]:
    """The graph of `root`'s packages and loose modules (pdserve.kv.hashing counts as pdserve.kv)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for importer, targets in graph.items():
        if importer.split(".")[0] != root or importer == root:
            continue
        packages.setdefault(package(importer), set()).update(
            package(t) for t in targets if t.split(".")[0] == root and t != root and package(t) != package(importer))
    return packages


def test_no_import_cycle_among_the_packages_of_pdserve():
    packages = package_graph(import_graph(REPO_ROOT), "pdserve")
    assert {"pdserve.api", "pdserve.kv", "pdserve.pd", "pdserve.engine", "pdserve.app"} <= set(packages)
    assert import_cycles(packages) == []


def test_the_proxy_imports_pdserve_only_through_its_contract_and_the_torch_free_kv_package():
    graph = import_graph(REPO_ROOT)
    used = subpackages_imported_by(graph, "proxy", "pdserve")
    assert used <= PROXY_MAY_IMPORT, f"the proxy imports {sorted(used - PROXY_MAY_IMPORT)}"
    assert "pdserve.api" in used  # it validates with the workers' own code


def test_the_contract_imports_nothing_of_pdserve_outside_itself():
    graph = import_graph(REPO_ROOT)
    reaching_out = {module: sorted(t for t in targets if not t.startswith("pdserve.api"))
                    for module, targets in graph.items() if module.startswith("pdserve.api")}
    assert {module: targets for module, targets in reaching_out.items() if targets} == {}


def test_pd_never_imports_the_engine_and_nothing_imports_the_composition_roots():
    graph = import_graph(REPO_ROOT)
    pd_modules = {m: t for m, t in graph.items() if m.startswith("pdserve.pd.")}
    assert pd_modules, "pdserve/pd/ was not found"
    assert {m: sorted(t for t in targets if t.startswith("pdserve.engine")) for m, targets in pd_modules.items()
            if any(t.startswith("pdserve.engine") for t in targets)} == {}
    # `python -m pdserve` is an entry point like the console script, not an importer
    assert {m: t for m, t in importers_of(graph, "pdserve.app", outside="pdserve.app").items()
            if m != "pdserve.__main__"} == {}


RUNNER_MAY_IMPORT_OF_THE_ENGINE = {"pdserve.engine.schedule_types", "pdserve.engine.step_runner"}


def test_the_engine_never_imports_the_runner_and_the_runner_sees_only_the_engine_contracts():
    graph = import_graph(REPO_ROOT)
    engine_modules = {m: t for m, t in graph.items() if m.startswith("pdserve.engine.")}
    runner_modules = {m: t for m, t in graph.items() if m.startswith("pdserve.runner.")}
    assert "pdserve.engine.scheduler" in engine_modules and "pdserve.runner.model_runner" in runner_modules
    assert {m: sorted(t for t in targets if t.startswith("pdserve.runner")) for m, targets in engine_modules.items()
            if any(t.startswith("pdserve.runner") for t in targets)} == {}
    reached = {m: sorted(t for t in targets if t.startswith("pdserve.engine.") and t not in RUNNER_MAY_IMPORT_OF_THE_ENGINE)
               for m, targets in runner_modules.items()}
    assert {m: targets for m, targets in reached.items() if targets} == {}


def test_loading_every_proxy_module_pulls_in_neither_torch_nor_nixl():
    modules = sorted(name for name in project_modules(REPO_ROOT) if name.split(".")[0] == "proxy")
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nixl")))
        print(",".join(sorted({{".".join(m.split(".")[:2]) for m in sys.modules if m.split(".")[0] == "pdserve"}})))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    heavy, pdserve_parts = result.stdout.splitlines()
    assert heavy == "[]"
    assert set(pdserve_parts.split(",")) <= {"pdserve"} | PROXY_MAY_IMPORT


# ---- the checks above can fail: the graph reader sees every import form ----------------------------

def write_tree(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_the_graph_reader_counts_type_checking_function_level_and_relative_imports(tmp_path):
    write_tree(tmp_path, {
        "pdserve/__init__.py": "",
        "pdserve/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pdserve.b import Thing
        """,
        "pdserve/b.py": """
            def later():
                from . import c
        """,
        "pdserve/c.py": "import pdserve.a\n",
        "pdserve/sub/__init__.py": "from .leaf import x\n",
        "pdserve/sub/leaf.py": "from ..a import y\nimport os\n",
        "proxy/__init__.py": "",
        "proxy/p.py": "from pdserve.sub import leaf\nfrom pdserve import a\n",
    })
    modules = project_modules(tmp_path)
    assert imports_of("pdserve.a", modules["pdserve.a"], modules) == {"pdserve.b"}
    assert imports_of("pdserve.b", modules["pdserve.b"], modules) == {"pdserve.c"}
    assert imports_of("pdserve.sub", modules["pdserve.sub"], modules) == {"pdserve.sub.leaf"}
    assert imports_of("pdserve.sub.leaf", modules["pdserve.sub.leaf"], modules) == {"pdserve.a"}
    graph = import_graph(tmp_path)
    assert import_cycles(graph) == [["pdserve.a", "pdserve.b", "pdserve.c"]]
    assert subpackages_imported_by(graph, "proxy", "pdserve") == {"pdserve.sub", "pdserve.a"}
    assert importers_of(graph, "pdserve.a", outside="pdserve.a") == {
        "pdserve.c": ["pdserve.a"], "pdserve.sub.leaf": ["pdserve.a"], "proxy.p": ["pdserve.a"]}


def test_package_graph_folds_modules_into_their_packages():
    graph = {"pdserve.a.x": {"pdserve.b.y", "pdserve.a.z", "proxy.p"}, "pdserve.b.y": {"pdserve.a.z"},
             "pdserve.a.z": set(), "pdserve.m": {"pdserve.a.x"}, "pdserve": {"pdserve.m"}}
    assert package_graph(graph, "pdserve") == {"pdserve.a": {"pdserve.b"}, "pdserve.b": {"pdserve.a"},
                                               "pdserve.m": {"pdserve.a"}}
    assert import_cycles(package_graph(graph, "pdserve")) == [["pdserve.a", "pdserve.b"]]


def test_cycle_finder_reports_each_strongly_connected_group_once():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": {"d"}, "g": {"g"}}
    assert import_cycles(graph) == [["a", "b"], ["d", "e", "f"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []
