"""Validates Prometheus Operator objects (PodMonitor, PrometheusRule) against the
JSON schemas in deploy/kubernetes/schemas/, which the Kubernetes schemas lack.

Invariant: every object it is given is checked against a schema; a kind with no
schema file is an error, never a silent pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parent / "kubernetes" / "schemas"


def load_schema(kind: str) -> dict | None:
    path = SCHEMA_DIR / f"{kind.lower()}.json"
    return json.loads(path.read_text()) if path.exists() else None


def check_object(obj: dict) -> list[str]:
    """Problems of one object (empty when it validates)."""
    kind = obj.get("kind", "?")
    name = obj.get("metadata", {}).get("name", "?")
    schema = load_schema(kind)
    if schema is None:
        return [f"{kind}/{name}: no schema in {SCHEMA_DIR}"]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{kind}/{name}: {'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(obj)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="multi-document YAML files")
    args = parser.parse_args(argv)
    problems: list[str] = []
    num_objects = 0
    for path in args.files:
        for obj in yaml.safe_load_all(path.read_text()):
            if obj is None:
                continue
            num_objects += 1
            problems.extend(f"{path}: {problem}" for problem in check_object(obj))
    for problem in problems:
        sys.stderr.write(f"validate_crds: {problem}\n")
    if num_objects == 0:
        sys.stderr.write("validate_crds: no object to validate\n")
        return 1
    sys.stdout.write(f"validate_crds: {num_objects} objects, {len(problems)} problems\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
