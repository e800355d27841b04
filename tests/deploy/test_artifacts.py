"""Structure of the deployment artifacts under deploy/, checked without kubectl or promtool.

deploy/validate.sh (run in CI before pytest) does the schema, promtool and lint
checks; these tests check what schemas cannot: that the manifests fit pdserve
(probes, drain budgets, flags the CLI accepts, headless discovery) and that the
dashboard and the alerts only use metrics pdserve's workers and proxy export.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.app.cli import build_parser
from pdserve.metrics import Metrics
from proxy.metrics import create_proxy_metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "gpu", "gpu-rdma"]
WORKER_ROLES = {"prefill": 8100, "decode": 8200}
VAR_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
METRIC_NAME = re.compile(r"\b(pdserve_[a-z0-9_]+)")


def _load_module(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("/", "."), DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kustomize_render = _load_module("kustomize_render")
dashboard_exprs = _load_module("dashboard_exprs")


def _objects(overlay: str) -> dict[tuple[str, str], dict]:
    rendered = kustomize_render.render(DEPLOY / "kubernetes" / "overlays" / overlay)
    return {kustomize_render.object_key(obj): obj for obj in rendered}


def _deployments(objects: dict) -> dict[str, dict]:
    return {name: obj for (kind, name), obj in objects.items() if kind == "Deployment"}


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pdserve pod"
    return containers[0]


def _environment(objects: dict, container: dict) -> dict[str, str]:
    """What $(NAME) expands to in the container's args; values from fieldRef or
    secretKeyRef are stand-ins, as only the kubelet knows them. The Secret is
    the operator's to create, in the shape of secret.example.yaml."""
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = objects[("ConfigMap", source["configMapRef"]["name"])]
        environment.update(config_map["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = variable["value"]
        elif "fieldRef" in variable["valueFrom"]:
            environment[variable["name"]] = "10.0.0.1" if "IP" in variable["name"] else "pod-0"
        else:
            ref = variable["valueFrom"]["secretKeyRef"]
            secret = yaml.safe_load((DEPLOY / "kubernetes" / "secret.example.yaml").read_text())
            assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], next(iter(secret["stringData"])))
            environment[variable["name"]] = "token"
    return environment


def _expanded_args(objects: dict, container: dict) -> list[str]:
    environment = _environment(objects, container)
    undefined = {name for arg in container["args"] for name in VAR_REFERENCE.findall(arg)} - environment.keys()
    assert not undefined, f"{container['name']}: args use undefined variables {sorted(undefined)}"
    return [VAR_REFERENCE.sub(lambda match: environment[match.group(1)], arg) for arg in container["args"]]


