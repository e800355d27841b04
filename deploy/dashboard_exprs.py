"""PromQL of the Grafana dashboard, made checkable by promtool.

Grafana variables are not PromQL, so each query gets them replaced by a value
of the right kind (a range for `$__rate_interval`, a regex for a label
variable) and is written as a recording rule; `promtool check rules` on that
file then parses every query of the dashboard (deploy/validate.sh does this).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

DASHBOARD_PATH = Path(__file__).resolve().parent / "grafana" / "pdserve-dashboard.json"
RANGE_VARIABLES = ("$__rate_interval", "$__interval", "$__range")
LABEL_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def iter_panels(panels: list[dict]):
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query target of the dashboard."""
    return [
        (panel.get("title", "?"), target["expr"])
        for panel in iter_panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def substitute_variables(expr: str) -> str:
    """`expr` with Grafana's variables replaced by valid PromQL values."""
    for variable in RANGE_VARIABLES:
        expr = expr.replace(variable, "5m")
    return LABEL_VARIABLE.sub(".*", expr)


def as_rule_file(queries: list[tuple[str, str]]) -> dict:
    rules = [
        {"record": f"pdserve:dashboard_query_{index}", "expr": substitute_variables(expr)}
        for index, (_, expr) in enumerate(queries)
    ]
    return {"groups": [{"name": "pdserve-dashboard-queries", "rules": rules}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", type=Path, help="where to write the rule file")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD_PATH)
    args = parser.parse_args(argv)
    queries = dashboard_queries(json.loads(args.dashboard.read_text()))
    if not queries:
        sys.stderr.write(f"dashboard_exprs: no query in {args.dashboard}\n")
        return 1
    args.output.write_text(yaml.safe_dump(as_rule_file(queries), sort_keys=False, width=1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
