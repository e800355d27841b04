"""The llm-d/GIE and LeaderWorkerSet shapes under deploy/, checked without a cluster.

deploy/validate.sh checks them against their schemas (the CRD kinds against the schemas vendored in
deploy/kubernetes/schemas/); these tests check what schemas cannot: that llm-d finds the roles it
filters by, that the InferencePool, the EPP, the sidecar and the workers agree on names and ports,
that the workers' args are valid pdserve configurations, that the EPP config only names plugins its
image registers, that LWS ranks join their leader with the tensor-parallel flags, and that the
deployed sidecar is the one tests/integration/test_llm_d.py replays.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from pdserve.api.flags import worker_config
from pdserve.app.cli import build_parser
from pdserve.gie_metrics import PROTOCOL_NAMES
from tests.deploy.test_artifacts import (
    DEPLOY, ROOT, _dashboard, _environment, _flag, _load_module, dashboard_exprs, kustomize_render)

validate_crds = _load_module("validate_crds")
check_policies = _load_module("check_policies")
LLM_D_RELEASE = "v0.8.0"  # llm-d-inference-scheduler: the EPP image and the routing sidecar image
ROLE_LABEL = "llm-d.ai/role"
LWS_LABEL = "leaderworkerset.sigs.k8s.io/name"
VAR_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _objects(directory: str) -> dict[tuple[str, str], dict]:
    return {kustomize_render.object_key(obj): obj for obj in kustomize_render.render(DEPLOY / directory)}


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _containers(pod_spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec.get("initContainers", []) + pod_spec["containers"]}


def _args(objects: dict, container: dict, **stand_ins: str) -> list[str]:
    """The container's args as the kubelet expands them (`stand_ins`: what a controller injects)."""
    environment = {**_environment(objects, container), **stand_ins}
    undefined = {name for arg in container["args"] for name in VAR_REFERENCE.findall(arg)} - environment.keys()
    assert not undefined, f"{container['name']}: args use undefined variables {sorted(undefined)}"
    return [VAR_REFERENCE.sub(lambda match: environment[match.group(1)], arg) for arg in container["args"]]


def _epp_config(objects: dict) -> dict:
    return yaml.safe_load(objects[("ConfigMap", "pdserve-epp-config")]["data"]["epp-config.yaml"])


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ---- llm-d / GIE --------------------------------------------------------------------------------

