"""session_sticky's move rule (``policies/move_cost.py``): the recompute a move costs, the fleet's tail (the p99 of
the estimates of the requests served), scenarios.

The recompute is written out from the module docstring with the default profile (``r_lin`` 40,000 tokens/s,
``r_quad`` 2.435e9 tokens**2/s), independently of the code.
"""

from __future__ import annotations

import pytest

from policies import SessionStickyPolicy, build_policy, decode_policy_config
from policies.config import CacheAwareConfig
from policies.cost_model import TTFTCostModel
from policies.move_cost import SessionMoveCost, interpolated_quantile
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

R_LIN, R_QUAD = 40_000.0, 2.435e9


def recompute_s(k_best: int, k_owner: int) -> float:
    return (k_owner - k_best) / R_LIN + (k_owner**2 - k_best**2) / R_QUAD


def move_cost(speed: float = 1.0, window: int = 1024, quantile: float = 0.99) -> SessionMoveCost:
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


@pytest.mark.parametrize(
    ("values", "quantile", "expected"),
    [
        ([], 0.99, 0.0),
        ([7.0], 0.99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),  # position 1.5
        ([float(i) for i in range(101)], 0.99, 99.0),  # position 99
        ([1.0] * 99 + [16.6], 0.99, 1.0 + 0.01 * 15.6),  # position 98.01: one long cold prefill barely counts
        ([1.0, 5.0, 9.0], 1.0, 9.0),
    ],
)
def test_interpolated_quantile_is_numpys_linear_percentile(values, quantile, expected):
    assert interpolated_quantile(values, quantile) == pytest.approx(expected, rel=1e-12)


def test_tail_is_the_quantile_of_the_requests_served_by_the_clock():
    rule = move_cost(window=1000)
    assert rule.tail_s() == 0.0
    maximum = move_cost(window=1000, quantile=1.0)
    for i in range(1, 1001):
        rule.observe(float(i), is_new=i % 4 == 0)
        maximum.observe(float(i))
    assert rule.tail_s() == pytest.approx(990.01)  # position 0.99 * 999 of 1..1000
    assert maximum.tail_s() == 1000.0
    rule.observe(5000.0, is_new=False)  # the window slides: 2..1000, 5000
    maximum.observe(999.5)
    assert rule.tail_s() == pytest.approx(991.01)
    assert maximum.tail_s() == 1000.0  # 2..1000, 999.5
    rule.observe(None, is_new=False)
    assert (rule.num_new_sessions, rule.num_returning_turns) == (250, 752)
    assert rule.expected_future_turns == pytest.approx(752 / 250)
    # Decided at clock 100 s: 2 s served at 102 s, 9 s at 109 s.
    served = move_cost(quantile=1.0)
    served.observe(2.0, clock_s=100.0)
    served.observe(9.0, clock_s=100.0)
    assert [served.tail_s(t) for t in (101.9, 102.0, 108.9, 109.0)] == [0.0, 2.0, 2.0, 9.0]


def test_a_short_turn_behind_a_long_cold_prefill_moves():
    """The agentic replay's case (module docstring): a 16,842-token turn whose owner holds 16,512 of its tokens
    behind a 123,058-token cold prefill admitted at this instant (clock 100 s); the other worker is idle and cold.
    The fleet served 99 requests at 1.0 s and one 128K cold prefill at 16.6 s; the pending prefill's own estimate
    (9.3 s, not served yet) is in the window too."""
    policy = build_policy(decode_policy_config({"name": "session_sticky"}))
    assert isinstance(policy, SessionStickyPolicy) and policy.move_cost is not None
    rule = policy.move_cost
    for _ in range(99):
        rule.observe(1.0, is_new=False, clock_s=10.0)
    rule.observe(16.6, is_new=True, clock_s=20.0)
    rule.observe(9.3, is_new=True, clock_s=100.0)
    blocker = 123_058 / R_LIN + 123_058**2 / R_QUAD  # 9.2955 s of queued prefill
    owner = make_worker("owner", num_gpu_cached_tokens=16_512, num_pending_prefill_tokens=123_058,
                        num_pending_prefill_token_pairs=123_058**2, pending_prefills=((100.0, 123_058, 123_058**2),),
                        clock_s=100.0)
    idle = make_worker("idle", clock_s=100.0)
    decision = policy.select(make_view(16_842, session_key="sid:s"), make_snapshot(owner, idle, session_owner="owner"))
    own_prefill = (16_842 - 16_512) / R_LIN + (16_842**2 - 16_512**2) / R_QUAD
    assert decision.scores["owner"] == pytest.approx(0.003 + blocker + own_prefill, rel=1e-9)  # 9.3113 s
    assert decision.scores["idle"] == pytest.approx(0.003 + recompute_s(0, 16_842), rel=1e-9)  # 0.5405 s
    assert rule.tail_s(100.0) == pytest.approx(1.0 + 0.01 * 15.6)  # the 99 at 1.0 s and the 16.6 s; 9.3 s pending
    assert (decision.worker_id, decision.reason, decision.detail) == ("idle", "sticky_moved", "owner_costlier")
    assert rule.num_moves_priced == 1
    # The decision joined the window, served 0.5405 s after it on the chosen worker's clock: then the p99 of 101.
    assert rule.tail_s(100.54) == pytest.approx(1.0 + 0.01 * 15.6)
    assert rule.tail_s(100.55) == 1.0  # position 99 of 0.5405, 99 x 1.0, 16.6
    # The rule as it was (the maximum of every estimate in the window): 16.6 s, so the turn waited behind the prefill.
    old = build_policy(decode_policy_config({"name": "session_sticky", "move_tail_quantile": 1.0}))
    assert isinstance(old, SessionStickyPolicy) and old.move_cost is not None
    for _ in range(99):
        old.move_cost.observe(1.0, is_new=False, clock_s=10.0)
    old.move_cost.observe(16.6, is_new=True, clock_s=20.0)
    kept = old.select(make_view(16_842, session_key="sid:s"), make_snapshot(owner, idle, session_owner="owner"))
    assert (kept.worker_id, kept.reason) == ("owner", "sticky")


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
    owner = make_worker("owner", num_gpu_cached_tokens=k_owner, clock_s=10.0)  # the tail values are served by 10 s
    best = make_worker("best", num_gpu_cached_tokens=k_best, clock_s=10.0)
    assert rule.moves(8192, owner, best, owner_s, best_s) is moves


def test_sticky_keeps_a_busy_owner_within_the_tail_and_moves_past_it():
    policy = build_policy(decode_policy_config({"name": "session_sticky"}))
    assert isinstance(policy, SessionStickyPolicy) and policy.move_cost is not None
    rule = policy.move_cost
    view = make_view(8192, session_key="sid:s")
    # The owner holds 4,096 tokens behind 80,000 queued prefill tokens (2.0 s); the other worker is idle and cold.
    snapshot = make_snapshot(make_worker("owner", num_gpu_cached_tokens=4096, num_pending_prefill_tokens=80_000,
                                         clock_s=10.0), make_worker("other", clock_s=10.0), session_owner="owner")
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