def _flag(args: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times"
    return values[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_probes_live_and_ready_and_declares_resources(overlay):
    deployments = _deployments(_objects(overlay))
    assert set(deployments) == {"pdserve-prefill", "pdserve-decode", "pdserve-proxy"}
    for name, deployment in deployments.items():
        container = _container(deployment)
        assert container["livenessProbe"]["httpGet"]["path"] == "/live", name
        assert container["startupProbe"]["httpGet"]["path"] == "/live", name
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready", name
        resources = container["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), name
        assert "memory" in resources["limits"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_the_pre_stop_pause_and_the_drain(overlay):
    objects = _objects(overlay)
    for role in WORKER_ROLES:
        deployment = _deployments(objects)[f"pdserve-{role}"]
        pod_spec = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        args = _expanded_args(objects, container)
        grace_s = pod_spec["terminationGracePeriodSeconds"]
        pause_s = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
        drain_s = float(_flag(args, "--drain-timeout-s"))
        assert grace_s >= 60
        assert pause_s + drain_s + 5 <= grace_s, f"{role}: the kubelet would kill the drain"
        if role == "prefill":
            assert drain_s >= float(_flag(args, "--kv-lease-s")), "prefill must outlive one lease while draining"
    assert _deployments(objects)["pdserve-proxy"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_args_parse_with_the_pdserve_cli(overlay):
    objects = _objects(overlay)
    parser = build_parser()
    for role, port in WORKER_ROLES.items():
        container = _container(_deployments(objects)[f"pdserve-{role}"])
        assert container["command"] == ["pdserve"]
        args = parser.parse_args(_expanded_args(objects, container))
        assert args.command == role
        assert args.port == port and args.host == "0.0.0.0"
        assert args.advertise_host == "10.0.0.1", "peers must reach the pod IP"
        assert args.internal_token == "token"
        assert args.internal_port == port + 1
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port, "internal": port + 1}


def _subcommands(parser) -> set[str]:
    return {name for action in parser._subparsers._group_actions for name in action.choices}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_args_parse_with_the_pdserve_cli(overlay):
    parser = build_parser()
    if "proxy" not in _subcommands(parser):
        pytest.skip("`pdserve proxy` is not in the CLI yet")
    objects = _objects(overlay)
    container = _container(_deployments(objects)["pdserve-proxy"])
    args = parser.parse_args(_expanded_args(objects, container))
    assert args.command == "proxy"
    assert [p["containerPort"] for p in container["ports"]] == [8000]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_discovers_workers_through_headless_services(overlay):
    objects = _objects(overlay)
    proxy_args = _expanded_args(objects, _container(_deployments(objects)["pdserve-proxy"]))
    for role, port in WORKER_ROLES.items():
        service = objects[("Service", f"pdserve-{role}")]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"].get("publishNotReadyAddresses", False) is False, "draining pods must leave DNS"
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
        assert _flag(proxy_args, f"--{role}-dns") == f"pdserve-{role}:{port}"
        template_labels = _deployments(objects)[f"pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= template_labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_ship_no_secret_so_no_known_token_reaches_a_cluster(overlay):
    assert not [key for key in _objects(overlay) if key[0] == "Secret"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_has_a_disruption_budget_matching_its_pods(overlay):
    objects = _objects(overlay)
    for name, deployment in _deployments(objects).items():
        budget = objects[("PodDisruptionBudget", name)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert budget["spec"]["maxUnavailable"] == 1


def test_gpu_overlay_requests_one_gpu_per_worker_and_cpu_overlay_none():
    for overlay, num_gpus in (("gpu", 1), ("gpu-rdma", 1), ("cpu", 0)):
        objects = _objects(overlay)
        for role in WORKER_ROLES:
            limits = _container(_deployments(objects)[f"pdserve-{role}"])["resources"]["limits"]
            assert int(limits.get("nvidia.com/gpu", 0)) == num_gpus
        assert objects[("ConfigMap", "pdserve-config")]["data"]["PDSERVE_DEVICE"] == ("cuda" if num_gpus else "cpu")


def _ucx_transports(overlay: str) -> list[str]:
    return _objects(overlay)[("ConfigMap", "pdserve-config")]["data"]["UCX_TLS"].split(",")


# UCX transports that need a shared IPC or PID namespace, or that read host memory
# only: none can move a GPU pool's pages between two pods.
_SAME_NAMESPACE_TRANSPORTS = {"cuda_ipc", "cuda", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "all"}


@pytest.mark.parametrize("overlay, network", [("gpu", "tcp"), ("gpu-rdma", "rc")])
def test_gpu_overlays_give_ucx_a_network_transport_and_cuda_copy_never_plain_tcp(overlay, network):
    transports = _ucx_transports(overlay)
    assert transports != ["tcp"], "plain tcp cannot read GPU memory"
    assert network in transports and "cuda_copy" in transports
    assert not _SAME_NAMESPACE_TRANSPORTS & set(transports), "pods share no IPC or PID namespace"


def test_cpu_overlay_moves_host_memory_over_tcp_only():
    assert _ucx_transports("cpu") == ["tcp"]


def test_rdma_overlay_gives_workers_an_rdma_device_and_ipc_lock_only():
    objects = _objects("gpu-rdma")
    for role in WORKER_ROLES:
        container = _container(_deployments(objects)[f"pdserve-{role}"])
        rdma = {key for key in container["resources"]["limits"] if key.startswith("rdma/")}
        assert len(rdma) == 1
        resource = rdma.pop()
        assert container["resources"]["requests"][resource] == container["resources"]["limits"][resource] == 1
        security = container["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        # A capability added to a non-root container never reaches its process.
        assert security["runAsUser"] == 0 and security["runAsNonRoot"] is False
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    proxy = _container(_deployments(objects)["pdserve-proxy"])
    assert "runAsUser" not in proxy.get("securityContext", {}), "only the workers need RDMA"


def test_gpu_overlays_size_the_pool_from_gpu_memory_with_a_share_below_one():
    for overlay in ("gpu", "gpu-rdma"):
        objects = _objects(overlay)
        for role in WORKER_ROLES:
            args = build_parser().parse_args(_expanded_args(objects, _container(_deployments(objects)[f"pdserve-{role}"])))
            assert args.kv_memory is None and 0 < args.gpu_memory_utilization < 1


def test_pod_monitor_scrapes_the_named_port_of_every_pdserve_pod():
    monitoring = {kustomize_render.object_key(obj): obj
                  for obj in kustomize_render.render(DEPLOY / "kubernetes" / "monitoring")}
    endpoints = monitoring[("PodMonitor", "pdserve")]["spec"]["podMetricsEndpoints"]
    selector = monitoring[("PodMonitor", "pdserve")]["spec"]["selector"]["matchLabels"]
    for deployment in _deployments(_objects("cpu")).values():
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert [p["name"] for p in _container(deployment)["ports"]][0] == endpoints[0]["port"] == "http"
    assert endpoints[0]["path"] == "/metrics"
    assert {r["targetLabel"] for r in endpoints[0]["relabelings"]} == {"component"}


def _exported_series_names() -> set[str]:
    """Names of every series pdserve's workers and proxy expose (counters with
    `_total`, histograms with their `_bucket`, `_count` and `_sum` series)."""
    names: set[str] = set()
    registries = (Metrics().registry, create_proxy_metrics(lambda: []).registry)
    for family in (family for registry in registries for family in registry.collect()):
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    return names


def _alert_rules() -> list[dict]:
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in alerts["groups"] for rule in group["rules"]]


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())


def test_dashboard_and_alerts_use_only_metrics_pdserve_exports():
    exported = _exported_series_names()
    exprs = [rule["expr"] for rule in _alert_rules()] + [expr for _, expr in dashboard_exprs.dashboard_queries(_dashboard())]
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    unknown = used - exported
    assert not unknown, f"exported neither by pdserve.metrics nor by proxy.metrics: {sorted(unknown)}"
    assert len(used & exported) >= 30, "the dashboard should cover most metrics"


def test_dashboard_covers_the_panels_operators_need():
    dashboard = _dashboard()
    panels = list(dashboard_exprs.iter_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    queries = " ".join(expr for _, expr in dashboard_exprs.dashboard_queries(dashboard))
    for metric in ("pdserve_request_finished_total", "pdserve_request_time_to_first_token_seconds_bucket",
                   "pdserve_request_inter_token_latency_seconds_bucket", "pdserve_transfer_bytes_total",
                   "pdserve_transfer_descriptors_total", "pdserve_kv_usage_ratio",
                   "pdserve_proxy_ttft_prefill_seconds_bucket", "pdserve_proxy_ttft_decode_first_token_seconds_bucket"):
        assert metric in queries, metric
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace"}


def test_every_alert_is_unit_tested_labelled_and_documented():
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]}
    operations_doc = (ROOT / "docs" / "operations.md").read_text()
    for rule in _alert_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description"} <= rule["annotations"].keys(), name
        assert name in tested, f"{name} has no case in alerts_test.yml"
        assert name in operations_doc, f"{name} is not explained in docs/operations.md"


def test_prometheus_rule_object_carries_exactly_the_alert_rules():
    rule_object = yaml.safe_load((DEPLOY / "kubernetes" / "monitoring" / "prometheusrule.yaml").read_text())
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rule_object["kind"] == "PrometheusRule"
    assert rule_object["spec"]["groups"] == alerts["groups"]


def test_renderer_merges_containers_by_name_replaces_args_and_deletes_nulls():
    base = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": {
        "containers": [{"name": "a", "args": ["x", "y"], "env": [{"name": "E", "value": "1"}],
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                       {"name": "b", "image": "b:1"}],
        "nodeSelector": {"k": "v"}}}}}
    patch = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": {
        "containers": [{"name": "a", "args": ["z"], "env": [{"name": "F", "value": "2"}],
                        "resources": {"requests": {"cpu": "4"}}}],
        "nodeSelector": None}}}}
    merged = kustomize_render.merge_patch(base, patch)
    spec = merged["spec"]["template"]["spec"]
    assert spec["containers"][0] == {"name": "a", "args": ["z"],
                                     "env": [{"name": "E", "value": "1"}, {"name": "F", "value": "2"}],
                                     "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}}
    assert spec["containers"][1] == {"name": "b", "image": "b:1"}
    assert "nodeSelector" not in spec
    assert base["spec"]["template"]["spec"]["containers"][0]["args"] == ["x", "y"], "base left untouched"


def test_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize_render.RenderError, match="namePrefix"):
        kustomize_render.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n  - patch: '{}'\n    target: {kind: Deployment}\n")
    with pytest.raises(kustomize_render.RenderError, match="path"):
        kustomize_render.render(tmp_path)


