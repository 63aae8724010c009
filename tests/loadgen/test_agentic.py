"""The agentic scenario: bundled sessions, fleet sizing, rows from counter deltas, targets, and a small real run."""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest

from loadgen.agentic import (
    BUNDLED_DIR,
    AgenticConfig,
    LevelResult,
    Sizing,
    in_namespace,
    level_result,
    pd_section,
    read_sessions,
    restore_time_s,
    size_fleet,
    with_copies,
    worker_roles,
)
from loadgen.agentic_report import exit_status, explain, failure_lines, markdown, targets, turn_markdown
from loadgen.agentic_steady import SteadyState
from loadgen.client import RequestRecord
from loadgen.errors import LoadgenError
from loadgen.report import summarize
from loadgen.traces import TraceRequest
from router.pd_config import PDConfig
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


def test_levels_above_the_sessions_replay_distinct_copies():
    requests = [req("a", 640), req("a", 1280), req("b", 6400)]
    assert with_copies(requests, 2) == requests
    copies = with_copies(requests, 5)  # 2 sessions -> 3 copies of each
    assert [(r.session_id, r.namespace) for r in copies] == [
        ("a", "a"), ("a", "a"), ("b", "b"),
        ("c1/a", "c1/a"), ("c1/a", "c1/a"), ("c1/b", "c1/b"),
        ("c2/a", "c2/a"), ("c2/a", "c2/a"), ("c2/b", "c2/b"),
    ]  # fmt: skip
    assert [r.hash_ids for r in copies[3:6]] == [r.hash_ids for r in requests]
    config = AgenticConfig(trace_dir="", levels=(2, 8), num_workers=4)
    assert size_fleet(requests, config).top_working_set_blocks == 8 * 60  # the top level, not the 2 sessions


def test_pd_configurations_split_the_workers_into_prefill_and_decode():
    assert worker_roles("shared", 4) == ["both"] * 4
    assert worker_roles("pd-split", 4) == ["prefill", "prefill", "decode", "decode"]
    assert worker_roles("pd-shared", 3) == ["prefill", "decode", "decode"]
    with pytest.raises(LoadgenError, match="at least 2 workers"):
        worker_roles("pd-shared", 1)


def test_a_row_from_the_summary_and_the_workers_counter_deltas():
    records = [
        RequestRecord(index=i, session_id="s", start_s=0.0, num_prompt_tokens=1000, num_reported_prompt_tokens=1000,
                      num_output_tokens=10, num_cached_tokens=900, num_predicted_cached_tokens=900, worker="w",
                      ttft_s=0.1 * (i + 1), e2e_s=1.0)
        for i in range(4)
    ]  # fmt: skip
    summary = summarize(records, policy="shared @ 4", ceiling_hit_ratio=0.95, duration_s=2.0, time_scale=10.0)
    before = {"GPU": 100.0, "CPU": 0.0, "MOONCAKE": 0.0, "restores": 1.0, "pool_reads": 2.0, "pool_read_wall_s": 1.0,
              "pool_short_reads": 1.0}
    after = {"GPU": 2100.0, "CPU": 800.0, "MOONCAKE": 800.0, "restores": 5.0, "pool_reads": 6.0,
             "pool_read_wall_s": 3.0, "pool_short_reads": 3.0}
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
    assert row.mean_pool_read_wall_s == 0.5  # 2 wall s over 4 reads
    assert row.num_pool_short_reads == 2


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
        ("shared reuse ÷ ceiling >= 0.97 at every level", True, "0.975"),
        ("shared ÷ split prompt throughput at 8 >= 1.5", True, "1.60"),
        ("shared: predicted = reported cached tokens", True, "0.00%"),
        ("shared: the master evicted", True, "12"),
        ("no failed request", True, "0"),
    ]
    counted = [msgspec.structs.replace(r, cached_mismatch_ratio=0.05, cached_mismatch_index_ratio=0.0)
               for r in results]  # fmt: skip
    assert targets(counted)[2] == ("shared: no mismatch from a wrong index", True, "0.00% (all causes 5.00%)")
    short = [msgspec.structs.replace(r, num_pool_short_reads=3) for r in counted]
    assert targets(short)[2][2] == (
        "0.00% (all causes 5.00%; 6 pool reads found blocks the master evicted after the lookup)"
    )
    pd_rows = [row("pd-split", 8, 0.7, 1000.0), row("pd-shared", 8, 0.96, 1400.0, 3)]
    assert targets(pd_rows) == [
        ("pd-shared reuse ÷ ceiling >= 0.97 at every level", False, "0.960"),
        ("pd-shared ÷ pd-split prompt throughput at 8 >= 1.5", False, "1.40"),
        ("pd-shared: predicted = reported cached tokens", True, "0.00%"),
        ("pd-shared: the master evicted", True, "3"),
        ("no failed request", True, "0"),
    ]
    table = markdown(results).splitlines()
    assert len(table) == 6 and table[1].count("---") == 22
    assert table[5].startswith("| shared | 8 | 10 | 0 | – | 0.926 | 0.975 | 0.500 | 0.200 | 0.200 | 0.100 | 1,600 |")


