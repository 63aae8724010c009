"""Chaos on a sim fleet with two gateway replicas sharing a real Redis (``benchmarks.chaos``, a short run): a
worker killed with SIGKILL and restarted at the same address, Redis stopped and started, one replica restarted,
a worker's events lost with its replay refusing, a slow worker, a worker failing after its headers. Every request
ends cleanly before its deadline, the gauges return to 0, each replica's index equals the workers' snapshots,
sessions belong to live workers, descriptors and tasks stay flat, and no prediction comes from a wrong index."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.chaos import SCHEDULE, ChaosConfig, report, run_chaos
from loadgen.demo import find_default_trace
from tests.redis_server import restartable_redis  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_chaos_every_request_ends_cleanly_and_state_recovers(restartable_redis, tmp_path, capsys):  # noqa: F811
    trace = find_default_trace()
    assert trace is not None
    config = ChaosConfig(trace=trace, out=str(tmp_path), max_requests=150, time_scale=2.0, num_workers=3,
                         max_output_tokens=4, deadline_s=30.0, recovery_timeout_s=30.0, slow_delay_s=0.5, hold_s=3.0,
                         faults=SCHEDULE)
    outcome = asyncio.run(run_chaos(config, restartable_redis))
    report(config, outcome)
    printed = capsys.readouterr().out
    failed = [f"{name}: {detail}" for name, ok, detail in outcome.checks if not ok]
    assert not failed, printed
    counts = outcome.counts
    assert counts["hung"] == 0 and counts["unclean_error"] == 0
    assert counts["completed"] + counts["clean_error"] == counts["requests"] > 0
    assert counts["completed"] > 0 and counts["calm_requests"] == 40
    assert [action for _, action in outcome.log if action in SCHEDULE] == list(SCHEDULE)
