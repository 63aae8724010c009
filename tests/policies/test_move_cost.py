"""session_sticky's move rule (``policies/move_cost.py``): the recompute a move costs, the fleet's tail, scenarios.

The recompute is written out from the module docstring with the default profile (``r_lin`` 40,000 tokens/s,
``r_quad`` 2.435e9 tokens**2/s), independently of the code.
"""

from __future__ import annotations

import pytest

from policies import SessionStickyPolicy, build_policy, decode_policy_config
from policies.config import CacheAwareConfig
from policies.cost_model import TTFTCostModel
from policies.move_cost import MIN_TAIL_DECISIONS, SessionMoveCost
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

R_LIN, R_QUAD = 40_000.0, 2.435e9


def recompute_s(k_best: int, k_owner: int) -> float:
    return (k_owner - k_best) / R_LIN + (k_owner**2 - k_best**2) / R_QUAD


def move_cost(speed: float = 1.0, window: int = 1024, quantile: float = 1.0) -> SessionMoveCost:
    return SessionMoveCost(TTFTCostModel(CacheAwareConfig()), lambda _: speed, tail_window=window,
                           tail_quantile=quantile)


@pytest.mark.parametrize(
    ("n", "k_owner", "k_best", "speed", "expected"),
    [
        (8192, 4096, 0, 1.0, recompute_s(0, 4096)),  # 0.1024 + 0.00689 s
        (8192, 4096, 1024, 1.0, recompute_s(1024, 4096)),
        (8192, 4096, 1024, 2.0, 2.0 * recompute_s(1024, 4096)),  # the alternative's speed factor
        (2048, 4096, 0, 1.0, recompute_s(0, 2048)),  # capped at the prompt
        (8192, 1024, 4096, 1.0, 0.0),  # the alternative holds more: nothing lost
        (8192, 4096, 4096, 1.0, 0.0),
    ],
)
def test_lost_s_is_the_alternatives_recompute_of_what_the_owner_holds(n, k_owner, k_best, speed, expected):
    rule = move_cost(speed)
    owner = make_worker("owner", num_gpu_cached_tokens=k_owner)
    best = make_worker("best", num_gpu_cached_tokens=k_best)
    assert rule.lost_s(n, owner, best) == pytest.approx(expected, rel=1e-12)


def test_lost_s_counts_every_tier():
    rule = move_cost()
    owner = make_worker("owner", num_gpu_cached_tokens=1024, num_cpu_cached_tokens=1024, num_pool_cached_tokens=2048)
    assert rule.lost_s(8192, owner, make_worker("best")) == pytest.approx(recompute_s(0, 4096), rel=1e-12)


def test_tail_is_the_window_quantile_and_the_maximum_below_min_decisions():
    rule = move_cost(window=1000)
    assert rule.tail_s() == 0.0
    for i in range(MIN_TAIL_DECISIONS - 1):
        rule.observe(float(i), is_new=True)
    assert rule.tail_s() == float(MIN_TAIL_DECISIONS - 2)  # the maximum
    rule = move_cost(window=1000, quantile=0.99)
    default = move_cost(window=1000)  # the default quantile, 1.0: the window's maximum
    for i in range(1, 1001):
        rule.observe(float(i), is_new=i % 4 == 0)
        default.observe(float(i))
    assert rule.tail_s() == 990.0  # the 990th of 1..1000
    assert default.tail_s() == 1000.0
    rule.observe(5000.0, is_new=False)  # the window slides: 2..1000, 5000
    default.observe(999.5)
    assert rule.tail_s() == 991.0
    assert default.tail_s() == 1000.0  # 2..1000, 999.5
    rule.observe(None, is_new=False)
    assert (rule.num_new_sessions, rule.num_returning_turns) == (250, 752)
    assert rule.expected_future_turns == pytest.approx(752 / 250)


# (case, owner ttft, best ttft, owner cached, best cached, tail values, moves)
SCENARIOS = [
    ("gain below the recompute: stays", 0.105, 0.0, 4096, 0, [], False),
    ("gain above the recompute, no tail yet: moves", 0.2, 0.0, 4096, 0, [], True),
    ("gain above the recompute, owner within the fleet's tail: stays", 2.5, 0.1, 4096, 0, [3.0] * 200, False),
    ("gain above the recompute, owner past the fleet's tail: moves", 3.5, 0.1, 4096, 0, [3.0] * 200, True),
    ("nothing to recompute, any gain: moves", 0.2, 0.1, 1024, 4096, [3.0] * 200, True),
    ("nothing to recompute, no gain: stays", 0.1, 0.1, 4096, 4096, [], False),
]


@pytest.mark.parametrize(("owner_s", "best_s", "k_owner", "k_best", "tail", "moves"), [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_moves(owner_s, best_s, k_owner, k_best, tail, moves):
    rule = move_cost()
    for value in tail:
        rule.observe(value, is_new=False)
    owner = make_worker("owner", num_gpu_cached_tokens=k_owner)
    best = make_worker("best", num_gpu_cached_tokens=k_best)
    assert rule.moves(8192, owner, best, owner_s, best_s) is moves


def test_sticky_keeps_a_busy_owner_within_the_tail_and_moves_past_it():
    policy = build_policy(decode_policy_config({"name": "session_sticky"}))
    assert isinstance(policy, SessionStickyPolicy) and policy.move_cost is not None
    rule = policy.move_cost
    view = make_view(8192, session_key="sid:s")
    # The owner holds 4,096 tokens behind 80,000 queued prefill tokens (2.0 s); the other worker is idle and cold.
    snapshot = make_snapshot(make_worker("owner", num_gpu_cached_tokens=4096, num_pending_prefill_tokens=80_000),
                             make_worker("other"), session_owner="owner")
    for _ in range(200):
        rule.observe(3.0, is_new=True)  # the fleet's recent estimates: 3.0 s
    decision = policy.select(view, snapshot)
    assert (decision.worker_id, decision.reason) == ("owner", "sticky")
    assert rule.num_stays_priced == 1
    for _ in range(1024):
        rule.observe(1.0, is_new=True)  # now the fleet delivers 1.0 s: the owner's 2.1 s is past its tail
    decision = policy.select(view, snapshot)
    assert (decision.worker_id, decision.reason, decision.detail) == ("other", "sticky_moved", "owner_costlier")
    assert rule.num_moves_priced == 1


def test_price_moves_off_uses_the_margins_only():
    policy = build_policy(decode_policy_config({"name": "session_sticky", "price_moves": False,
                                                "max_extra_ttft_s": 0.5, "max_ttft_ratio": 2.0}))
    assert isinstance(policy, SessionStickyPolicy) and policy.move_cost is None
    snapshot = make_snapshot(make_worker("owner", num_gpu_cached_tokens=4096, num_pending_prefill_tokens=80_000),
                             make_worker("other"), session_owner="owner")
    decision = policy.select(make_view(8192, session_key="sid:s"), snapshot)
    assert (decision.worker_id, decision.reason) == ("other", "sticky_moved")