def test_a_level_with_failures_shows_its_error_kinds_in_its_row_and_the_targets():
    records = [
        RequestRecord(index=i, session_id="s", start_s=0.0, num_prompt_tokens=1000, num_reported_prompt_tokens=1000,
                      num_output_tokens=10, num_cached_tokens=0, num_predicted_cached_tokens=0, worker="w",
                      ttft_s=0.1, e2e_s=1.0, error_kind=kind, request_id=f"r{i}", error_message=f"m{i}")
        for i, kind in enumerate([None, "timeout", "http_502", "timeout", None, "timeout"])
    ]  # fmt: skip
    summary = summarize(records, policy="pd-split @ 64", ceiling_hit_ratio=0.95, duration_s=2.0, time_scale=10.0)
    counters = {"GPU": 0.0, "CPU": 0.0, "MOONCAKE": 0.0, "restores": 0.0, "pool_reads": 0.0, "pool_read_wall_s": 0.0}
    failing = level_result("pd-split", 64, summary, counters, counters, TimingProfile(), None, None)
    assert (failing.requests_ok, failing.requests_failed) == (2, 4)
    assert failing.errors_by_kind == {"http_502": 1, "timeout": 3}
    fine = row("pd-split", 16, 0.9, 1000.0)
    table = markdown([fine, failing]).splitlines()
    assert table[2].startswith("| pd-split | 16 | 10 | 0 | – |")
    assert table[3].startswith("| pd-split | 64 | 2 | 4 | timeout 3, http_502 1 |")
    assert targets([fine, failing])[-1] == ("no failed request", False, "4 (pd-split @ 64: timeout 3, http_502 1)")
    assert failing.error_examples == {"http_502": "r2: m2", "timeout": "r1: m1"}  # the first of each kind
    assert exit_status([fine, failing]) == 1 and exit_status([fine]) == 0
    assert failure_lines([fine, failing]) == ["- pd-split @ 64, http_502: r2: m2", "- pd-split @ 64, timeout: r1: m1"]


def test_explain_gives_the_model_bound_ratio_and_what_waited():
    split = msgspec.structs.replace(row("split", 64, 0.2, 50_000.0), share_computed=0.8)
    shared = msgspec.structs.replace(
        row("shared", 64, 1.0, 30_000.0), share_computed=0.2, num_restores=50, mean_pool_read_wall_s=0.5
    )
    sizing = Sizing(16, 149, 786.0, 50_000, 3_000, 3_000, 75_000, 16 << 20, 889, mean_prompt_tokens=40_000.0,
                    mean_think_s=20.0)  # fmt: skip
    (line,) = explain([split, shared], sizing, 20.0)
    # split computes 40,000 tokens/s; shared computes 20%: 200,000 by compute, 128,000 by think time (64 × 2,000)
    assert "shared ÷ split at 64 is 0.60" in line and "40,000 computed tokens" in line
    assert "would serve 200,000" in line and "allow 128,000" in line and "ratio of 2.56" in line
    assert "50 of 10 requests" in line and "0.500 s of wall time" in line and "(10.0 simulated s" in line
    assert "other sequences keep running" in line
    assert explain([split, msgspec.structs.replace(shared, prompt_tokens_per_s=80_000.0)], sizing, 20.0) == []