def test_overlays_set_the_image_tag_of_each_role():
    for overlay, worker_tag in (("cpu", "cpu"), ("gpu", "cuda"), ("gpu-rdma", "cuda")):
        deployments = _deployments(_objects(overlay))
        assert _container(deployments["pdserve-prefill"])["image"] == f"pdserve-worker:{worker_tag}"
        assert _container(deployments["pdserve-decode"])["image"] == f"pdserve-worker:{worker_tag}"
        assert _container(deployments["pdserve-proxy"])["image"].startswith("pdserve-proxy:")


# ---- the worker image's torch and nixl builds ------------------------------------------------

check_build = _load_module("docker/check_build")


def test_worker_image_pins_the_cuda_wheel_index_and_checks_the_build():
    dockerfile = (DEPLOY / "docker" / "Dockerfile.worker").read_text()
    for variant in ("CPU", "CUDA"):
        assert re.search(rf"^ARG TORCH_{variant}_INDEX_URL=https://\S+$", dockerfile, re.MULTILINE), variant
        assert f'--index-url "${{TORCH_{variant}_INDEX_URL}}" "torch==${{TORCH_VERSION}}"' in dockerfile, variant
    assert 'python check_build.py --variant "${TORCH_VARIANT}"' in dockerfile
    assert "COPY deploy/docker/check_build.py" in dockerfile
    assert "!deploy/docker/check_build.py" in (DEPLOY / "docker" / "Dockerfile.worker.dockerignore").read_text()


