"""Checks, in rendered manifests, that every pdserve worker's internal listener and UCX ports are
declared and reachable only from label-selected peers, and that no allow-list is the whole pod network.

For every worker container (`pdserve prefill|decode|serve`) in a Deployment or LeaderWorkerSet:
* its pod is selected by an Ingress NetworkPolicy (decode pods too);
* one that serves HTTP on a pod address (a port named "http", a --host other than loopback) declares
  its --internal-port (default --port + 1) as the containerPort "internal", some rule admits that port,
  and every rule that admits it names its peers by label (no rule open to all, no empty selector, no
  ipBlock, no bare namespaceSelector): the internal routes are for peers, never for everyone;
* with UCX_TCP_PORT_RANGE set, one rule admits the whole range, and every rule that admits any of it
  names its peers by label;
* its --kv-allowed-peers names no network wider than a /16 (IPv6: /64).
Usage: check_policies.py RENDERED.yaml... (exits 1 and lists the problems).
"""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import yaml

WORKER_COMMANDS = ("prefill", "decode", "serve")
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
MIN_IPV4_PREFIX, MIN_IPV6_PREFIX = 16, 64
VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class WorkerPod(NamedTuple):
    where: str
    labels: dict
    container: dict
    environment: dict  # what $(NAME) in its args expands to, from its ConfigMaps and literal env


def _pod_templates(obj: dict) -> Iterator[tuple[str, dict]]:
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") in ("Deployment", "StatefulSet"):
        yield name, obj["spec"]["template"]
    elif obj.get("kind") == "LeaderWorkerSet":
        template = obj["spec"]["leaderWorkerTemplate"]
        lws_label = {LWS_NAME_LABEL: obj["metadata"]["name"]}  # set on every pod by the LWS controller
        for part in ("leaderTemplate", "workerTemplate"):
            if part in template:
                pod = dict(template[part], metadata={**template[part].get("metadata", {})})
                pod["metadata"]["labels"] = {**pod["metadata"].get("labels", {}), **lws_label}
                yield f"{name} {part}", pod


def _environment(container: dict, config_maps: dict) -> dict:
    values: dict = {}
    for source in container.get("envFrom", []):
        values.update(config_maps.get(source.get("configMapRef", {}).get("name"), {}))
    values.update({env["name"]: env["value"] for env in container.get("env", []) if "value" in env})
    return values


def worker_pods(objects: list[dict]) -> list[WorkerPod]:
    config_maps = {obj["metadata"]["name"]: obj.get("data", {}) for obj in objects if obj.get("kind") == "ConfigMap"}
    pods = []
    for obj in objects:
        for where, template in _pod_templates(obj):
            for container in template["spec"].get("containers", []):
                args = container.get("args", [])
                if container.get("command") == ["pdserve"] and args and args[0] in WORKER_COMMANDS:
                    pods.append(WorkerPod(f"{where} {container['name']}", template["metadata"].get("labels", {}),
                                          container, _environment(container, config_maps)))
    return pods


def flag(pod: WorkerPod, name: str) -> Optional[str]:
    """The last value of --name in the container's args, $(VARIABLES) expanded."""
    args, value = pod.container.get("args", []), None
    for index, arg in enumerate(args):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and index + 1 < len(args):
            value = args[index + 1]
    if value is None:
        return None
    return VARIABLE.sub(lambda match: str(pod.environment.get(match.group(1), match.group(0))), value)


def _selects(selector: dict, labels: dict) -> bool:
    expressions = selector.get("matchExpressions", [])
    if any(e["operator"] != "Exists" for e in expressions):
        raise ValueError(f"selector {selector}: only matchLabels and Exists are checked here")
    return selector.get("matchLabels", {}).items() <= labels.items() and all(e["key"] in labels for e in expressions)


