"""Renders the kustomizations under deploy/kubernetes/ without kubectl.

It implements only what pdserve's kustomizations use — `resources` (files and
directories), `patches` given by `path` (strategic merge, or `$patch: delete` of a
whole object) and `images` — and
refuses anything else, so it never renders silently differently from
`kubectl kustomize`; deploy/validate.sh compares the two when kubectl is there.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
# Strategic-merge keys of the lists these manifests patch (the Kubernetes
# schema's patchMergeKey); every other list is replaced whole, as kustomize does.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


class RenderError(Exception):
    """A kustomization uses something this renderer does not implement, or is broken."""


def render(directory: Path) -> list[dict]:
    """All objects of the kustomization in `directory`, patched, in resource order."""
    kustomization = _load_kustomization(directory)
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects.extend(render(path) if path.is_dir() else _load_documents(path))
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise RenderError(f"{directory}: only `patches: - path: FILE` is supported, got {patch_entry}")
        for patch in _load_documents(directory / patch_entry["path"]):
            target = _find_target(objects, {key: value for key, value in patch.items() if key != "$patch"})
            if patch.get("$patch") == "delete":
                objects.remove(target)
            else:
                objects[objects.index(target)] = merge_patch(target, patch)
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    return objects


def _load_kustomization(directory: Path) -> dict:
    path = directory / "kustomization.yaml"
    if not path.exists():
        raise RenderError(f"{directory} has no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text()) or {}
    unsupported = set(kustomization) - SUPPORTED_KEYS
    if unsupported:
        raise RenderError(f"{path}: unsupported fields {sorted(unsupported)}")
    return kustomization


def _load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def object_key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _find_target(objects: list[dict], patch: dict) -> dict:
    matches = [obj for obj in objects if object_key(obj) == object_key(patch)]
    if len(matches) != 1:
        raise RenderError(f"patch for {object_key(patch)} matches {len(matches)} objects")
    return matches[0]


def merge_patch(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into a copy of `base` (null deletes a key)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(key.startswith("$") for key in patch):
            raise RenderError(f"patch directives are not supported: {sorted(patch)}")
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = merge_patch(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        return _merge_keyed_list(base, patch, MERGE_KEYS[field], field)
    return copy.deepcopy(patch)


def _merge_keyed_list(base: list, patch: list, key: str, field: str) -> list:
    merged = copy.deepcopy(base)
    for item in patch:
        position = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
        if position is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[position] = merge_patch(merged[position], item, field)
    return merged


def _set_image(objects: list[dict], image: dict) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise RenderError(f"images: only name, newName and newTag are supported, got {image}")
    for obj in objects:
        if obj["kind"] not in POD_TEMPLATE_KINDS:
            continue
        pod_spec = obj["spec"]["template"]["spec"]
        for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"


def canonical(value: Any, field: str = "") -> Any:
    """`value` with keyed lists sorted by key: kustomize may order merged lists
    differently, and their order carries no meaning for these fields."""
    if isinstance(value, dict):
        return {key: canonical(item, key) for key, item in value.items()}
    if isinstance(value, list):
        items = [canonical(item, field) for item in value]
        if field in MERGE_KEYS:
            items.sort(key=lambda item: str(item.get(MERGE_KEYS[field])))
        return items
    return value


def differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    """How two renderings of one kustomization differ (empty when they agree)."""
    ours_by_key = {object_key(obj): canonical(obj) for obj in ours}
    theirs_by_key = {object_key(obj): canonical(obj) for obj in theirs}
    problems = [f"only in ours: {key}" for key in ours_by_key.keys() - theirs_by_key.keys()]
    problems += [f"only in kubectl's: {key}" for key in theirs_by_key.keys() - ours_by_key.keys()]
    for key in ours_by_key.keys() & theirs_by_key.keys():
        if ours_by_key[key] != theirs_by_key[key]:
            problems.append(f"{key} differs")
    return sorted(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path, help="a directory with a kustomization.yaml")
    parser.add_argument("--compare-with", type=Path, help="a `kubectl kustomize` rendering to compare with")
    args = parser.parse_args(argv)
    try:
        objects = render(args.directory)
    except (RenderError, OSError, yaml.YAMLError) as error:
        sys.stderr.write(f"kustomize_render: {error}\n")
        return 1
    if args.compare_with is None:
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
        return 0
    problems = differences(objects, _load_documents(args.compare_with))
    for problem in problems:
        sys.stderr.write(f"kustomize_render: {args.directory}: {problem}\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
