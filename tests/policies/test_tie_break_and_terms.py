"""cache_aware's tie-break (load, then resident session tokens, then recent assignments, then configuration order) and
its cost terms, each against values written out from the module docstrings."""

from __future__ import annotations

import pytest

from policies import CacheAwareConfig, CacheAwarePolicy, SessionStickyConfig, build_policy, cost_terms
from policies.base import Snapshot
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

R_LIN = 40_000.0
R_QUAD = 2.435e9
OVERHEAD_S = 0.003
KV_READ_S_PER_TOKEN = 131_072 / 4.0e12
DECODE_S_PER_SEQUENCE = 2.0e-5


def test_idle_fleet_ties_go_to_the_session_worker_given_least_lately():
    workers = [make_worker(f"w{i}", num_recent_assignments=n) for i, n in enumerate((3, 1, 0, 2))]
    decision = CacheAwarePolicy(CacheAwareConfig()).select(make_view(2048), make_snapshot(*workers))
    assert decision.worker_id == "w2"
    assert decision.ranking == ("w2", "w1", "w3", "w0")


def test_ties_prefer_the_lighter_load_before_recent_assignments():
    # Equal costs need equal queue terms: one waiting request costs 5 ms, 200 pending tokens 200 / 40,000 = 5 ms.
    workers = [
        make_worker("w0", num_waiting_requests=1, num_recent_assignments=0),
        make_worker("w1", num_pending_prefill_tokens=200, num_recent_assignments=5),
    ]
    policy = CacheAwarePolicy(CacheAwareConfig(decode_penalty=0.0))
    decision = policy.select(make_view(2048), make_snapshot(*workers))
    assert decision.scores["w0"] == pytest.approx(decision.scores["w1"], abs=1e-9)
    # w0 has 1 waiting request, w1 none: w1 is lighter by running + waiting, though given more lately.
    assert decision.ranking == ("w1", "w0")


def test_ties_prefer_fewer_resident_session_tokens_before_recent_assignments():
    # An idle fleet with room for every session (no capacity known: no memory term): equal costs. w0 owns 8192 tokens
    # of live sessions, w1 4096, w2 none but was given 3 sessions lately, w3 4096 and given 1.
    workers = [make_worker("w0", num_resident_tokens=8192), make_worker("w1", num_resident_tokens=4096),
               make_worker("w2", num_recent_assignments=3),
               make_worker("w3", num_resident_tokens=4096, num_recent_assignments=1)]
    decision = CacheAwarePolicy(CacheAwareConfig()).select(make_view(2048), make_snapshot(*workers))
    assert len(set(decision.scores.values())) == 1
    assert decision.ranking == ("w2", "w1", "w3", "w0")


def test_cold_sessions_spread_over_an_idle_fleet_through_the_router_counts():
    from router.decisions import RecentAssignments

    recent = RecentAssignments(num_per_worker=4)
    policy = CacheAwarePolicy(CacheAwareConfig())
    chosen = []
    for i in range(8):
        snapshot = make_snapshot(*(make_worker(f"w{j}", num_recent_assignments=recent.counts.get(f"w{j}", 0))
                                   for j in range(4)))
        worker_id = policy.select(make_view(4096, request_id=f"r{i}"), snapshot).worker_id
        assert worker_id is not None
        recent.add(worker_id, 4)
        chosen.append(worker_id)
    assert chosen == ["w0", "w1", "w2", "w3", "w0", "w1", "w2", "w3"]


def test_recent_assignments_forget_past_their_window():
    from router.decisions import RecentAssignments

    recent = RecentAssignments(num_per_worker=2)
    for worker_id in ("a", "a", "b", "a", "c"):
        recent.add(worker_id, 2)  # window 2 * 2 = 4 decisions
    assert recent.counts == {"a": 2, "b": 1, "c": 1}
    recent.add("c", 2)
    recent.add("c", 2)
    assert recent.counts == {"a": 1, "c": 3}


def test_cost_terms_add_up_to_the_ranking_cost():
    n, k, pending, running, inflight = 8192, 4096, 1000, 2, 3000
    worker = make_worker("w0", num_gpu_cached_tokens=k, num_pending_prefill_tokens=pending,
                         num_running_requests=running, num_inflight_prompt_tokens=inflight)
    view = make_view(n)  # max_tokens 128
    terms = CacheAwarePolicy(CacheAwareConfig()).cost_terms(view, make_snapshot(worker))["w0"]
    queue = pending / R_LIN + running * 0.001
    prefill = (n - k) / R_LIN + (n * n - k * k) / R_QUAD
    steps = 128
    decode = steps * (running * (2 * DECODE_S_PER_SEQUENCE + n * KV_READ_S_PER_TOKEN) + inflight * KV_READ_S_PER_TOKEN)
    assert terms.queue_s == pytest.approx(queue)
    assert terms.prefill_s == pytest.approx(prefill)
    assert terms.restore_s == 0.0
    assert terms.ttft_s == pytest.approx(OVERHEAD_S + queue + prefill)
    assert terms.recompute_penalty_s == pytest.approx(2.0 * prefill)
    assert terms.decode_load_penalty_s == pytest.approx(decode)
    assert terms.cost_s == pytest.approx(OVERHEAD_S + queue + 3.0 * prefill + decode)
    assert terms.num_computed_tokens == n - k and not terms.is_saturated


def test_cost_terms_reach_through_session_sticky_and_are_empty_for_baselines():
    snapshot = Snapshot((make_worker("w0"), make_worker("w1", num_gpu_cached_tokens=1024)))
    sticky = build_policy(SessionStickyConfig())
    terms = cost_terms(sticky, make_view(2048), snapshot)
    assert sorted(terms) == ["w0", "w1"]
    assert terms["w1"].num_computed_tokens == 1024
    from policies.config import RoundRobinConfig

    assert cost_terms(build_policy(RoundRobinConfig()), make_view(2048), snapshot) == {}