def test_build_check_accepts_this_cpu_environment_and_refuses_it_as_a_cuda_image():
    import subprocess
    import sys

    script = str(DEPLOY / "docker" / "check_build.py")
    as_cpu = subprocess.run([sys.executable, script, "--variant", "cpu"], capture_output=True, text=True, timeout=120)
    assert as_cpu.returncode == 0, as_cpu.stderr
    assert "torch.version.cuda = None" in as_cpu.stdout and "nixl build selected: nixl_cu" in as_cpu.stdout
    as_cuda = subprocess.run([sys.executable, script, "--variant", "cuda"], capture_output=True, text=True, timeout=120)
    assert as_cuda.returncode == 1 and "has no CUDA" in as_cuda.stderr


def test_build_check_refuses_a_nixl_build_for_another_cuda_major_or_without_cuda_transports():
    report = {"torch": "2.13.0+cu130", "torch_cuda": "13.0", "nixl_build": "nixl_cu13",
              "ucx_plugins": {"libuct_cuda": True, "libuct_ib": True}}
    assert check_build.problems(report, "cuda") == []
    assert check_build.problems(report, "cpu") == ["TORCH_VARIANT=cpu but torch 2.13.0+cu130 is built for CUDA 13.0"]
    mismatched = {**report, "torch_cuda": "12.8"}
    assert check_build.problems(mismatched, "cuda") == ["torch is built for CUDA 12.8 but nixl selected nixl_cu13"]
    no_cuda_ucx = {**report, "ucx_plugins": {"libuct_cuda": False, "libuct_ib": True}}
    assert "no UCX CUDA transports" in check_build.problems(no_cuda_ucx, "cuda")[0]
