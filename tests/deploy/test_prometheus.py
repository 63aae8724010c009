"""deploy/prometheus: promtool's syntax check and unit tests of every rule, then a real Prometheus scraping a running
gateway and evaluating the recording rules on what it scraped.

promtool and prometheus come from Debian's ``prometheus`` package (``scripts/test`` installs it); without them the
tests are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import math
import subprocess

import pytest

from tests.deploy.fleet import resync, traffic
from tests.deploy.prometheus_server import SCRAPE_INTERVAL_S, PrometheusServer, prometheus_binary
from tests.deploy.tools import RULE_FILES, RULES_DIR, promtool, rules
from tests.router.sim_fleet import Gw, SimWorker, connected, make_config, running

TEST_FILES = sorted((RULES_DIR / "tests").glob("*_test.yml"))


def test_promtool_check_rules_passes():
    result = subprocess.run([promtool(), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 16 rules found" in result.stdout
    assert "SUCCESS: 6 rules found" in result.stdout


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file):
    result = subprocess.run([promtool(), "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_has_a_unit_test():
    tested = "\n".join(p.read_text() for p in TEST_FILES)
    for rule in rules(RULE_FILES[0]):
        assert f"expr: {rule['record']}\n" in tested, rule["record"]
    for rule in rules(RULE_FILES[1]):
        assert f"alertname: {rule['alert']}\n" in tested, rule["alert"]


async def test_prometheus_records_the_gateway_counters(tmp_path):
    """Prometheus scrapes a gateway that starts idle, then serves traffic and one resync; the recorded hit ratios
    are the quotients of the gateway's own counters, the mismatch ratio is 0 (sim workers report what the index
    predicts), and the lag is the gateway's gauge.

    Both counters of a ratio come from the same scrapes and start at 0, so Prometheus scales both rates by the
    same extrapolation factor: their quotient is the counters' quotient, up to float rounding (1e-12).
    """
    prometheus_binary()
    async with running(SimWorker("w0"), SimWorker("w1")) as workers:
        async with Gw(make_config(workers)) as g:
            await connected(g, workers)
            server = await asyncio.to_thread(PrometheusServer, tmp_path, f"127.0.0.1:{g.port}", RULE_FILES)
            try:
                await _wait_for(server, 'kvgate_prompt_tokens_total{worker="w1"}', 0.0)  # scraped while idle
                await traffic(g)
                await resync(g, workers[1])
                wm = g.gw.metrics.workers
                for wid in ("w0", "w1"):
                    await _wait_for(server, f'kvgate_prompt_tokens_total{{worker="{wid}"}}',
                                    float(wm[wid].num_prompt_tokens))
                    await _wait_for(server, f'kvgate_reported_cached_tokens_total{{worker="{wid}"}}',
                                    float(wm[wid].num_reported_cached_tokens))
                await asyncio.sleep(2 * SCRAPE_INTERVAL_S)  # a rule evaluation after the last scrape that moved

                served = await asyncio.to_thread(server.query, "worker:kvgate_cache_hit_ratio_served:rate5m")
                predicted = await asyncio.to_thread(server.query, "worker:kvgate_cache_hit_ratio_predicted:rate5m")
                assert set(served) == set(predicted) == {"worker=w0", "worker=w1"}
                for wid in ("w0", "w1"):
                    m = wm[wid]
                    assert m.num_reported_cached_tokens > 0 and m.num_prompt_tokens > m.num_reported_cached_tokens
                    assert math.isclose(served[f"worker={wid}"],
                                        m.num_reported_cached_tokens / m.num_prompt_tokens, rel_tol=1e-12)
                    assert math.isclose(predicted[f"worker={wid}"],
                                        m.num_predicted_cached_tokens / m.num_prompt_tokens, rel_tol=1e-12)
                total_reported = sum(m.num_reported_cached_tokens for m in wm.values())
                total_prompt = sum(m.num_prompt_tokens for m in wm.values())
                fleet = await asyncio.to_thread(server.query, "kvgate:cache_hit_ratio_served:rate5m")
                assert math.isclose(fleet[""], total_reported / total_prompt, rel_tol=1e-12)

                mismatch = await asyncio.to_thread(server.query, "worker:kvgate_cached_tokens_mismatch_ratio:rate5m")
                assert mismatch == {"worker=w0": 0.0, "worker=w1": 0.0}
                lag = await asyncio.to_thread(server.query, "worker:kvgate_event_lag_seconds:max")
                assert lag == {f"worker={wid}": g.gw.events.event_lag_s(wid) for wid in ("w0", "w1")}
                resyncs = await asyncio.to_thread(server.query, "worker:kvgate_resyncs:per_minute")
                assert set(resyncs) == {"worker=w0", "worker=w1"}
                assert resyncs["worker=w0"] == 0.0 and resyncs["worker=w1"] > 0.0  # one resync in the window
                queue = await asyncio.to_thread(server.query, "kvgate:admission_queue_depth:sum")
                assert queue == {"": 0.0}
                alerts = await asyncio.to_thread(server.api, "alerts")
                assert alerts["alerts"] == []  # a healthy fleet: nothing pending or firing
            finally:
                await asyncio.to_thread(server.stop)


async def _wait_for(server: PrometheusServer, expr: str, value: float, timeout_s: float = 20.0) -> None:
    """Until Prometheus' latest sample of ``expr`` (one series) is ``value``."""
    async def current() -> dict[str, float]:
        return await asyncio.to_thread(server.query, expr)

    last: dict[str, float] = {}
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                last = await current()
                if list(last.values()) == [value]:
                    return
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"prometheus never had {expr} = {value} (last: {last})") from None

