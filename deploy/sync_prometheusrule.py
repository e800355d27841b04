"""Writes the Prometheus Operator `PrometheusRule` from deploy/prometheus/alerts.yml.

Invariant: the rules Kubernetes deploys are exactly the rules promtool checks and
tests; `--check` (run by deploy/validate.sh) fails when the two have drifted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
ALERTS_PATH = DEPLOY_DIR / "prometheus" / "alerts.yml"
RULE_PATH = DEPLOY_DIR / "kubernetes" / "monitoring" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by deploy/sync_prometheusrule.py:
# edit alerts.yml, then run `python3 deploy/sync_prometheusrule.py`.
# The Prometheus Operator loads these rules; promtool checks and tests the source.
"""


class _BlockDumper(yaml.SafeDumper):
    """Dumps multi-line strings (PromQL, descriptions) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _represent_str)


def build_rule(alerts: dict) -> dict:
    """The PrometheusRule object wrapping the rule groups of `alerts`."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "pdserve",
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve"},
        },
        "spec": {"groups": alerts["groups"]},
    }


def render() -> str:
    alerts = yaml.safe_load(ALERTS_PATH.read_text())
    body = yaml.dump(build_rule(alerts), Dumper=_BlockDumper, sort_keys=False, width=100)
    return HEADER + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not RULE_PATH.exists() or RULE_PATH.read_text() != text:
            sys.stderr.write(f"{RULE_PATH} is out of date: run python3 deploy/sync_prometheusrule.py\n")
            return 1
        return 0
    RULE_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
