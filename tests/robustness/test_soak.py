"""The soak's CI variant (``benchmarks.soak --quick`` sizes): three minutes of trace with index churn (clears,
worker removals and re-adds) on two sim workers. The gateway's index empties when the workers clear, failed
requests are only the gateway's clean 502/503 answers, descriptors and asyncio tasks return to their baseline on
every process, and no process's RSS grows after the load (the full run, ``python -m benchmarks soak``, also checks
the plateau and the return to the baseline, which a run this short does not reach)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks._probe import rss_curve
from benchmarks.soak import SoakConfig, run_soak
from loadgen.demo import find_default_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_soak_ci_variant(tmp_path):
    trace = find_default_trace()
    assert trace is not None
    config = SoakConfig(trace=trace, out=str(tmp_path), trace_hours=0.05, time_scale=30.0, max_duration_s=45.0,
                        churn_interval_s=2.0, sample_interval_s=1.0, num_workers=2, num_gpu_blocks=8192,
                        tracemalloc="none", write_plot=False)
    result = asyncio.run(run_soak(config))
    checks = {name: (ok, detail) for name, ok, detail in result.checks}
    curves = {name: rss_curve(series) for name, series in result.samples.items()}
    # A worker removed by the churn while the other fails a health check on a busy host leaves no worker for a
    # moment: those requests get the gateway's 503; none may time out or break.
    assert result.num_requests > 0 and result.num_failed < result.num_requests, curves
    assert set(result.error_kinds) <= {"http_502", "http_503"}, result.error_kinds
    assert checks["gateway index empty after the clears"][0]
    assert set(result.samples) == {"gateway", "worker-0", "worker-1"}
    for name, series in result.samples.items():
        for check in ("descriptors back to baseline (+4)", "asyncio tasks back to baseline (+4)"):
            ok, detail = checks[f"{name}: {check}"]
            assert ok, f"{name}: {check}: {detail}"
        plateau = [s.rss_bytes for s in series if s.phase == "plateau"]
        after = [s.rss_bytes for s in series if s.phase == "cleared"]
        assert plateau and after, curves
        assert max(after) <= 1.10 * max(plateau), curves[name]
        assert [s.num_entries for s in series if s.phase == "cleared"][-1] == 0
