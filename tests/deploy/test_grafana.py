"""deploy/grafana/kvgate.json: a well-formed Grafana dashboard whose every query is PromQL that promtool parses,
and the chart's copy of it is the same file."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import yaml

from tests.deploy.tools import DASHBOARD, ROOT, promtool

CHART_COPY = ROOT / "deploy" / "helm" / "kvgate" / "dashboards" / "kvgate.json"
PANEL_TYPES = {"row", "stat", "timeseries"}
GRID_WIDTH = 24
# Values the dashboard's variables take when Grafana runs a query.
VARIABLES = {"$worker": ".*", "$__rate_interval": "5m"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    """(panel title or variable name, PromQL) of every panel target and query variable, variables substituted."""
    out = [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"]  # label_values(<series>, <label>): the series is the PromQL
            out.append((var["name"], query.removeprefix("label_values(").rsplit(",", 1)[0]))
    substituted = []
    for title, expr in out:
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        substituted.append((title, expr))
    return substituted


def test_dashboard_metadata_and_variables():
    d = dashboard()
    assert (d["uid"], d["title"], d["schemaVersion"]) == ("kvgate", "kvgate", 39)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    worker = variables["worker"]
    assert (worker["type"], worker["multi"], worker["includeAll"], worker["allValue"]) == ("query", True, True, ".*")
    assert worker["query"]["query"] == worker["definition"] == "label_values(kvgate_inflight_requests, worker)"


def test_panels_are_well_formed_and_do_not_overlap():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES, p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= GRID_WIDTH and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["description"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == [
        "Fleet", "Workers", "KV events and index", "Sessions and admission"]


def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each query as the expression of a recording rule."""
    rules_file = tmp_path / "dashboard-queries.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries())]}]}))
    result = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries())} rules found" in result.stdout


def test_the_chart_ships_the_same_dashboard():
    assert CHART_COPY.read_bytes() == DASHBOARD.read_bytes()
