"""Validates the objects the Kubernetes schemas lack against deploy/kubernetes/schemas/: the
Prometheus Operator kinds (schemas written for pdserve, `<kind>.json`), the GIE and LWS kinds
(upstream CRD schemas vendored by schemas/vendor_crd.py, `<kind>.crd.json`) and the typed
documents ConfigMaps carry (the EPP's EndpointPickerConfig).

Invariant: every object it is given is checked, never silently passed. A kind with a schema here is
validated here; with --core-out, every other object, and every pod template cut out of a vendored
schema (written as a v1 PodTemplate), goes to that file for kubernetes-validate, which fails on a
kind it does not know; without --core-out a kind with no schema here is an error.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parent / "kubernetes" / "schemas"
# What the vendored schemas leave open (`metadata: {type: object}`): the fields pdserve writes.
OBJECT_META = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def load_schema(kind: str) -> dict | None:
    path = SCHEMA_DIR / f"{kind.lower()}.json"
    if path.exists():
        return json.loads(path.read_text())
    vendored = SCHEMA_DIR / f"{kind.lower()}.crd.json"
    return crd_schema(json.loads(vendored.read_text())) if vendored.exists() else None


def crd_schema(vendored: dict) -> dict:
    """A JSON schema (draft 7) of one vendored CRD version, strict about unknown fields."""
    schema = strict(copy.deepcopy(vendored["openAPIV3Schema"]))
    schema["properties"].update(
        apiVersion={"const": f"{vendored['group']}/{vendored['version']}"},
        kind={"const": vendored["kind"]},
        metadata=OBJECT_META,
    )
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def strict(node: Any) -> Any:
    """OpenAPI v3 as the API server reads it, in JSON-schema terms: `nullable` allows null, and an
    object that lists its properties takes no other (the API server prunes or, strict, refuses them)."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: strict(value) for key, value in node.items()}
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    return node


def cut_templates(obj: dict) -> Iterator[dict]:
    """The pod templates a vendored schema left to kubernetes-validate, each as a v1 PodTemplate."""
    vendored = SCHEMA_DIR / f"{obj.get('kind', '?').lower()}.crd.json"
    if not vendored.exists():
        return
    for path, kind in json.loads(vendored.read_text())["cut"].items():
        if kind != "PodTemplateSpec":
            raise ValueError(f"{vendored.name}: cannot hand a {kind} to kubernetes-validate")
        node: Any = obj
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            name = f"{obj['metadata']['name']}-{path.rsplit('.', 1)[-1].lower()}"
            yield {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": node}


def embedded_documents(obj: dict) -> Iterator[tuple[str, dict]]:
    """Typed documents (apiVersion and kind) a ConfigMap carries as values, by key."""
    if obj.get("kind") != "ConfigMap":
        return
    for key, text in (obj.get("data") or {}).items():
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(document, dict) and {"apiVersion", "kind"} <= document.keys():
            yield key, document


def check_object(obj: dict, schema: dict | None = None) -> list[str]:
    """Problems of one object (empty when it validates)."""
    kind = obj.get("kind", "?")
    name = obj.get("metadata", {}).get("name", "?")
    schema = schema or load_schema(kind)
    if schema is None:
        return [f"{kind}/{name}: no schema in {SCHEMA_DIR}"]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{kind}/{name}: {'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(obj)
    ]


def sort_objects(objects: list[dict], split_core: bool) -> tuple[list[str], list[dict], int]:
    """(problems, objects for kubernetes-validate, objects checked here)."""
    problems: list[str] = []
    core: list[dict] = []
    num_checked = 0
    for obj in objects:
        schema = load_schema(obj.get("kind", "?"))
        if schema is None and split_core:
            core.append(obj)
        else:
            problems.extend(check_object(obj, schema))
            num_checked += 1
        core.extend(cut_templates(obj))
        for key, document in embedded_documents(obj):
            where = f"ConfigMap/{obj['metadata']['name']}[{key}]"
            problems.extend(f"{where}: {problem}" for problem in check_object(document))
            num_checked += 1
    return problems, core, num_checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="multi-document YAML files")
    parser.add_argument("--core-out", type=Path, help="write the objects for kubernetes-validate here")
    parser.add_argument("--require-kind", action="append", default=[], metavar="KIND",
                        help="fail unless the files (or a ConfigMap in them) hold this kind (repeatable)")
    args = parser.parse_args(argv)
    problems: list[str] = []
    core: list[dict] = []
    num_checked = 0
    kinds: set[str] = set()
    for path in args.files:
        objects = [obj for obj in yaml.safe_load_all(path.read_text()) if obj is not None]
        kinds.update(obj.get("kind", "?") for obj in objects)
        kinds.update(document["kind"] for obj in objects for _, document in embedded_documents(obj))
        found, for_core, checked = sort_objects(objects, args.core_out is not None)
        problems.extend(f"{path}: {problem}" for problem in found)
        core.extend(for_core)
        num_checked += checked
    problems.extend(f"no {kind} among the objects" for kind in args.require_kind if kind not in kinds)
    for problem in problems:
        sys.stderr.write(f"validate_crds: {problem}\n")
    if num_checked == 0:
        sys.stderr.write("validate_crds: no object to validate\n")
        return 1
    if args.core_out is not None:
        args.core_out.write_text(yaml.safe_dump_all(core, sort_keys=False))
    sys.stdout.write(f"validate_crds: {num_checked} objects here, {len(core)} for kubernetes-validate, "
                     f"{len(problems)} problems\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
