"""The agentic scenario: bundled sessions, fleet sizing, rows from counter deltas, targets, and a small real run."""

from __future__ import annotations

import json
import shutil

import pytest

from loadgen.agentic import (
    BUNDLED_DIR,
    AgenticConfig,
    LevelResult,
    in_namespace,
    level_result,
    read_sessions,
    restore_time_s,
    size_fleet,
)
from loadgen.agentic_report import markdown, targets
from loadgen.client import RequestRecord
from loadgen.report import summarize
from loadgen.traces import TraceRequest
from tests.loadgen.test_demo import kvgate
from workers.config import TimingProfile

pytestmark = pytest.mark.unit


def req(session: str, tokens: int) -> TraceRequest:
    return TraceRequest(
        arrival_s=0.0, num_prompt_tokens=tokens, num_output_tokens=4, hash_ids=tuple(range(-(-tokens // 64))),
        block_size=64, namespace=session, session_id=session,
    )  # fmt: skip


def test_bundled_sessions_are_sixteen_files_with_their_license():
    files = sorted(p.name for p in BUNDLED_DIR.glob("*.json"))
    assert len(files) == 16 and "trace_0026.json" in files and "trace_0002.json" not in files
    assert "Apache License" in (BUNDLED_DIR / "LICENSE.txt").read_text()
    requests = read_sessions(AgenticConfig(trace_dir=str(BUNDLED_DIR), max_turns_per_session=10))
    assert len({r.session_id for r in requests}) == 16
    assert max(r.num_prompt_tokens for r in requests) < 91_000
    assert sum(p.stat().st_size for p in BUNDLED_DIR.glob("*.json")) < 2_000_000


def test_fleet_overflows_gpu_and_cpu_at_the_top_level_and_the_pool_holds_it():
    requests = [req("a", 640), req("a", 1280), req("b", 6400), req("c", 3200), req("d", 3200)]
    # longest per session: a 20, b 100, c 50, d 50 blocks; mean 55; top level 4 -> working set 220
    config = AgenticConfig(trace_dir="", levels=(2, 4), num_workers=4, gpu_share=0.3, pool_share=1.5)
    s = size_fleet(requests, config)
    assert (s.num_sessions, s.mean_session_blocks, s.top_working_set_blocks) == (4, 55.0, 220)
    assert s.num_gpu_blocks_per_worker == 105  # max(ceil(0.3 * 220 / 4) = 17, ceil(1.05 * 100))
    assert s.num_cpu_blocks_per_worker == 27  # max(ceil(105 / 4), ceil(0.6 * 220 / 4) - 105)
    assert s.pool_capacity_blocks == 330
    assert s.pool_segment_bytes_per_worker == 16 << 20  # 330 * 64 * 4 / 4 bytes, raised to Mooncake's 16 MiB
    assert s.pool_value_bytes_per_block == (64 << 20) // 330  # padded so 4 segments hold 330 blocks
    moved = in_namespace(requests, "shared-4")
    assert moved[0].namespace == "shared-4/a" and moved[0].hash_ids == requests[0].hash_ids


def test_a_row_from_the_summary_and_the_workers_counter_deltas():
    records = [
        RequestRecord(index=i, session_id="s", start_s=0.0, num_prompt_tokens=1000, num_reported_prompt_tokens=1000,
                      num_output_tokens=10, num_cached_tokens=900, num_predicted_cached_tokens=900, worker="w",
                      ttft_s=0.1 * (i + 1), e2e_s=1.0)
        for i in range(4)
    ]  # fmt: skip
    summary = summarize(records, policy="shared @ 4", ceiling_hit_ratio=0.95, duration_s=2.0, time_scale=10.0)
    before = {"GPU": 100.0, "CPU": 0.0, "MOONCAKE": 0.0, "restores": 1.0}
    after = {"GPU": 2100.0, "CPU": 800.0, "MOONCAKE": 800.0, "restores": 5.0}
    profile = TimingProfile()
    row = level_result("shared", 4, summary, before, after, profile, 10.0, 25.0)
    assert (row.share_gpu, row.share_cpu, row.share_pool) == (0.5, 0.2, 0.2)
    assert row.share_computed == pytest.approx(0.1)
    assert row.reuse_of_ceiling == pytest.approx(0.9 / 0.95)
    assert (row.prompt_tokens_per_s, row.output_tokens_per_s) == (200.0, 2.0)  # 4000 and 40 tokens in 20 sim s
    assert (row.num_restores, row.mean_restore_tokens, row.pool_evicted_keys) == (4, 400.0, 15)
    assert row.mean_restore_s == restore_time_s(200.0, 200.0, profile)
    assert row.mean_restore_s == pytest.approx(2e-5 + 200 * 131072 / 55e9 + 1e-4 + 200 * 131072 / 20e9)
    assert row.cached_mismatch_ratio == 0.0 and row.ttft_p50_s == pytest.approx(2.5)


def row(config: str, level: int, of_ceiling: float, prompt_per_s: float, evicted: int | None = None) -> LevelResult:
    return LevelResult(
        config=config, level=level, requests_ok=10, requests_failed=0, reuse=of_ceiling * 0.95, ceiling=0.95,
        reuse_of_ceiling=of_ceiling, share_gpu=0.5, share_cpu=0.2, share_pool=0.2, share_computed=0.1,
        prompt_tokens_per_s=prompt_per_s, output_tokens_per_s=1.0, ttft_p50_s=0.5, ttft_p99_s=2.0, num_restores=3,
        mean_restore_tokens=1000.0, mean_restore_s=0.01, cached_mismatch_ratio=0.0, pool_evicted_keys=evicted,
    )  # fmt: skip


def test_targets_on_known_rows():
    results = [row("split", 4, 0.99, 1000.0), row("split", 8, 0.80, 1000.0), row("shared", 4, 0.99, 1000.0, 0),
               row("shared", 8, 0.975, 1600.0, 12)]  # fmt: skip
    assert targets(results) == [
        ("shared pool reuse ÷ ceiling >= 0.97 at every level", True, "0.975"),
        ("shared ÷ split prompt throughput at 8 >= 1.5", True, "1.60"),
        ("shared: predicted = reported cached tokens", True, "0.00%"),
        ("the master evicted", True, "12"),
        ("no failed request", True, "0"),
    ]
    table = markdown(results).splitlines()
    assert len(table) == 6 and table[1].count("---") == 19
    assert table[5].startswith("| shared | 8 | 10 | 0 | 0.926 | 0.975 | 0.500 | 0.200 | 0.200 | 0.100 | 1,600 |")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_small_agentic_run_end_to_end(tmp_path):
    trace = tmp_path / "sessions"
    trace.mkdir()
    for name in ("trace_0026.json", "trace_0019.json"):
        shutil.copy(BUNDLED_DIR / name, trace / name)
    configs = "gpu,split,shared" if shutil.which("mooncake_master") or _venv_master() else "gpu,split"
    out = tmp_path / "out"
    rc = kvgate(
        ["demo", "--scenario", "agentic", "--trace", str(trace), "--out", str(out), "--levels", "1,2",
         "--max-turns", "3", "--configs", configs, "--no-progress", "--no-plots", "--time-scale", "20",
         "--num-workers", "2"]
    )  # fmt: skip
    data = json.loads((out / "agentic.json").read_text())
    rows = {(r["config"], r["level"]): r for r in data["results"]}
    assert sorted(rows) == sorted((c, lv) for c in configs.split(",") for lv in (1, 2))
    for r in rows.values():
        assert r["requests_ok"] == 6 and r["requests_failed"] == 0
        total = r["share_gpu"] + r["share_cpu"] + r["share_pool"] + r["share_computed"]
        assert total == pytest.approx(1.0)
        assert r["share_gpu"] + r["share_cpu"] + r["share_pool"] == pytest.approx(r["reuse"])
        assert r["cached_mismatch_ratio"] == 0.0
    assert rows[("gpu", 1)]["share_cpu"] == 0.0 and rows[("gpu", 1)]["share_pool"] == 0.0
    assert rc == 0


def _venv_master() -> bool:
    import sys
    from pathlib import Path

    return (Path(sys.executable).parent / "mooncake_master").exists()
