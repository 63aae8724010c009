"""The soak's CI variant (``benchmarks.soak --quick`` sizes, about a minute): three minutes of trace with index
churn (clears, worker removals and re-adds) on two sim workers, run once for the module. The gateway's index
empties when the workers clear, failed requests are only the gateway's clean 502/503 answers, descriptors and
asyncio tasks return to their baseline on every process, each sim worker's RSS returns within 10% of its baseline
after its cache is reset (KV manager, replay buffer), and the gateway's RSS does not grow after the load. The
gateway runs as documented, under jemalloc (``common.allocator``), where ``libjemalloc.so.2`` is installed: its RSS
then stays flat after the warm-up and returns to its baseline too, both within ``GATEWAY_TOLERANCE`` (a check
skipped, with the reason, without the library). The soak's own checks are 10%, which jemalloc meets by a margin of
about 1% of the baseline (flat 1.07-1.08, back 1.09, with the index's journals bounded by the decisions still open;
before that CPython's default allocator 1.09-1.10 and 1.33-1.35, Python's small-object pools pinned by a few
surviving values each, and glibc 1.25: ``benchmarks.soak``'s docstring), and one of seven runs of this module at 10%
failed: the CI bound keeps the allocators apart without that noise."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks._probe import rss_curve
from benchmarks.soak import SoakConfig, SoakResult, run_soak
from common.allocator import find_jemalloc
from loadgen.demo import find_default_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

GATEWAY_TOLERANCE = 0.15
"""The gateway's RSS bounds here, flat (max/min after warm-up) and back (after the clears over the baseline), as a
fraction (module docstring)."""


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> SoakResult:
    trace = find_default_trace()
    assert trace is not None
    out: Path = tmp_path_factory.mktemp("soak")
    config = SoakConfig(trace=trace, out=str(out), trace_hours=0.05, time_scale=30.0, max_duration_s=30.0,
                        churn_interval_s=2.0, sample_interval_s=1.0, num_workers=2, num_gpu_blocks=8192,
                        tracemalloc="none", allocator="auto", write_plot=False)
    return asyncio.run(run_soak(config))


def test_soak_ci_variant(soak: SoakResult) -> None:
    checks = {name: (ok, detail) for name, ok, detail in soak.checks}
    curves = {name: rss_curve(series) for name, series in soak.samples.items()}
    # A worker removed by the churn while the other fails a health check on a busy host leaves no worker for a
    # moment: those requests get the gateway's 503; none may time out or break.
    assert soak.num_requests > 0 and soak.num_failed < soak.num_requests, curves
    assert set(soak.error_kinds) <= {"http_502", "http_503"}, soak.error_kinds
    assert checks["gateway index empty after the clears"][0]
    assert set(soak.samples) == {"gateway", "worker-0", "worker-1"}
    for name, series in soak.samples.items():
        for check in ("descriptors back to baseline (+4)", "asyncio tasks back to baseline (+4)"):
            ok, detail = checks[f"{name}: {check}"]
            assert ok, f"{name}: {check}: {detail}"
        plateau = [s.rss_bytes for s in series if s.phase == "plateau"]
        after = [s.rss_bytes for s in series if s.phase == "cleared"]
        assert plateau and after, curves
        assert max(after) <= 1.10 * max(plateau), curves[name]
        assert [s.num_entries for s in series if s.phase == "cleared"][-1] == 0
    for name in ("worker-0", "worker-1"):
        ok, detail = checks[f"{name}: RSS after clears within 10% of baseline"]
        assert ok, f"{name}: {detail} ({curves[name]})"
    per_block = soak.worker_bytes_per_block["worker-0"]
    assert per_block["cached_blocks_at_plateau"] > 0 and per_block["rss_bytes_per_cached_block"] > 0


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc.so.2 not installed (Debian: libjemalloc2; "
                    "scripts/test installs it): under pymalloc the gateway's RSS stays ~1.33x its baseline")
def test_gateway_rss_back_to_baseline(soak: SoakResult) -> None:
    assert soak.allocator == "jemalloc"
    series = soak.samples["gateway"]
    plateau = [s.rss_bytes for s in series if s.phase == "plateau"]
    base = [s.rss_bytes for s in series if s.phase == "baseline"][-1]
    after = [s.rss_bytes for s in series if s.phase == "cleared"][-1]
    curve = rss_curve(series)
    assert max(plateau) / min(plateau) <= 1 + GATEWAY_TOLERANCE, curve
    assert after / base <= 1 + GATEWAY_TOLERANCE, curve


def test_survivors_are_the_sites_that_grew_by_stack() -> None:
    from benchmarks._soak_report import survivors

    def site(stack: list[str], size: int, count: int) -> dict[str, object]:
        file, line = stack[0].rsplit(":", 1)
        return {"file": file, "line": int(line), "size_bytes": size, "num_blocks": count, "stack": stack}

    baseline = {"sites": [site(["a.py:1", "b.py:2"], 1000, 10), site(["a.py:1", "c.py:3"], 500, 5)]}
    cleared = {"sites": [site(["a.py:1", "b.py:2"], 1200, 12), site(["a.py:1", "c.py:3"], 100, 1),
                         site(["d.py:4"], 4096, 1)]}
    grown = survivors(baseline, cleared, limit=2)
    assert [(g["site"]["file"], g["size_bytes"], g["num_blocks"]) for g in grown] == [("d.py", 4096, 1),
                                                                                      ("a.py", 200, 2)]
    assert grown[1]["site"]["stack"] == ["a.py:1", "b.py:2"]  # the same line reached another way is another site
    assert [g["size_bytes"] for g in survivors(baseline, cleared)] == [4096, 200, -400]
