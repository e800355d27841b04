"""Vendors one version of a CustomResourceDefinition's schema as `<kind>.crd.json` beside it, for
deploy/validate_crds.py: the openAPIV3Schema as upstream ships it, plus where it came from.

Invariant: the schema is upstream's, byte for byte in meaning, except for the paths named with
--cut, each replaced by a stub that says which Kubernetes kind it holds; validate_crds.py hands
what sits there to kubernetes-validate as that kind, so no part goes unchecked. Usage, e.g.:
  python vendor_crd.py CRD.yaml --version v1 --release v0.10.0 --commit SHA \
      --repository https://github.com/kubernetes-sigs/lws --path config/crd/bases/FILE.yaml \
      --cut spec.leaderWorkerTemplate.leaderTemplate=PodTemplateSpec
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def cut(schema: dict, dotted_path: str, kind: str) -> None:
    node = schema
    for part in dotted_path.split("."):
        node = node["properties"][part]
    description = node.get("description", "")
    node.clear()
    node.update({"type": "object", "x-kubernetes-preserve-unknown-fields": True, "x-pdserve-validated-as": kind,
                 "description": description})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("crd", type=Path)
    parser.add_argument("--version", required=True, help="the served version to vendor, e.g. v1")
    parser.add_argument("--repository", required=True)
    parser.add_argument("--release", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--path", required=True, help="the CRD's path in that repository")
    parser.add_argument("--cut", action="append", default=[], metavar="PATH=KIND")
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v["name"] == args.version]
    schema = version["schema"]["openAPIV3Schema"]
    cuts = dict(entry.split("=", 1) for entry in args.cut)
    for path, kind in cuts.items():
        cut(schema, path, kind)
    vendored = {
        "$comment": "Vendored by vendor_crd.py; regenerate with it, do not edit. validate_crds.py rejects unknown "
                    "fields where the schema lists properties (as `kubectl apply --validate=strict` does) and "
                    "does not evaluate x-kubernetes-validations (CEL) rules.",
        "source": {"repository": args.repository, "release": args.release, "commit": args.commit, "path": args.path},
        "group": spec["group"], "kind": spec["names"]["kind"], "version": args.version,
        "cut": cuts,
        "openAPIV3Schema": schema,
    }
    out = HERE / f"{spec['names']['kind'].lower()}.crd.json"
    out.write_text(json.dumps(vendored, indent=1, sort_keys=False) + "\n")
    sys.stdout.write(f"wrote {out} ({out.stat().st_size} bytes)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
