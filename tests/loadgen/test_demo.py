import json
from pathlib import Path

import pytest

from loadgen.demo import AcceptanceCheck, DemoConfig, acceptance, gateway_policy, size_fleet, worker_profile
from loadgen.sessions import derive_sessions
from loadgen.traces import read_mooncake
from router.cli import main as kvgate

TRACE = str(Path(__file__).resolve().parents[2] / "loadgen" / "data" / "conversation_trace_head.jsonl")


@pytest.mark.unit
def test_fleet_sizing_reaches_the_lru_target_and_splits_capacity():
    requests = derive_sessions(read_mooncake(TRACE, max_requests=300))
    config = DemoConfig(trace=TRACE)
    sizing = size_fleet(requests, config)
    assert sizing.fleet_lru.hit_ratio >= 0.97 * sizing.ceiling.hit_ratio
    assert sizing.worker_share_of_distinct < 0.5
    assert sizing.num_gpu_blocks_per_worker * 16 >= 2 * max(r.num_prompt_tokens for r in requests)


@pytest.mark.unit
def test_worker_profile_and_cost_model_share_the_prefill_slowdown():
    from policies.config import CacheAwareConfig
    from workers.config import TimingProfile

    config = DemoConfig(trace=TRACE, prefill_slowdown=2.0)
    timing = worker_profile(config)["timing"]
    assert timing["prefill-s-per-token"] == 2 * TimingProfile().prefill_s_per_token
    assert timing["attention-s-per-token-pair"] == 2 * TimingProfile().attention_s_per_token_pair
    ca = CacheAwareConfig()
    knobs = {"prefill_linear_tokens_per_s": ca.prefill_linear_tokens_per_s / 2,
             "prefill_quadratic_tokens_sq_per_s": ca.prefill_quadratic_tokens_sq_per_s / 2,
             "enable_calibration": False, "max_num_batched_tokens": 8192,
             "long_prefill_token_threshold": 0}  # fmt: skip
    assert gateway_policy("cache_aware", config) == {"name": "cache_aware", **knobs}
    assert gateway_policy("session_sticky+cache_aware", config)["inner"] == {"name": "cache_aware", **knobs}
    assert gateway_policy("round_robin", config) == {"name": "round_robin"}
    assert "scheduler" not in worker_profile(config)


@pytest.mark.unit
def test_worker_profile_and_cost_model_share_the_step_cap():
    config = DemoConfig(trace=TRACE, long_prefill_token_threshold=5242)
    assert worker_profile(config)["scheduler"] == {"long-prefill-token-threshold": 5242}
    inner = gateway_policy("session_sticky+cache_aware", config)["inner"]
    assert (inner["max_num_batched_tokens"], inner["long_prefill_token_threshold"]) == (8192, 5242)


@pytest.mark.unit
def test_acceptance_checks_on_known_summaries():
    from loadgen.report import summarize

    from .builders import make_record

    rr = summarize(
        [make_record(i, worker=f"w{i}", cached=20, predicted=20, ttft=1.0) for i in range(2)],
        policy="round_robin", ceiling_hit_ratio=0.5, duration_s=1.0,
    )  # fmt: skip
    ca = summarize(
        [make_record(i, worker=f"w{i}", cached=50, predicted=50, ttft=0.5) for i in range(2)],
        policy="cache_aware", ceiling_hit_ratio=0.5, duration_s=1.0,
    )  # fmt: skip
    checks = {c.name: (c.value, c.passed) for c in acceptance([rr, ca])}
    assert checks["cache_aware hit ratio ÷ ceiling >= 0.9"] == (1.0, True)
    assert checks["cache_aware ÷ round_robin hit ratio >= 1.5"] == (2.5, True)
    assert checks["cache_aware ÷ round_robin TTFT p50 <= 0.7"] == (0.5, True)
    assert checks["cache_aware load imbalance <= 1.3"] == (1.0, True)
    assert checks["no failed request (all runs)"] == (0.0, True)


def quick_demo_summaries():
    from loadgen.report import summarize

    from .builders import make_record

    rr = summarize(
        [make_record(i, worker=f"w{i % 2}", cached=20, predicted=20, ttft=1.0) for i in range(60)],
        policy="round_robin", ceiling_hit_ratio=0.5, duration_s=1.0,
    )  # fmt: skip
    # one prediction of 60 is wrong: 1/60 = 1.67% mismatch
    ca = summarize(
        [make_record(i, worker=f"w{i % 2}", cached=50, predicted=0 if i == 0 else 50, ttft=0.5) for i in range(60)],
        policy="cache_aware", ceiling_hit_ratio=0.5, duration_s=1.0,
    )  # fmt: skip
    return [rr, ca]


def printed_results(summaries, *, is_quick):
    import io

    from rich.console import Console

    from loadgen.demo import _print_results

    out = io.StringIO()
    _print_results(Console(file=out, width=400), summaries, acceptance(summaries), is_quick=is_quick)
    return out.getvalue().splitlines()


@pytest.mark.unit
def test_checks_print_each_value_in_the_table_unit():
    summaries = quick_demo_summaries()
    checks = {c.name: c for c in acceptance(summaries)}
    mismatch = checks["cache_aware cached-tokens mismatch <= 1%"]
    assert (mismatch.value, mismatch.unit, mismatch.passed) == (1 / 60, "percent", False)
    lines = printed_results(summaries, is_quick=False)
    assert lines[3].startswith("| cache_aware | 60 | 0 | 0 | 0.500 | 1.00 |") and lines[3].endswith("| 1.67% |")
    assert lines[-6:] == [
        "PASS cache_aware hit ratio ÷ ceiling >= 0.9: 1.000",
        "PASS cache_aware ÷ round_robin hit ratio >= 1.5: 2.500",
        "PASS cache_aware ÷ round_robin TTFT p50 <= 0.7: 0.500",
        "PASS cache_aware load imbalance <= 1.3: 1.000",
        "FAIL cache_aware cached-tokens mismatch <= 1%: 1.67%",
        "PASS no failed request (all runs): 0",
    ]


