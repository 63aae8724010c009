"""Every series the Prometheus rules and the Grafana dashboard read is one a running gateway exports at /metrics
or one the recording rules define: a renamed metric fails here, not silently on an operator's dashboard."""

from __future__ import annotations

from tests.deploy.fleet import busy_gateway, exported_series
from tests.deploy.test_grafana import queries
from tests.deploy.tools import RULE_FILES, rules, series_in


async def test_rules_and_dashboard_read_only_exported_or_recorded_series():
    recorded = {str(rule["record"]) for rule in rules(RULE_FILES[0])}
    async with busy_gateway() as g:
        assert g.session is not None
        async with g.session.get(g.url + "/metrics") as resp:
            exported = exported_series(await resp.text())
    assert {"kvgate_prompt_tokens_total", "kvgate_worker_event_batches_total", "kvgate_worker_resyncs_total",
            "kvgate_event_lag_seconds", "kvgate_decisions_total", "kvgate_ttft_seconds_bucket"} <= exported
    read = [(f"{path.name}: {rule.get('record') or rule.get('alert')}", str(rule["expr"]))
            for path in RULE_FILES for rule in rules(path)]
    read += [(f"kvgate.json: {title}", expr) for title, expr in queries()]
    unknown = {where: series_in(expr) - exported - recorded for where, expr in read}
    assert {where: names for where, names in unknown.items() if names} == {}
    dashboard_reads = set().union(*(series_in(expr) for _, expr in queries()))
    assert recorded - {"worker:kvgate_cache_hit_ratio_predicted:rate5m"} <= dashboard_reads  # the dashboard shows
    # every recorded series (the per-worker predicted ratio only through the fleet's)
