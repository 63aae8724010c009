"""Online TTFT correction: a worker twice slower than its profile is learned, and traffic moves off it."""

from __future__ import annotations

import math
import random

import pytest

from policies import CacheAwareConfig, CacheAwarePolicy, TTFTCalibrator
from tests.policies.builders import make_snapshot, make_view, make_worker
from workers.config import TimingProfile

pytestmark = pytest.mark.unit


def shown_ttft_s(profile: TimingProfile, slowdown: float, num_prompt_tokens: int, num_cached_tokens: int) -> float:
    """TTFT an idle sim worker shows: one prefill step over positions cached..n (``workers.config.TimingProfile``),
    every coefficient multiplied by ``slowdown``. Its linear/quadratic split differs from the router's profile, so
    the calibrator must cope with a model that is not its own."""
    n, k = num_prompt_tokens, num_cached_tokens
    num_pairs = (n * (n + 1) - k * (k + 1)) / 2
    return slowdown * (
        profile.step_overhead_s + (n - k) * profile.prefill_s_per_token + num_pairs * profile.attention_s_per_token_pair
    )


def test_twice_slower_worker_is_learned_within_20_percent_and_traffic_moves_away():
    profile = TimingProfile()
    policy = CacheAwarePolicy(CacheAwareConfig())
    calibrator = policy.calibrator
    assert calibrator is not None
    rng = random.Random(1)
    errors = []
    # Phase 1: "slow" holds most of each prompt, so it wins even at 2x; every request teaches the calibrator.
    for i in range(10):
        n = rng.randrange(12_288, 20_480)
        k_slow = n - rng.randrange(512, 2048)
        snapshot = make_snapshot(make_worker("slow", num_gpu_cached_tokens=k_slow), make_worker("fast"))
        decision = policy.select(make_view(n, request_id=f"r{i}"), snapshot)
        assert decision.worker_id == "slow"
        predicted = decision.scores["slow"]
        observed = shown_ttft_s(profile, 2.0, n, k_slow)
        errors.append(abs(predicted / observed - 1.0))
        assert calibrator.observe("slow", predicted, observed, speed_factor_used=calibrator.speed_factor("slow"))
    assert errors[0] > 0.4
    assert max(errors[5:]) < 0.2  # bounded: within 20 % from the 6th request on
    assert 1.8 < calibrator.speed_factor("slow") < 2.6
    assert calibrator.speed_factor("fast") == 1.0
    # Phase 2: a prompt where "slow" holds a modest prefix. As profiled it would win; as learned it loses.
    n, k_slow = 8192, 2048
    snapshot = make_snapshot(make_worker("slow", num_gpu_cached_tokens=k_slow), make_worker("fast"))
    naive = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False)).select(make_view(n), snapshot)
    assert naive.worker_id == "slow"
    decision = policy.select(make_view(n), snapshot)
    assert decision.worker_id == "fast"
    assert decision.ranking == ("fast", "slow")
    assert shown_ttft_s(profile, 1.0, n, 0) < shown_ttft_s(profile, 2.0, n, k_slow)  # and that is right


def test_fast_worker_on_profile_stays_near_one():
    profile = TimingProfile()
    policy = CacheAwarePolicy(CacheAwareConfig())
    calibrator = policy.calibrator
    assert calibrator is not None
    for n in range(4096, 32_769, 4096):
        decision = policy.select(make_view(n), make_snapshot(make_worker("w0")))
        calibrator.observe("w0", decision.scores["w0"], shown_ttft_s(profile, 1.0, n, 0))
    assert 0.9 < calibrator.speed_factor("w0") < 1.1


def test_observation_math_is_the_documented_ewma():
    config = CacheAwareConfig(calibration_alpha=0.5, overhead_s=0.01)
    calibrator = TTFTCalibrator(config)
    assert calibrator.observe("w0", predicted_ttft_s=0.11, observed_ttft_s=0.41)  # sample 4.0
    assert calibrator.speed_factor("w0") == pytest.approx(2.0)  # exp(0.5 * log 4)
    # predicted with factor 2 -> unscaled work 0.1; observed 0.41 -> sample 4 again
    assert calibrator.observe("w0", predicted_ttft_s=0.21, observed_ttft_s=0.41, speed_factor_used=2.0)
    assert calibrator.speed_factor("w0") == pytest.approx(math.exp(0.75 * math.log(4.0)))
    assert calibrator.num_observations == 2


def test_factor_is_bounded():
    calibrator = TTFTCalibrator(CacheAwareConfig(calibration_alpha=1.0, min_speed_factor=0.5, max_speed_factor=3.0))
    calibrator.observe("w0", 0.103, 100.0)
    assert calibrator.speed_factor("w0") == pytest.approx(3.0)
    calibrator.observe("w0", 0.303, 0.0)  # faster than the overhead: clamped to the minimum
    assert calibrator.speed_factor("w0") == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("predicted", "observed", "used"),
    [(math.nan, 1.0, None), (1.0, math.inf, None), (-1.0, 1.0, None), (1.0, -0.5, None), (1.0, 1.0, 0.0)],
)
def test_bad_measurements_are_rejected_counted_and_change_nothing(predicted, observed, used, caplog):
    calibrator = TTFTCalibrator(CacheAwareConfig())
    assert not calibrator.observe("w0", predicted, observed, speed_factor_used=used)
    assert calibrator.num_rejected == 1
    assert calibrator.speed_factors() == {}
    assert "ttft observation rejected" in caplog.text


def test_tiny_work_is_skipped():
    calibrator = TTFTCalibrator(CacheAwareConfig(min_calibration_work_s=0.01))
    assert not calibrator.observe("w0", predicted_ttft_s=0.008, observed_ttft_s=0.5)
    assert (calibrator.num_skipped, calibrator.speed_factors()) == (1, {})


def test_forget_and_initial_factors():
    calibrator = TTFTCalibrator(CacheAwareConfig(max_speed_factor=4.0), {"w0": 2.0, "w1": 100.0, "w2": math.nan})
    assert calibrator.speed_factors() == pytest.approx({"w0": 2.0, "w1": 4.0})
    calibrator.forget("w0")
    assert calibrator.speed_factor("w0") == 1.0


def test_select_applies_the_learned_factor_exactly_as_explain_does():
    policy = CacheAwarePolicy(CacheAwareConfig(calibration_alpha=1.0))
    assert policy.calibrator is not None
    policy.calibrator.observe("w0", predicted_ttft_s=0.103, observed_ttft_s=0.303)  # factor 3
    view, snapshot = make_view(4096), make_snapshot(make_worker("w0", num_cpu_cached_tokens=1024), make_worker("w1"))
    decision = policy.select(view, snapshot)
    explained = policy.explain(view, snapshot)
    assert explained["w0"].speed_factor == pytest.approx(3.0)
    assert decision.scores == pytest.approx({w: b.ttft_s for w, b in explained.items()}, rel=1e-12)
    assert decision.scores["w0"] == pytest.approx(0.003 + 3.0 * policy.cost_model.work_s(snapshot.workers[0], 4096))