@pytest.mark.unit
def test_quick_run_notes_that_checks_may_fail():
    import argparse

    from loadgen.demo import QUICK_MAX_REQUESTS, QUICK_NOTE, _demo_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = _demo_config(parser.parse_args(["--quick"]))
    assert (config.is_quick, config.max_requests) == (True, QUICK_MAX_REQUESTS)
    assert _demo_config(parser.parse_args([])).is_quick is False
    summaries = quick_demo_summaries()
    assert QUICK_NOTE == (
        "note: the --quick slice has little prefix reuse, so the policies barely differ and some checks are expected "
        "to fail; run without --quick to compare them."
    )
    assert printed_results(summaries, is_quick=True)[-1] == QUICK_NOTE
    assert printed_results(summaries, is_quick=False)[-1].startswith("PASS no failed request")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(150)
def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    rc = kvgate(
        ["demo", "--trace", TRACE, "--out", str(out), "--max-requests", "60", "--num-workers", "2",
         "--policies", "round_robin,cache_aware", "--no-progress", "--time-scale", "10", "--peers", "none"]
    )  # fmt: skip
    data = json.loads((out / "results.json").read_text())
    runs = {r["policy"]: r for r in data["runs"]}
    assert sorted(runs) == ["cache_aware", "round_robin"]
    for run in runs.values():
        assert run["requests_ok"] == 60 and run["requests_failed"] == 0
        assert 0 < run["hit_ratio"] <= run["ceiling_hit_ratio"] + 0.05
        assert run["ttft_p50_s"] > 0 and set(run["requests_by_worker"]) == {"worker-0", "worker-1"}
        assert sum(run["requests_by_worker"].values()) == 60
    assert rc == (0 if all(c["passed"] for c in data["acceptance"]) else 1)  # a failed check fails the demo
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert data["sizing"]["worker_share_of_distinct"] < 0.5


def _summary(label: str, *, cached: int, ttft: float):
    from loadgen.report import summarize

    from .builders import make_record

    return summarize([make_record(i, worker=f"w{i % 2}", cached=cached, predicted=cached, ttft=ttft)
                      for i in range(20)], policy=label, ceiling_hit_ratio=0.5, duration_s=1.0,
                     mismatches_by_cause={"index": 0, "evicted": 1, "late": 0})


@pytest.mark.unit
def test_default_policy_is_held_to_the_best_peer():
    from loadgen.demo import standard_checks

    ours = _summary("session_sticky+cache_aware", cached=49, ttft=0.4)  # hit 0.49 of 0.5: 0.98 of the ceiling
    peer_a = _summary("sglang:cache_aware", cached=50, ttft=0.5)  # 1.00 of the ceiling
    peer_b = _summary("vllm:cache_aware", cached=45, ttft=0.3)
    checks = {c.name: (c.value, c.limit, c.passed) for c in standard_checks([ours, peer_a, peer_b],
                                                                           ["sglang:cache_aware", "vllm:cache_aware"])}
    name = "session_sticky+cache_aware"
    assert checks[f"{name} hit ratio ÷ ceiling >= 0.97"] == (pytest.approx(0.98), 0.97, True)
    assert checks[f"{name} hit ratio ÷ ceiling >= best peer's - 0.01"] == (pytest.approx(0.98), pytest.approx(0.99),
                                                                          False)
    # TTFT is the same for every record of a run: p50 = p99 = its ttft (the records' times are simulated at scale 1).
    assert checks[f"{name} TTFT p50 < every peer's (s)"] == (pytest.approx(0.4), pytest.approx(0.3), False)
    assert checks[f"{name} TTFT p99 < every peer's (s)"] == (pytest.approx(0.4), pytest.approx(0.3), False)
    assert checks[f"{name} cached-token mismatch from a wrong index = 0"] == (0.0, 0.0, True)
    # A peer asked for that did not run (it did not start) fails its own check; the others are still compared.
    missing = {c.name: (c.value, c.passed) for c in standard_checks([ours, peer_b],
                                                                    ["sglang:cache_aware", "vllm:cache_aware"])}
    assert missing["sglang:cache_aware replayed (the default policy is held to its run)"] == (None, False)
    assert missing[f"{name} TTFT p50 < every peer's (s)"] == (pytest.approx(0.4), False)
    assert "vllm:cache_aware replayed (the default policy is held to its run)" not in missing
    # Without peers only the fixed bars apply.
    assert [c.name for c in standard_checks([ours], [])] == [
        f"{name} hit ratio ÷ ceiling >= 0.97", f"{name} cached-token mismatch from a wrong index = 0"]


def test_a_seconds_check_shows_as_many_decimals_as_tell_value_and_limit_apart():
    def shown(value: float, limit: float) -> str:
        return AcceptanceCheck("p50", value, limit, value < limit, unit="seconds").format_value()

    assert shown(0.61, 0.73) == "0.61 (limit 0.73)"
    assert shown(0.8412, 0.8379) == "0.841 (limit 0.838)"  # both 0.84 at two decimals
    assert shown(0.84, 0.84) == "0.8400 (limit 0.8400)"