def test_llm_d_pods_carry_the_roles_the_epp_filters_by_and_the_pool_selects_only_workers():
    objects = _objects("llm-d")
    pool = objects[("InferencePool", "pdserve")]
    selector = pool["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        labels = objects[("Deployment", f"pdserve-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert labels[ROLE_LABEL] == role
        assert _matches(selector, labels), role
        assert labels["app.kubernetes.io/component"] == role, "the alerts and the dashboard group by it"
    epp_labels = objects[("Deployment", "pdserve-epp")]["spec"]["template"]["metadata"]["labels"]
    assert not _matches(selector, epp_labels), "the EPP is no model server"
    assert not [key for key in objects if key[0] == "Secret"]


def test_pool_port_is_the_prefill_worker_and_the_decode_pods_sidecar_in_front_of_its_worker():
    objects = _objects("llm-d")
    parser = build_parser()
    pool = objects[("InferencePool", "pdserve")]["spec"]
    (target,) = [port["number"] for port in pool["targetPorts"]]
    prefill = _containers(_pod_spec(objects[("Deployment", "pdserve-prefill")]))["prefill"]
    prefill_args = parser.parse_args(_args(objects, prefill))
    assert (prefill_args.command, prefill_args.host, prefill_args.port) == ("prefill", "0.0.0.0", target)
    assert prefill_args.advertise_host == "10.0.0.1", "the decode pods pull from the pod IP"
    # The internal routes (the handshake decode pods make) on a port of their own, never the pool's.
    assert {p["name"]: p["containerPort"] for p in prefill["ports"]} == {"http": target,
                                                                         "internal": prefill_args.internal_port}
    assert prefill_args.internal_port != target
    decode_pod = _pod_spec(objects[("Deployment", "pdserve-decode")])
    containers = _containers(decode_pod)
    sidecar, decode = containers["routing-sidecar"], containers["decode"]
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: up before the worker, down after its drain"
    decode_args = parser.parse_args(_args(objects, decode))
    sidecar_args = _args(objects, sidecar, POD_NAMESPACE="llm")
    assert _flag(sidecar_args, "--port") == str(target) and _flag(sidecar_args, "--vllm-port") == str(decode_args.port)
    assert decode_args.host == "127.0.0.1", "only the sidecar reaches the decode worker"
    assert decode_args.internal_port not in (None, target), "the sidecar never forwards to the internal routes"
    assert _flag(sidecar_args, "--kv-connector") == "nixlv2"
    assert _flag(sidecar_args, "--enable-ssrf-protection") == "true"
    assert _flag(sidecar_args, "--inference-pool") == f"llm/{objects[('InferencePool', 'pdserve')]['metadata']['name']}"
    assert [p["containerPort"] for p in sidecar["ports"]] == [target] and "ports" not in decode
    assert decode["readinessProbe"]["httpGet"]["port"] == target, "ready when sidecar and worker both are"
    assert decode_pod["serviceAccountName"] == "pdserve-decode"


def test_llm_d_workers_are_valid_configurations_without_a_token_that_the_sidecar_cannot_carry():
    objects = _objects("llm-d")
    parser = build_parser()
    for role in ("prefill", "decode"):
        container = _containers(_pod_spec(objects[("Deployment", f"pdserve-{role}")]))[role]
        assert "PDSERVE_INTERNAL_TOKEN" not in json.dumps(container)
        config = worker_config(parser.parse_args(_args(objects, container)), role)
        assert config.server.internal_token is None
    prefill = _containers(_pod_spec(objects[("Deployment", "pdserve-prefill")]))["prefill"]
    assert "--insecure-no-token" in prefill["args"]
    decode = _containers(_pod_spec(objects[("Deployment", "pdserve-decode")]))["decode"]
    config = worker_config(parser.parse_args(_args(objects, decode)), "decode")
    assert config.transfer.allowed_peers, "a decode pod pulls only from the prefill pods"
    # Who reaches the token-less prefill workers: decode pods, the EPP, Prometheus; nobody else.
    policy = objects[("NetworkPolicy", "pdserve-prefill")]["spec"]
    prefill_labels = objects[("Deployment", "pdserve-prefill")]["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["podSelector"]["matchLabels"], prefill_labels) and policy["policyTypes"] == ["Ingress"]
    sources = [peer.get("podSelector", {}).get("matchLabels", {}) for rule in policy["ingress"] for peer in rule["from"]]
    assert {label.get("app.kubernetes.io/component") for label in sources} == {"decode", "epp", None}
    assert {label.get("app.kubernetes.io/name") for label in sources if "app.kubernetes.io/component" not in label} \
        == {"prometheus"}
    # Its internal port (the KV handshake): decode pods alone.
    internal_sources = [peer["podSelector"]["matchLabels"] for rule in policy["ingress"]
                        if any(port["port"] == "internal" for port in rule.get("ports", [])) for peer in rule["from"]]
    assert [label["app.kubernetes.io/component"] for label in internal_sources] == ["decode"]


def test_llm_d_decode_pods_admit_ucx_from_prefill_pods_only_and_pull_only_from_the_prefill_pool():
    objects = _objects("llm-d")
    policy = objects[("NetworkPolicy", "pdserve-decode")]["spec"]
    decode_labels = objects[("Deployment", "pdserve-decode")]["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["podSelector"]["matchLabels"], decode_labels) and policy["policyTypes"] == ["Ingress"]
    low, high = map(int, objects[("ConfigMap", "pdserve-config")]["data"]["UCX_TCP_PORT_RANGE"].split("-"))
    [ucx_rule] = [rule for rule in policy["ingress"] if any(port.get("endPort") for port in rule["ports"])]
    assert [(port["port"], port["endPort"]) for port in ucx_rule["ports"]] == [(low, high)]
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in ucx_rule["from"]] \
        == ["prefill"]
    assert check_policies.check(list(objects.values())) == []


def test_policy_check_refuses_an_internal_port_open_to_all_an_undeclared_one_and_a_pod_network_allow_list():
    objects = _objects("llm-d")
    prefill_policy = objects[("NetworkPolicy", "pdserve-prefill")]
    prefill_policy["spec"]["ingress"].append({"ports": [{"port": 8001, "protocol": "TCP"}]})
    prefill = _containers(_pod_spec(objects[("Deployment", "pdserve-prefill")]))["prefill"]
    prefill["ports"] = [port for port in prefill["ports"] if port["name"] != "internal"]
    objects[("ConfigMap", "pdserve-config")]["data"]["PDSERVE_KV_ALLOWED_PEERS"] = "10.0.0.0/8"
    del objects[("NetworkPolicy", "pdserve-decode")]
    problems = "\n".join(check_policies.check(list(objects.values())))
    assert "not declared as the containerPort named internal" in problems
    assert "is admitted from everyone" in problems
    assert "no NetworkPolicy selects this worker's pods" in problems
    assert "10.0.0.0/8 spans the pod network" in problems


def test_epp_serves_the_pool_and_runs_p_d_with_a_prefix_aware_scorer():
    objects = _objects("llm-d")
    pool = objects[("InferencePool", "pdserve")]
    picker = pool["spec"]["endpointPickerRef"]
    service = objects[("Service", picker["name"])]
    assert picker["port"]["number"] in [port["port"] for port in service["spec"]["ports"]]
    epp = objects[("Deployment", "pdserve-epp")]
    assert _matches(service["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    args = _args(objects, _containers(_pod_spec(epp))["epp"], POD_NAMESPACE="llm")
    assert _flag(args, "--pool-name") == pool["metadata"]["name"]
    assert _flag(args, "--config-file") == "/etc/epp/epp-config.yaml"
    config = _epp_config(objects)
    assert validate_crds.check_object(config) == []
    names = {plugin.get("name", plugin["type"]): plugin for plugin in config["plugins"]}
    types = {plugin["type"] for plugin in config["plugins"]}
    assert {"prefix-cache-scorer", "disagg-profile-handler", "disagg-headers-handler", "prefill-filter",
            "decode-filter", "queue-scorer", "kv-cache-utilization-scorer"} <= types
    profiles = {profile["name"]: [ref["pluginRef"] for ref in profile["plugins"]]
                for profile in config["schedulingProfiles"]}
    assert all(ref in names for refs in profiles.values() for ref in refs), "every pluginRef names a plugin"
    handler = names["disagg-profile-handler"]["parameters"]
    assert set(handler["profiles"].values()) == set(profiles) == {"prefill", "decode"}
    assert handler["deciders"]["prefill"] in names
    assert "prefill-filter" in profiles["prefill"] and "decode-filter" in profiles["decode"]
    assert all("prefix-cache-scorer" in refs for refs in profiles.values())


def test_deployed_llm_d_images_are_the_release_the_conformance_test_replays():
    objects = _objects("llm-d")
    images = {c["image"] for obj in objects.values() if obj["kind"] == "Deployment"
              for c in _containers(_pod_spec(obj)).values() if c["image"].startswith("ghcr.io/llm-d/")}
    assert images == {f"ghcr.io/llm-d/llm-d-routing-sidecar:{LLM_D_RELEASE}",
                      f"ghcr.io/llm-d/llm-d-inference-scheduler:{LLM_D_RELEASE}"}
    replay = (ROOT / "tests" / "integration" / "pd_sidecar.py").read_text()
    assert f"llm-d-inference-scheduler {LLM_D_RELEASE}" in replay
    assert LLM_D_RELEASE in json.loads((DEPLOY / "kubernetes" / "schemas" / "endpointpickerconfig.json")
                                       .read_text())["$comment"]


# ---- the vendored schemas and the validator -----------------------------------------------------

@pytest.mark.parametrize("kind, release", [("InferencePool", "v1.5.0"), ("LeaderWorkerSet", "v0.10.0")])
def test_vendored_crd_schemas_name_their_release(kind, release):
    vendored = json.loads((DEPLOY / "kubernetes" / "schemas" / f"{kind.lower()}.crd.json").read_text())
    assert vendored["kind"] == kind and vendored["source"]["release"] == release
    assert re.fullmatch(r"[0-9a-f]{40}", vendored["source"]["commit"])


def test_validator_refuses_unknown_fields_unregistered_plugins_and_missing_kinds(tmp_path):
    objects = _objects("llm-d")
    pool = json.loads(json.dumps(objects[("InferencePool", "pdserve")]))
    assert validate_crds.check_object(pool) == []
    pool["spec"]["targetPort"] = 8000
    assert any("targetPort" in problem for problem in validate_crds.check_object(pool))
    pool["spec"].pop("targetPort")
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    assert validate_crds.check_object(pool)
    config = _epp_config(objects)
    config["plugins"].append({"type": "pdserve-scorer"})
    assert any("pdserve-scorer" in problem for problem in validate_crds.check_object(config))
    lws = json.loads(json.dumps(_objects("lws")[("LeaderWorkerSet", "pdserve-decode")]))
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    assert any("sizes" in problem for problem in validate_crds.check_object(lws))
    rendered = tmp_path / "lws.yaml"
    rendered.write_text(yaml.safe_dump_all(kustomize_render.render(DEPLOY / "lws")))
    core = tmp_path / "core.yaml"
    assert validate_crds.main([str(rendered), "--core-out", str(core), "--require-kind", "LeaderWorkerSet"]) == 0
    assert validate_crds.main([str(rendered), "--core-out", str(core), "--require-kind", "InferencePool"]) == 1


def test_validator_hands_every_lws_pod_template_to_kubernetes_validate():
    lws = [obj for obj in kustomize_render.render(DEPLOY / "lws") if obj["kind"] == "LeaderWorkerSet"]
    problems, core, num_checked = validate_crds.sort_objects(lws, split_core=True)
    assert problems == [] and num_checked == 2
    assert sorted(template["metadata"]["name"] for template in core) == [
        "pdserve-decode-leadertemplate", "pdserve-decode-workertemplate",
        "pdserve-prefill-leadertemplate", "pdserve-prefill-workertemplate"]
    assert all(t["kind"] == "PodTemplate" and t["template"]["spec"]["containers"] for t in core)


def test_renderer_deletes_an_object_for_a_delete_patch(tmp_path):
    (tmp_path / "base.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\n"
                                        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    (tmp_path / "delete.yaml").write_text("$patch: delete\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [base.yaml]\npatches:\n  - path: delete.yaml\n")
    assert [obj["metadata"]["name"] for obj in kustomize_render.render(tmp_path)] == ["b"]


# ---- LeaderWorkerSet ----------------------------------------------------------------------------

def _lws_stand_ins(lws: dict, worker_index: int) -> dict[str, str]:
    """What the LWS webhook puts in every container (kubernetes-sigs/lws, pkg/utils/pod)."""
    name = lws["metadata"]["name"]
    return {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.llm", "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]),
            "LWS_WORKER_INDEX": str(worker_index)}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_lws_group_is_one_tensor_parallel_worker_whose_ranks_join_the_leader(role):
    objects = _objects("lws")
    assert ("Deployment", f"pdserve-{role}") not in objects, "the LeaderWorkerSet replaces it"
    lws = objects[("LeaderWorkerSet", f"pdserve-{role}")]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    assert size >= 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == worker["args"], "every rank starts with the same flags"
    parser = build_parser()
    for index, container in ((0, leader), *((i, worker) for i in range(1, size))):
        config = worker_config(parser.parse_args(_args(objects, container, **_lws_stand_ins(lws, index))), role)
        parallel = config.parallel
        assert (parallel.tensor_parallel_size, parallel.tp_rank) == (size, index)
        assert parallel.tp_master_addr == f"pdserve-{role}-0.pdserve-{role}.llm"
        assert parallel.is_leader == (index == 0)
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1, "one rank, one GPU, one pod"
    rendezvous = {p["name"]: p["containerPort"] for p in leader["ports"]}["tp-rendezvous"]
    assert parallel.tp_master_port == rendezvous
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready" and "ports" not in worker
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & worker.keys(), "ranks > 0 serve no HTTP"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_lws_leaders_alone_are_what_services_budgets_and_the_proxy_see(role):
    objects = _objects("lws")
    template = objects[("LeaderWorkerSet", f"pdserve-{role}")]["spec"]["leaderWorkerTemplate"]
    leader_labels = template["leaderTemplate"]["metadata"]["labels"]
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    for selector in (objects[("Service", f"pdserve-{role}")]["spec"]["selector"],
                     objects[("PodDisruptionBudget", f"pdserve-{role}")]["spec"]["selector"]["matchLabels"]):
        assert _matches(selector, leader_labels) and not _matches(selector, worker_labels)
    monitor = yaml.safe_load((DEPLOY / "kubernetes" / "monitoring" / "podmonitor.yaml").read_text())
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    assert port in [p["name"] for p in template["leaderTemplate"]["spec"]["containers"][0]["ports"]]
    policy = objects[("NetworkPolicy", "pdserve-workers")]["spec"]
    (expression,) = policy["podSelector"]["matchExpressions"]
    assert expression == {"key": LWS_LABEL, "operator": "Exists"}, "the policy covers every rank's pod"
    # Every worker's internal port and UCX ports: declared, and admitted from label-selected peers only.
    assert check_policies.check(list(objects.values())) == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_lws_ranks_outlive_the_leaders_drain(role):
    """A rank serves on after SIGTERM until the leader has drained and stops it (tested with real
    processes in tests/integration/test_tensor_parallel.py): no preStop of its own, and a grace
    period the leader's pause and drain fit in, so the kubelet never kills it mid-drain."""
    objects = _objects("lws")
    template = objects[("LeaderWorkerSet", f"pdserve-{role}")]["spec"]["leaderWorkerTemplate"]
    leader_pod, worker_pod = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    leader, worker = leader_pod["containers"][0], worker_pod["containers"][0]
    args = _args(objects, leader, **_lws_stand_ins(objects[("LeaderWorkerSet", f"pdserve-{role}")], 0))
    pause_s = float(leader["lifecycle"]["preStop"]["exec"]["command"][1])
    drain_s = float(_flag(args, "--drain-timeout-s"))
    assert pause_s + drain_s + 5 <= leader_pod["terminationGracePeriodSeconds"]
    assert "lifecycle" not in worker
    assert pause_s + drain_s + 5 <= worker_pod["terminationGracePeriodSeconds"]

# ---- the dashboard ------------------------------------------------------------------------------

def test_dashboard_shows_the_gie_gauges_and_only_names_workers_export():
    queries = " ".join(expr for _, expr in dashboard_exprs.dashboard_queries(_dashboard()))
    used = set(re.findall(r"\bvllm:[a-z_]+", queries))
    assert used and used <= set(PROTOCOL_NAMES)
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= used


def test_operations_guide_explains_running_under_llm_d():
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("## Running under llm-d / GIE", 1)[1].split("\n## ", 1)[0]
    for must in ("prefix-cache-scorer", "disagg-profile-handler", "prefix-based-pd-decider", "queue-scorer",
                 "kv-cache-utilization-scorer", *PROTOCOL_NAMES, "x-prefiller-host-port", "pdserve proxy",
                 "003-model-server-protocol", "llm-d.ai/role", "LeaderWorkerSet"):
        assert must in section, must