def test_targets_and_explain_use_the_steady_window_and_split_the_turn():
    split = msgspec.structs.replace(
        row("split", 64, 0.2, 50_000.0), share_computed=0.8,
        steady=SteadyState(600.0, 40_000.0, 50.0, 300, mean_think_s=18.0, mean_ttft_s=9.0, mean_decode_s=1.0),
    )  # fmt: skip
    shared = msgspec.structs.replace(
        row("shared", 64, 1.0, 60_000.0, 5), share_computed=0.2,
        steady=SteadyState(500.0, 56_000.0, 70.0, 350, mean_think_s=18.0, mean_ttft_s=1.0, mean_decode_s=1.0),
    )  # fmt: skip
    # the whole-run figures (60,000 ÷ 50,000 = 1.20) are not what the target reads: 56,000 ÷ 40,000 = 1.40
    assert ("shared ÷ split prompt throughput at 64 >= 1.5", False, "1.40") in targets([split, shared])
    sizing = Sizing(16, 149, 786.0, 50_000, 3_000, 3_000, 75_000, 16 << 20, 889, mean_prompt_tokens=40_000.0,
                    mean_think_s=20.0)  # fmt: skip
    (line,) = explain([split, shared], sizing, 20.0)
    assert "shared ÷ split at 64 is 1.40" in line and "32,000 computed tokens" in line
    assert "A turn took 28.0 simulated s on split (think 18.0, TTFT 9.0, rest 1.0)" in line
    assert "and 20.0 on shared (think 18.0, TTFT 1.0, rest 1.0)" in line
    assert "that alone gives 1.40" in line and "could give more than 1.56 (think time only)" in line
    table = turn_markdown([split, shared]).splitlines()
    assert table[2] == "| split | 64 | 600 | 300 | 40,000 | 50.0 | 50,000 | 18.00 | 9.00 | 1.00 | 28.00 |"
    assert markdown([shared]).splitlines()[2].startswith(
        "| shared | 64 | 10 | 0 | – | 0.950 | 1.000 | 0.500 | 0.200 | 0.200 | 0.200 | 56,000 | 70.0 |"
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_small_agentic_run_end_to_end(tmp_path):
    trace = tmp_path / "sessions"
    trace.mkdir()
    for name in ("trace_0026.json", "trace_0019.json"):
        shutil.copy(BUNDLED_DIR / name, trace / name)
    has_master = shutil.which("mooncake_master") or _venv_master()
    configs = "gpu,split,shared,pd-split,pd-shared" if has_master else "gpu,split,pd-split"
    out = tmp_path / "out"
    rc = kvgate(
        ["demo", "--scenario", "agentic", "--trace", str(trace), "--out", str(out), "--levels", "2",
         "--max-turns", "3", "--configs", configs, "--no-progress", "--no-plots", "--time-scale", "20",
         "--num-workers", "2", "--sessions-per-slot", "1"]
    )  # fmt: skip
    data = json.loads((out / "agentic.json").read_text())
    rows = {(r["config"], r["level"]): r for r in data["results"]}
    assert sorted(rows) == sorted((c, 2) for c in configs.split(","))
    for r in rows.values():  # one session per slot: no queue, so no steady window (the whole run is measured)
        assert r["requests_ok"] == 6 and r["requests_failed"] == 0
        assert r["steady"]["window_s"] == 0.0 and r["steady"]["mean_ttft_s"] > 0
        total = r["share_gpu"] + r["share_cpu"] + r["share_pool"] + r["share_computed"]
        assert total == pytest.approx(1.0)
        assert r["share_gpu"] + r["share_cpu"] + r["share_pool"] == pytest.approx(r["reuse"])
        assert r["cached_mismatch_ratio"] == 0.0 and r["cached_mismatch_index_ratio"] == 0.0
    assert rows[("gpu", 2)]["share_cpu"] == 0.0 and rows[("gpu", 2)]["share_pool"] == 0.0
    if has_master:  # the prefill side reads what the decode side wrote to the pool: the sessions' whole reuse
        assert rows[("pd-shared", 2)]["share_pool"] > 0.0 and rows[("pd-shared", 2)]["reuse_of_ceiling"] >= 0.97
        assert rows[("pd-shared", 2)]["mean_pool_read_wall_s"] > 0.0
    checks = [line for line in (out / "agentic.md").read_text().splitlines() if line.startswith(("- PASS", "- FAIL"))]
    assert "- PASS no failed request: 0" in checks
    assert rc == (1 if any(line.startswith("- FAIL") for line in checks) else 0)  # any failed check: exit 1


def _venv_master() -> bool:
    import sys
    from pathlib import Path

    return (Path(sys.executable).parent / "mooncake_master").exists()


def test_pd_fleets_wait_for_decode_room_as_long_as_the_client_waits():
    config = AgenticConfig(trace_dir="x", levels=(16, 64), request_timeout_s=90.0)
    assert pd_section(config) == {"protocol": "vllm", "queue_timeout_s": 90.0, "max_waiting": 64}
    PDConfig(**pd_section(config))  # the gateway's own section accepts it


@pytest.mark.parametrize(
    ("extra", "flags"),
    [(["--quick"], "--quick"), (["--pd"], "--pd"), (["--quick", "--max-requests", "50"], "--quick, --max-requests")],
)
def test_conversation_only_flags_are_refused_not_ignored(tmp_path, capsys, extra, flags):
    # without the refusal, `--scenario agentic --quick` silently ran the whole 40-minute default
    out = tmp_path / "out"
    rc = kvgate(["demo", "--scenario", "agentic", "--out", str(out), "--no-progress", *extra])
    printed = " ".join(capsys.readouterr().out.split())
    assert rc == 2 and not out.exists()
    assert printed == (
        f"error: {flags} apply to the conversation scenario only; a short agentic run is "
        "--configs split,shared --levels 16 --max-turns 3"
    )


def test_the_shared_fleets_gateway_watches_the_pool_within_the_masters_lease():
    from loadgen.agentic import POOL_LEASE_MS, pool_watch_section
    from router.pool_watch_config import PoolWatchConfig

    class Master:
        metrics_port = 9003
        lease_ms = POOL_LEASE_MS

    section = pool_watch_section(Master())  # type: ignore[arg-type]
    assert section == {"admin_url": "http://127.0.0.1:9003", "lease_ttl_s": 1.0, "interval_s": 0.5,
                       "entry_ttl_s": 1.0, "decision_check_budget_s": 0.002}  # fmt: skip
    assert msgspec.convert(section, PoolWatchConfig).entry_ttl_s == 1.0  # the gateway accepts it


def test_a_slot_with_no_session_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    rc = kvgate(["demo", "--scenario", "agentic", "--out", str(out), "--no-progress", "--sessions-per-slot", "0"])
    assert rc == 2 and not out.exists()
    assert " ".join(capsys.readouterr().out.split()) == "error: --sessions-per-slot must be at least 1"
