"""The import graph of pdserve/ and proxy/, read from the source (nothing is imported).

Every import statement counts, wherever it stands: at module level, inside a function, or under
`if TYPE_CHECKING:`. An edge goes to the most specific project module an import names
(`from pdserve.kv import specs` is an edge to `pdserve.kv.specs`); imports from outside the
project are ignored.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT_PACKAGES = ("pdserve", "proxy")


def module_name(repo_root: Path, path: Path) -> str:
    parts = list(path.relative_to(repo_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(repo_root: Path) -> dict[str, Path]:
    """Every module of the project, by dotted name."""
    return {
        module_name(repo_root, path): path
        for package in ROOT_PACKAGES
        for path in sorted((repo_root / package).rglob("*.py"))
    }


def _absolute_base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _most_specific(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(importer: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that one module imports, counting every import statement in it."""
    targets: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(importer, is_package, node)
            names = [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _most_specific(name, modules)
            if target is not None and target != importer:
                targets.add(target)
    return targets


def import_graph(repo_root: Path) -> dict[str, set[str]]:
    modules = project_modules(repo_root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def subpackages_imported_by(graph: dict[str, set[str]], importer_root: str, imported_root: str) -> set[str]:
    """Which subpackages (or root modules) of `imported_root` the modules under `importer_root` import."""
    seen: set[str] = set()
    for importer, targets in graph.items():
        if importer.split(".")[0] != importer_root:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == imported_root:
                seen.add(".".join(parts[:2]))
    return seen