def _label_selected(peer: dict) -> bool:
    """A peer named by pod labels (in any namespace or this one), not an address block or everyone."""
    selector = peer.get("podSelector")
    return "ipBlock" not in peer and bool(selector) and bool(selector.get("matchLabels") or
                                                              selector.get("matchExpressions"))


def _port_range(entry: dict, named: dict) -> tuple[int, int]:
    port = entry.get("port")
    if port is None:
        return 1, 65535
    number = named.get(port, -1) if isinstance(port, str) else int(port)
    return number, int(entry.get("endPort", number))


def _rules_reaching(policies: list[dict], pod: WorkerPod, low: int, high: int) -> list[tuple[dict, bool]]:
    """(rule, whether it admits all of low..high) for every ingress rule of a policy selecting the pod
    that admits any port in low..high."""
    named = {p["name"]: p["containerPort"] for p in pod.container.get("ports", []) if "name" in p}
    found = []
    for policy in policies:
        spec = policy["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]) or not _selects(spec["podSelector"], pod.labels):
            continue
        for rule in spec.get("ingress", []):
            ranges = [_port_range(entry, named) for entry in rule.get("ports", [{}])]
            if any(start <= high and low <= end for start, end in ranges):
                found.append((rule, any(start <= low and high <= end for start, end in ranges)))
    return found


def _check_port(policies: list[dict], pod: WorkerPod, low: int, high: int, what: str) -> list[str]:
    rules = _rules_reaching(policies, pod, low, high)
    problems = [] if any(whole for _, whole in rules) else [f"{pod.where}: no NetworkPolicy rule admits {what}"]
    for rule, _ in rules:
        peers = rule.get("from", [])
        if not peers or not all(_label_selected(peer) for peer in peers):
            problems.append(f"{pod.where}: {what} is admitted from {peers or 'everyone'}, not from label-selected peers")
    return problems


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_worker(pod: WorkerPod, policies: list[dict]) -> list[str]:
    problems = []
    selected = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and _selects(p["spec"]["podSelector"], pod.labels)]
    if not selected:
        problems.append(f"{pod.where}: no NetworkPolicy selects this worker's pods")
    ports = {p.get("name"): p["containerPort"] for p in pod.container.get("ports", [])}
    if "http" in ports and not _is_loopback(flag(pod, "--host") or "127.0.0.1"):
        internal = int(flag(pod, "--internal-port") or int(flag(pod, "--port") or 0) + 1)
        if ports.get("internal") != internal:
            problems.append(f"{pod.where}: the internal listener (port {internal}) is not declared as the "
                            "containerPort named internal")
        problems += _check_port(policies, pod, internal, internal, f"the internal port {internal}")
    ucx = pod.environment.get("UCX_TCP_PORT_RANGE")
    if ucx is not None:
        low, _, high = str(ucx).partition("-")
        problems += _check_port(policies, pod, int(low), int(high or low), f"the UCX ports {ucx}")
    peers = flag(pod, "--kv-allowed-peers")
    for entry in (peers.split(",") if peers else []):
        try:
            network = ipaddress.ip_network(entry.strip().strip("[]"), strict=False)
        except ValueError:
            continue  # a host name: matches only itself
        if network.prefixlen < (MIN_IPV4_PREFIX if network.version == 4 else MIN_IPV6_PREFIX):
            problems.append(f"{pod.where}: --kv-allowed-peers {entry.strip()} spans the pod network, not the "
                            "prefill pods")
    return problems


def check(objects: list[dict]) -> list[str]:
    policies = [obj for obj in objects if obj.get("kind") == "NetworkPolicy"]
    pods = worker_pods(objects)
    if not pods:
        return ["no pdserve worker found"]
    return [problem for pod in pods for problem in check_worker(pod, policies)]


def main(argv: Optional[list[str]] = None) -> int:
    problems = []
    for path in argv if argv is not None else sys.argv[1:]:
        objects = [obj for obj in yaml.safe_load_all(Path(path).read_text()) if obj]
        problems += [f"{path}: {problem}" for problem in check(objects)]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
