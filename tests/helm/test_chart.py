"""The Helm chart under deploy/helm/kvgate, rendered by a real helm binary and checked value by value.

helm comes from ``deploy/helm/install-helm.sh`` (official binaries, cached under ~/.cache/kvgate/helm, or
``$KVGATE_HELM_DIR``); every test skips with that reason when it is absent. The rendered ConfigMap is decoded by the
gateway's own config loader, so the chart cannot drift from ``router/config.py``.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.config import CacheAwareConfig, SessionStickyConfig
from router.config import parse_config, validate_sessions
from router.discovery import decode_discovery_config, pod_to_worker
from router.serve import warn_byte_level_tokenizers
from router.sessions.config import resolve_redis_target

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvgate"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
HELM_DIR = Path(os.environ.get("KVGATE_HELM_DIR", Path.home() / ".cache" / "kvgate" / "helm"))
HELMS = {"helm4": HELM_DIR / "helm", "helm3": HELM_DIR / "helm3"}
KUBE_VERSION = "1.30.0"
NAMESPACE = "llm"
RELEASE = "r"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"


def _helm(name: str = "helm4") -> Path:
    path = HELMS[name]
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} not installed (run deploy/helm/install-helm.sh)")
    return path


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "HELM_CACHE_HOME": str(tmp / "cache"), "HELM_CONFIG_HOME": str(tmp / "config"),
            "HELM_DATA_HOME": str(tmp / "data")}


def run_helm(args: list[str], tmp: Path, helm: str = "helm4") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(_helm(helm)), *args], capture_output=True, text=True, env=_env(tmp), timeout=60,
                          check=False)


def render(tmp: Path, *values: str, sets: tuple[str, ...] = (), api_versions: tuple[str, ...] = (),
           helm: str = "helm4") -> dict[tuple[str, str], dict[str, Any]]:
    """``helm template`` -> ``{(kind, name): manifest}`` (fails the test on a render error)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(CHART / "examples" / v)]
    for s in sets:
        args += ["--set", s]
    for api in api_versions:
        args += ["--api-versions", api]
    result = run_helm(args, tmp, helm)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def gateway_yaml(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(objs[("ConfigMap", f"{RELEASE}-kvgate")]["data"]["gateway.yaml"])


def container(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    [c] = objs[("Deployment", f"{RELEASE}-kvgate")]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom", e.get("value")) for e in container(objs)["env"]}


@pytest.mark.parametrize("helm", ["helm4", "helm3"])
@pytest.mark.parametrize("values", [None, *[p.name for p in EXAMPLES]])
def test_lint_strict(tmp_path, helm, values):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values:
        args += ["-f", str(CHART / "examples" / values)]
    result = run_helm(args, tmp_path, helm)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout


def test_default_render_objects_and_gateway_config(tmp_path, monkeypatch):
    objs = render(tmp_path)
    assert sorted(objs) == sorted([
        ("ServiceAccount", "r-kvgate"), ("Secret", "r-kvgate-admin"), ("ConfigMap", "r-kvgate"),
        ("Role", "r-kvgate-discovery"), ("RoleBinding", "r-kvgate-discovery"), ("Service", "r-kvgate"),
        ("Deployment", "r-kvgate"), ("Pod", "r-kvgate-test"),
    ])
    raw = gateway_yaml(objs)
    assert raw["listen"] == {"host": "0.0.0.0", "port": 8080}
    assert raw["sessions"] == {"store": "memory", "idle_timeout_s": 1800}
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(raw)  # the gateway's own loader accepts what the chart renders
    assert [m.name for m in config.models] == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert raw["policy"] == {"name": "session_sticky", "inner": {"name": "cache_aware"}}
    assert config.policy == SessionStickyConfig(inner=CacheAwareConfig())
    discovery = decode_discovery_config(config.discovery)
    assert (discovery.namespace, discovery.label_selector, discovery.port, discovery.events_port,
            discovery.replay_port, discovery.model_label) == (NAMESPACE, "app=vllm", 8000, 5557, None,
                                                              "kvgate.io/model")


def test_default_model_is_byte_level_and_the_gateway_warns(tmp_path, monkeypatch, caplog):
    raw = gateway_yaml(render(tmp_path))
    assert raw["models"] == [{"name": "meta-llama/Llama-3.1-8B-Instruct", "block_size": 16}]
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    warn_byte_level_tokenizers(parse_config(raw))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING,
         "model meta-llama/Llama-3.1-8B-Instruct has no tokenizer_path: prompts are tokenized byte-level, which "
         "matches only the bundled sim worker (kvgate worker); for a real engine (vLLM, SGLang) set "
         "models[].tokenizer_path (and chat_template if the engine uses a custom one) and block_size to the "
         "engine's, or cached-token predictions will not match"),
    ]


