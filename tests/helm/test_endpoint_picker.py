"""The chart's Endpoint Picker option (``endpointPicker``, off by default): the gateway's ``endpoint_picker``
section, the ext_proc port on the container and the Service, and the ``InferencePool``
(``inference.networking.k8s.io/v1``: ``selector.matchLabels``, ``targetPorts``, ``endpointPickerRef``), rendered by a
real helm and checked value by value; core manifests validate against the Kubernetes schemas."""

from __future__ import annotations

import pytest

from router.config import parse_config
from router.epp_config import EndpointPickerConfig
from tests.helm.test_chart import CHART, KUBE_VERSION, NAMESPACE, RELEASE, container, gateway_yaml, render, run_helm

pytestmark = pytest.mark.integration


def test_off_by_default(tmp_path):
    objs = render(tmp_path)
    assert not any(kind == "InferencePool" for kind, _ in objs)
    assert "endpoint_picker" not in gateway_yaml(objs)
    assert [p["name"] for p in container(objs)["ports"]] == ["http"]
    assert [p["name"] for p in objs[("Service", f"{RELEASE}-kvgate")]["spec"]["ports"]] == ["http"]


def test_inference_pool_and_epp(tmp_path, monkeypatch):
    objs = render(tmp_path, sets=("endpointPicker.enabled=true", "endpointPicker.numFallbackEndpoints=1",
                                  "discovery.labelSelector=app=vllm\\,tier=decode"))
    raw = gateway_yaml(objs)
    assert raw["endpoint_picker"] == {"host": "0.0.0.0", "port": 9002, "num_fallback_endpoints": 1}
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "t")
    config = parse_config(raw)
    assert config.endpoint_picker == EndpointPickerConfig(host="0.0.0.0", port=9002, num_fallback_endpoints=1)
    assert container(objs)["ports"][1] == {"name": "grpc-ext-proc", "containerPort": 9002, "protocol": "TCP"}
    assert objs[("Service", f"{RELEASE}-kvgate")]["spec"]["ports"][1] == {
        "name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc-ext-proc", "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c"}
    pool = objs[("InferencePool", f"{RELEASE}-kvgate")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == NAMESPACE
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app": "vllm", "tier": "decode"}},  # the pods discovery watches
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"kind": "Service", "name": f"{RELEASE}-kvgate", "port": {"number": 9002},
                              "failureMode": "FailClose"},
    }
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for (kind, _), manifest in objs.items():
        if kind != "InferencePool":  # a CRD: no bundled schema
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_explicit_match_labels_and_name(tmp_path):
    objs = render(tmp_path, sets=("endpointPicker.enabled=true", "endpointPicker.inferencePool.name=pool",
                                  "endpointPicker.inferencePool.matchLabels.app=sglang",
                                  "endpointPicker.inferencePool.failureMode=FailOpen"))
    pool = objs[("InferencePool", "pool")]
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "sglang"}}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_pool_off_keeps_the_picker(tmp_path):
    objs = render(tmp_path, sets=("endpointPicker.enabled=true", "endpointPicker.inferencePool.enabled=false"))
    assert not any(kind == "InferencePool" for kind, _ in objs)
    assert gateway_yaml(objs)["endpoint_picker"]["port"] == 9002


@pytest.mark.parametrize(("sets", "reason"), [
    (("endpointPicker.enabled=true", "discovery.labelSelector=app!=vllm"), "is not key=value"),
    (("endpointPicker.enabled=true", "discovery.enabled=false"), "needs discovery.enabled"),
    (("endpointPicker.inferencePool.failureMode=Maybe",), "don't meet the specifications of the schema"),
    (("endpointPicker.port=0",), "don't meet the specifications of the schema"),
])
def test_bad_values_fail_the_render(tmp_path, sets, reason):
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    result = run_helm(args, tmp_path)
    assert result.returncode != 0, result.stdout
    assert reason in result.stderr
