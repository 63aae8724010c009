"""Baselines: exact decisions, rankings, and the empty/unhealthy fleet for every policy."""

from __future__ import annotations

import random

import pytest

from policies import Policy, build_policy, decode_policy_config
from policies.config import POLICY_NAMES
from tests.policies.builders import make_fleet, make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit


def build(name: str, **fields: object) -> Policy:
    return build_policy(decode_policy_config({"name": name, **fields}))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_fleet_gives_no_worker(name):
    decision = build(name).select(make_view(session_key="sid:a"), make_snapshot())
    assert decision.worker_id is None
    assert decision.reason == "no_workers"
    assert decision.ranking == ()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_unhealthy_and_draining_fleet_gives_no_worker(name):
    snapshot = make_snapshot(
        make_worker("w0", is_healthy=False),
        make_worker("w1", is_draining=True),
        make_worker("w2", is_healthy=False, is_draining=True, num_gpu_cached_tokens=1024),
    )
    decision = build(name).select(make_view(session_key="sid:a"), snapshot)
    assert decision.worker_id is None
    assert decision.reason == "no_healthy_worker"
    # Every worker drained (one of them unhealthy too): the operator's doing, said so.
    drained = make_snapshot(make_worker("w0", is_draining=True), make_worker("w1", is_healthy=False, is_draining=True))
    assert (build(name).select(make_view(session_key="sid:a"), drained).reason) == "all_workers_draining"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_skips_unhealthy_and_draining(name):
    policy = build(name)
    snapshot = make_snapshot(
        make_worker("w0", is_healthy=False, num_gpu_cached_tokens=1024),
        make_worker("w1", is_draining=True, num_gpu_cached_tokens=1024),
        make_worker("w2", num_running_requests=5),
        make_worker("w3", is_healthy=False),
    )
    for i in range(20):
        decision = policy.select(make_view(session_key=f"sid:{i}"), snapshot)
        assert decision.worker_id == "w2"
        assert decision.ranking == ("w2",)


def test_round_robin_cycles_over_eligible_in_config_order():
    policy = build("round_robin")
    snapshot = make_snapshot(
        make_worker("w0"),
        make_worker("w1", num_gpu_cached_tokens=48),
        make_worker("w2", is_healthy=False),
        make_worker("w3"),
    )
    decisions = [policy.select(make_view(), snapshot) for _ in range(5)]
    assert [d.worker_id for d in decisions] == ["w0", "w1", "w3", "w0", "w1"]
    assert decisions[1].ranking == ("w1", "w3", "w0")
    assert decisions[1].scores == {"w1": 0.0, "w3": 1.0, "w0": 2.0}
    assert decisions[1].predicted_cached_tokens == 48
    assert decisions[1].reason == "round_robin"


def test_random_is_seeded_and_reproducible():
    fleet = make_fleet(5)
    snapshot = make_snapshot(*fleet)
    policy = build("random", seed=11)
    chosen = [policy.select(make_view(), snapshot).worker_id for _ in range(50)]
    reference = random.Random(11)
    assert chosen == [f"w{reference.randrange(5)}" for _ in range(50)]
    other = build("random", seed=12)
    assert [other.select(make_view(), snapshot).worker_id for _ in range(50)] != chosen
    assert len(set(chosen)) == 5


def test_random_ranking_lists_the_rest_in_config_order():
    policy = build("random", seed=3)
    index = random.Random(3).randrange(4)
    decision = policy.select(make_view(), make_snapshot(*make_fleet(4)))
    expected = [f"w{index}"] + [f"w{i}" for i in range(4) if i != index]
    assert decision.ranking == tuple(expected)


def test_least_loaded_orders_by_requests_then_pending_tokens_then_config():
    snapshot = make_snapshot(
        make_worker("w0", num_running_requests=3),
        make_worker("w1", num_running_requests=1, num_waiting_requests=1, num_pending_prefill_tokens=500),
        make_worker("w2", num_running_requests=2, num_pending_prefill_tokens=100, num_gpu_cached_tokens=64),
        make_worker("w3", num_running_requests=2, num_pending_prefill_tokens=100),
        make_worker("w4", num_waiting_requests=4),
    )
    decision = build("least_loaded").select(make_view(), snapshot)
    assert decision.worker_id == "w2"
    assert decision.ranking == ("w2", "w3", "w1", "w0", "w4")
    assert decision.scores == {"w2": 2.0, "w3": 2.0, "w1": 2.0, "w0": 3.0, "w4": 4.0}
    assert decision.predicted_cached_tokens == 64


def test_power_of_two_takes_the_less_loaded_of_two_seeded_draws():
    loads = [7, 1, 4, 9, 2, 5]
    snapshot = make_snapshot(*(make_worker(f"w{i}", num_running_requests=n) for i, n in enumerate(loads)))
    policy = build("power_of_two", seed=5)
    reference = random.Random(5)
    for _ in range(100):
        i, j = reference.sample(range(6), 2)
        expected = i if loads[i] <= loads[j] else j
        other = j if expected == i else i
        decision = policy.select(make_view(), snapshot)
        assert decision.worker_id == f"w{expected}"
        assert decision.ranking[:2] == (f"w{expected}", f"w{other}")
        assert len(decision.ranking) == 6
        assert decision.worker_id != "w3"  # the most loaded worker never wins a pair


def test_power_of_two_single_candidate():
    snapshot = make_snapshot(make_worker("w0", is_healthy=False), make_worker("w1", num_running_requests=3))
    decision = build("power_of_two").select(make_view(), snapshot)
    assert (decision.worker_id, decision.ranking, decision.scores) == ("w1", ("w1",), {"w1": 3.0})
