"""The chart's monitoring objects: the Grafana dashboard ConfigMap and the PrometheusRule, each off by default, and
carrying exactly the files of deploy/grafana and deploy/prometheus (the chart keeps copies: helm reads only files
inside the chart)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm.test_chart import CHART, REPO, render

pytestmark = pytest.mark.integration

PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
RULE_FILES = ("recording.yml", "alerts.yml")


def test_off_by_default(tmp_path):
    objs = render(tmp_path, api_versions=(PROMETHEUS_RULE_API,))
    assert ("ConfigMap", "r-kvgate-dashboard") not in objs
    assert not [k for k in objs if k[0] == "PrometheusRule"]


def test_dashboard_config_map_for_the_grafana_sidecar(tmp_path):
    objs = render(tmp_path, "monitoring.yaml")
    cm = objs[("ConfigMap", "r-kvgate-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == "r"
    assert list(cm["data"]) == ["kvgate.json"]
    shipped = (REPO / "deploy" / "grafana" / "kvgate.json").read_text()
    assert cm["data"]["kvgate.json"] == shipped.rstrip("\n")
    assert json.loads(cm["data"]["kvgate.json"])["uid"] == "kvgate"


def test_dashboard_labels_and_annotations_are_values(tmp_path):
    objs = render(tmp_path, sets=("metrics.grafanaDashboard.enabled=true",
                                  "metrics.grafanaDashboard.labels.grafana_dashboard=kvgate",
                                  "metrics.grafanaDashboard.annotations.grafana_folder=LLM"))
    meta = objs[("ConfigMap", "r-kvgate-dashboard")]["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "kvgate"
    assert meta["annotations"] == {"grafana_folder": "LLM"}


def test_prometheus_rule_only_when_the_crd_api_is_served(tmp_path):
    assert not [k for k in render(tmp_path, "monitoring.yaml") if k[0] == "PrometheusRule"]
    objs = render(tmp_path, "monitoring.yaml", api_versions=(PROMETHEUS_RULE_API,))
    rule = objs[("PrometheusRule", "r-kvgate")]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    expected = [g for name in RULE_FILES
                for g in yaml.safe_load((REPO / "deploy" / "prometheus" / name).read_text())["groups"]]
    assert rule["spec"]["groups"] == expected
    assert [g["name"] for g in expected] == ["kvgate.recording", "kvgate.alerts"]


@pytest.mark.parametrize("name", RULE_FILES)
def test_the_chart_ships_the_same_rule_files(name):
    assert (CHART / "rules" / name).read_bytes() == (REPO / "deploy" / "prometheus" / name).read_bytes()