def test_tokenizer_overlay_mounts_the_files_the_gateway_reads(tmp_path):
    objs = render(tmp_path, "tokenizer.yaml")
    assert gateway_yaml(objs)["models"] == [{
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "tokenizer_path": "/models/llama-3.1-8b-instruct/tokenizer.json",
        "chat_template": "/models/llama-3.1-8b-instruct/tool_chat_template_llama3.1_json.jinja",
        "block_size": 16,
    }]
    mounts = {m["name"]: m for m in container(objs)["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models/llama-3.1-8b-instruct", "readOnly": True}
    volumes = {v["name"]: v for v in objs[("Deployment", f"{RELEASE}-kvgate")]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"] == {
        "name": "models", "persistentVolumeClaim": {"claimName": "llama-3.1-8b-instruct", "readOnly": True}
    }


def test_deployment_probes_token_and_scrape_annotations(tmp_path):
    objs = render(tmp_path)
    deployment = objs[("Deployment", "r-kvgate")]
    pod = deployment["spec"]["template"]
    c = container(objs)
    assert deployment["spec"]["replicas"] == 1
    assert c["args"] == ["serve", "--config", "/etc/kvgate/gateway.yaml", "--log-level", "INFO"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    env = env_of(objs)
    assert env["KVGATE_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "r-kvgate-admin", "key": "token"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert pod["spec"]["serviceAccountName"] == "r-kvgate"
    annotations = pod["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
            annotations["prometheus.io/path"]) == ("true", "8080", "/metrics")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert objs[("Service", "r-kvgate")]["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]


def test_config_checksum_follows_the_gateway_config(tmp_path):
    def checksum(*sets: str) -> str:
        objs = render(tmp_path, sets=sets)
        return objs[("Deployment", "r-kvgate")]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum() == checksum()
    assert checksum() != checksum("discovery.port=9000")


def test_discovery_rbac_is_read_only_pods_in_the_watched_namespace(tmp_path):
    objs = render(tmp_path, "ha-redis.yaml")
    role = objs[("Role", "r-kvgate-discovery")]
    binding = objs[("RoleBinding", "r-kvgate-discovery")]
    assert role["metadata"]["namespace"] == "inference"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "r-kvgate-discovery"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r-kvgate", "namespace": NAMESPACE}]
    discovery = decode_discovery_config(gateway_yaml(objs)["discovery"])
    assert (discovery.namespace, discovery.label_selector, discovery.replay_port, discovery.worker) == (
        "inference", "app.kubernetes.io/name=vllm,kvgate.io/pool=main", 5558, {"pools": ["MOONCAKE"]})


def test_static_workers_without_discovery(tmp_path, monkeypatch):
    objs = render(tmp_path, "static.yaml")
    assert ("Role", "r-kvgate-discovery") not in objs
    assert ("Secret", "r-kvgate-admin") not in objs  # existingSecret
    assert objs[("Deployment", "r-kvgate")]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert env_of(objs)["KVGATE_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "kvgate-admin", "key": "token"}}
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(gateway_yaml(objs))
    assert config.discovery is None
    assert [(w.id, w.url, w.events_endpoint) for w in config.workers] == [
        ("vllm-0", "http://vllm-0.vllm.llm.svc:8000", "tcp://vllm-0.vllm.llm.svc:5557"),
        ("vllm-1", "http://vllm-1.vllm.llm.svc:8000", "tcp://vllm-1.vllm.llm.svc:5557"),
    ]


def test_ha_replicas_share_sessions_through_external_redis_secret(tmp_path, monkeypatch):
    objs = render(tmp_path, "ha-redis.yaml")
    assert objs[("Deployment", "r-kvgate")]["spec"]["replicas"] == 3
    pdb = objs[("PodDisruptionBudget", "r-kvgate")]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        "app.kubernetes.io/name": "kvgate", "app.kubernetes.io/instance": "r",
        "app.kubernetes.io/component": "gateway"}}}
    assert ("Deployment", "r-kvgate-redis") not in objs
    sessions = gateway_yaml(objs)["sessions"]
    assert sessions == {"store": "redis", "idle_timeout_s": 1800, "key_prefix": "kvgate:",
                        "url_env": "KVGATE_REDIS_URL"}
    assert env_of(objs)["KVGATE_REDIS_URL"] == {"secretKeyRef": {"name": "kvgate-redis", "key": "url"}}
    target = resolve_redis_target(validate_sessions(sessions),
                                  {"KVGATE_REDIS_URL": "rediss://:pw@redis.example:6380/0"})
    assert target.endpoint == "rediss://redis.example:6380/0"


def test_dev_redis_in_chart(tmp_path, monkeypatch):
    objs = render(tmp_path, "dev-redis.yaml")
    redis = objs[("Deployment", "r-kvgate-redis")]
    [c] = redis["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "redis:7.4-alpine"
    assert c["args"][:4] == ["--save", "", "--appendonly", "no"]
    assert objs[("Service", "r-kvgate-redis")]["spec"]["ports"][0]["port"] == 6379
    assert gateway_yaml(objs)["sessions"]["url"] == "redis://r-kvgate-redis:6379/0"
    assert base64.b64decode(objs[("Secret", "r-kvgate-admin")]["data"]["token"]) == b"dev-only-token"
    assert ("PodDisruptionBudget", "r-kvgate") in objs
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    assert parse_config(gateway_yaml(objs)).sessions.store == "redis"


def test_service_monitor_only_when_the_crd_api_is_served(tmp_path):
    without = render(tmp_path, "monitoring.yaml")
    assert not [k for k in without if k[0] == "ServiceMonitor"]
    objs = render(tmp_path, "monitoring.yaml", api_versions=(SERVICE_MONITOR_API,))
    sm = objs[("ServiceMonitor", "r-kvgate")]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s",
                                        "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "go_.*",
                                                               "action": "drop"}]}]
    assert "prometheus.io/scrape" not in objs[("Deployment", "r-kvgate")]["spec"]["template"]["metadata"].get(
        "annotations", {})


