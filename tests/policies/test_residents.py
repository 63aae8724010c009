"""Resident sessions (``policies/residents.py``) and the memory term of ``cache_aware`` they feed.

Figures are written out from the module docstrings: the memory term is ``min(m, max(0, R + m - C)) / r_lin`` with
``r_lin`` 40,000 tokens/s (the default profile) and ``m`` the request's projected prompt.
"""

from __future__ import annotations

import pytest

from policies import SessionStickyPolicy, build_policy, decode_policy_config
from policies.cache_aware import CacheAwarePolicy
from policies.config import CacheAwareConfig
from policies.residents import GROWTH_ALPHA, SessionResidents
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

R_LIN = 40_000.0


def test_residents_sum_projected_prompts_and_leave_one_session_out():
    r = SessionResidents(idle_s=10.0)
    r.place("a", "w0", 1000, now_s=0.0)
    r.place("b", "w0", 2000, now_s=1.0)
    r.place("c", "w1", 500, now_s=2.0)
    assert r.resident_tokens(2.0) == {"w0": 3000, "w1": 500}  # nothing returned yet: no growth projected
    r.place("a", "w0", 1800, now_s=3.0)  # a returns, 800 tokens longer
    growth = GROWTH_ALPHA * 800
    assert r.growth_tokens_per_turn == pytest.approx(growth)
    assert r.expected_future_turns == pytest.approx(1 / 3)
    g = round(growth / 3)
    assert r.projected_growth_tokens == g
    assert r.resident_tokens(3.0) == {"w0": 3800 + 2 * g, "w1": 500 + g}
    assert r.resident_tokens(3.0, without="a") == {"w0": 2000 + g, "w1": 500 + g}
    r.place("b", "w1", 2100, now_s=4.0)  # b moves to w1
    assert r.resident_tokens(4.0, without="zz") == {"w0": 1800 + r.projected_growth_tokens,
                                                    "w1": 2600 + 2 * r.projected_growth_tokens}
    assert "b" in r and "zz" not in r


def test_forgetting_a_removed_worker_drops_its_sessions_only():
    r = SessionResidents(idle_s=10.0)
    r.place("a", "w0", 1000, now_s=0.0)
    r.place("b", "w1", 2000, now_s=1.0)
    r.place("c", "w0", 500, now_s=2.0)
    assert r.forget_worker("w9") == 0
    assert r.forget_worker("w0") == 2
    assert (r.num_sessions, "a" in r, "c" in r, "b" in r) == (1, False, False, True)
    assert r.resident_tokens(2.0) == {"w1": 2000}
    assert r.forget_worker("w0") == 0
    r.place("a", "w1", 1200, now_s=3.0)  # a session of the removed worker returns: placed afresh, not growth
    assert (r.num_new_sessions, r.num_returning_turns) == (4, 0)
    assert r.resident_tokens(3.0) == {"w1": 3200}


def test_idle_sessions_expire_oldest_first():
    r = SessionResidents(idle_s=10.0)
    r.place("a", "w0", 1000, now_s=0.0)
    r.place("b", "w1", 2000, now_s=5.0)
    assert r.resident_tokens(10.0) == {"w0": 1000, "w1": 2000}
    assert r.resident_tokens(10.5) == {"w1": 2000}  # a unseen for more than 10 s
    assert r.resident_tokens(16.0) == {} and r.num_sessions == 0
    with pytest.raises(ValueError):
        SessionResidents(idle_s=0.0)


@pytest.mark.parametrize(
    ("resident", "capacity", "n", "growth", "expected_s"),
    [
        (0, 0, 4096, 0, 0.0),  # capacity unknown
        (10_000, 16_384, 4096, 0, 0.0),  # fits
        (14_000, 16_384, 4096, 0, (14_000 + 4096 - 16_384) / R_LIN),  # 1,712 tokens evicted
        (14_000, 16_384, 4096, 2000, (14_000 + 6096 - 16_384) / R_LIN),  # its own growth counted
        (40_000, 16_384, 4096, 0, 4096 / R_LIN),  # already over: its own projected prompt at most
    ],
)
def test_memory_term_is_the_overflow_recomputed(resident, capacity, n, growth, expected_s):
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    worker = make_worker("w0", num_gpu_capacity_tokens=capacity, num_resident_tokens=resident)
    assert policy.memory_s(worker, n + growth) == pytest.approx(expected_s, abs=1e-12)
    view = make_view(n)
    terms = policy.cost_terms(view, make_snapshot(worker))["w0"]
    if growth == 0:
        assert terms.memory_penalty_s == pytest.approx(expected_s, abs=1e-12)
        assert terms.cost_s == pytest.approx(terms.ttft_s + terms.recompute_penalty_s + terms.decode_load_penalty_s
                                             + expected_s)


def test_memory_term_spreads_a_session_off_a_full_worker():
    # Both idle and cold; w0 already holds 15,000 tokens of live sessions in 16,384: the new prompt of 4,096 would
    # evict 2,712 of theirs (0.0678 s), so w1 takes it although configuration order prefers w0.
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    full = make_worker("w0", num_gpu_capacity_tokens=16_384, num_resident_tokens=15_000)
    empty = make_worker("w1", num_gpu_capacity_tokens=16_384)
    assert policy.select(make_view(4096), make_snapshot(full, empty)).worker_id == "w1"
    assert policy.select(make_view(4096), make_snapshot(make_worker("w0", num_gpu_capacity_tokens=16_384),
                                                        empty)).worker_id == "w0"


def test_a_new_session_is_ranked_without_the_recompute_penalty_of_a_shared_head():
    # w0 holds a 2,048-token shared head behind 4,000 queued tokens (0.1 s); w1 is idle and cold. A returning
    # turn pays 3x the head's prefill elsewhere (ttft + 2x penalty) and stays; a new session pays it once: w1.
    sticky = build_policy(decode_policy_config({"name": "session_sticky", "inner": {"name": "cache_aware",
                                                                                      "enable_calibration": False}}))
    assert isinstance(sticky, SessionStickyPolicy)
    head = make_worker("w0", num_gpu_cached_tokens=2048, num_pending_prefill_tokens=4000)
    cold = make_worker("w1")
    snapshot = make_snapshot(head, cold)
    view = make_view(4096, session_key="sid:new")
    assert sticky.select_inner(view, snapshot).worker_id == "w1"
    sticky.residents.place("sid:new", "w1", 4096, now_s=0.0)
    assert sticky.select_inner(view, snapshot).worker_id == "w0"  # placed now: its cached tokens are its own
