"""deploy/lws's NetworkPolicy keeps the proxy off the ranks' rendezvous and collectives (issue 36, item 5):
the proxy's pods reach the workers' HTTP port only, while every rank (leaders and the others) still
reaches every port of every rank. Evaluated on the rendered manifests, as Kubernetes evaluates it."""

from __future__ import annotations

from typing import Optional

from tests.deploy.test_llm_d_lws import LWS_LABEL, _objects

EVERY_PORT = "every port"


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if (operator == "In" and labels.get(key) not in values) or (operator == "NotIn" and labels.get(key) in values) \
                or (operator == "Exists" and key not in labels) or (operator == "DoesNotExist" and key in labels):
            return False
    return True


def _admitted_ports(policy: dict, source_labels: dict) -> set[Optional[str]]:
    ports: set = set()
    for rule in policy["ingress"]:
        if any("podSelector" in peer and _selects(peer["podSelector"], source_labels) for peer in rule["from"]):
            ports |= {port["port"] for port in rule["ports"]} if "ports" in rule else {EVERY_PORT}
    return ports


def test_the_proxy_reaches_the_workers_http_port_only_and_every_rank_reaches_every_port():
    objects = _objects("lws")
    policy = objects[("NetworkPolicy", "pdserve-workers")]["spec"]
    proxy = objects[("Deployment", "pdserve-proxy")]["spec"]["template"]["metadata"]["labels"]
    assert _admitted_ports(policy, proxy) == {"http"}
    for role in ("prefill", "decode"):
        template = objects[("LeaderWorkerSet", f"pdserve-{role}")]["spec"]["leaderWorkerTemplate"]
        for pod in ("leaderTemplate", "workerTemplate"):
            # the LWS controller adds its own label to every pod of the group
            labels = {**template[pod]["metadata"]["labels"], LWS_LABEL: f"pdserve-{role}"}
            assert _selects(policy["podSelector"], labels), f"the policy covers the {role} {pod}"
            assert EVERY_PORT in _admitted_ports(policy, labels), f"the {role} {pod} reaches its peers"