@pytest.mark.parametrize(("sets", "expected"), [
    (("discovery.eventsPort=null",), None),
    (("discovery.eventsPort=6000",), 6000),
])
def test_events_port_override(tmp_path, sets, expected):
    assert gateway_yaml(render(tmp_path, sets=sets))["discovery"]["events_port"] == expected


def test_small_floats_reach_the_gateway_as_numbers(tmp_path, monkeypatch):
    """toYaml would write 2e-05, a string to the gateway's YAML 1.1 loader (it then exits 2); the chart writes JSON."""
    values = tmp_path / "small.yaml"
    values.write_text("gateway:\n  policy:\n    inner: {decode_s_per_sequence: 2.0e-5}\n"
                      "  extraConfig:\n    retry: {backoff_initial_s: 0.00005}\n", encoding="utf-8")
    result = run_helm(["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values)], tmp_path)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    raw = gateway_yaml({(d["kind"], d["metadata"]["name"]): d for d in docs})
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(raw)
    assert config.retry.backoff_initial_s == 5e-5
    assert raw["policy"]["inner"]["decode_s_per_sequence"] == 2e-5
    assert isinstance(config.policy, SessionStickyConfig)
    assert config.policy.inner == CacheAwareConfig(decode_s_per_sequence=2e-5)


def test_replay_port_defaults_to_none_like_vllm(tmp_path):
    """vLLM serves replay only when its --kv-events-config names a replay_endpoint (none by default)."""
    discovery = decode_discovery_config(gateway_yaml(render(tmp_path))["discovery"])
    assert (discovery.events_port, discovery.replay_port) == (5557, None)


def test_vllm_discovery_settings_from_the_readme(tmp_path, monkeypatch):
    objs = render(tmp_path, sets=("discovery.replayPort=5558", "discovery.worker.load_path=null",
                                  "discovery.worker.snapshot_path=null",
                                  "gateway.extraConfig.events.warmup_from_snapshot=false"))
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(gateway_yaml(objs))
    assert config.events.warmup_from_snapshot is False
    pod = {"metadata": {"name": "vllm-0"},
           "status": {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    worker = pod_to_worker(decode_discovery_config(config.discovery), pod)
    assert worker is not None
    assert (worker.events_endpoint, worker.replay_endpoint, worker.load_path, worker.snapshot_path) == (
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", None, None)


def test_disaggregated_fleet_roles_from_the_pod_label(tmp_path, monkeypatch):
    """examples/pd.yaml: the model's ``pd`` section reaches the gateway, and each pod's role comes from its label."""
    objs = render(tmp_path, "pd.yaml")
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(gateway_yaml(objs))
    [model] = config.models
    assert model.pd is not None
    assert (model.pd.protocol, model.pd.kv_bytes_per_token, model.pd.link_bytes_per_s, model.pd.queue_timeout_s) == (
        "vllm", 131072, 25.0e9, 5.0)
    discovery = decode_discovery_config(config.discovery)
    assert discovery.role_label == "kvgate.io/role"
    roles = {}
    for name, labels in (("p-0", {"kvgate.io/role": "prefill"}), ("d-0", {"kvgate.io/role": "decode"}),
                         ("x-0", {})):
        pod = {"metadata": {"name": name, "labels": {"app": "vllm", **labels}},
               "status": {"phase": "Running", "podIP": "10.0.0.5",
                          "conditions": [{"type": "Ready", "status": "True"}]}}
        worker = pod_to_worker(discovery, pod)
        assert worker is not None
        roles[name] = worker.role
    assert roles == {"p-0": "prefill", "d-0": "decode", "x-0": "both"}


SCHEMA = "don't meet the specifications of the schema"


@pytest.mark.parametrize(("sets", "reason"), [
    (("replicaCount=0",), SCHEMA),
    (("replicaCount=2",), "replicaCount > 1 needs sessions shared through Redis"),
    (("discovery.port=70000",), SCHEMA),
    (("gateway.policy.name=fastest",), SCHEMA),
    (("redis.url=redis://:secret@redis:6379/0",), SCHEMA),  # passwords belong in a Secret
    (("image.pullPolicy=Sometimes",), SCHEMA),
    (("sessions.store=redis",), "sessions.store is redis but no Redis is configured"),
    (("redis.deploy=true", "redis.url=redis://r:6379/0"), "not both"),
    (("discovery.model=", "discovery.modelLabel="), "discovery needs discovery.model"),
    (("discovery.colour=red",), SCHEMA),
])
def test_bad_values_fail_the_render(tmp_path, sets, reason):
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    result = run_helm(args, tmp_path)
    assert result.returncode != 0, result.stdout
    assert reason in result.stderr


def test_per_replica_sessions_opt_in(tmp_path):
    objs = render(tmp_path, sets=("replicaCount=2", "sessions.allowPerReplicaSessions=true"))
    assert gateway_yaml(objs)["sessions"]["store"] == "memory"


@pytest.mark.parametrize("values", [p.name for p in EXAMPLES])
def test_manifests_validate_against_kubernetes_schemas(tmp_path, values):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    objs = render(tmp_path, values, api_versions=(SERVICE_MONITOR_API,))
    for (kind, _), manifest in objs.items():
        if kind == "ServiceMonitor":
            continue  # a CRD: no bundled schema
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
    broken = objs[("Deployment", "r-kvgate")]
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):  # strict mode does catch a misspelt field
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)
