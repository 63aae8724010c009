"""Returning sessions (``policies/returning.py``) and the charge ``cache_aware`` adds for the turns a new session's
prefill holds up.

Figures are written out from the module docstrings: prefill of ``n`` uncached tokens is ``n / 40,000 + n**2 /
2.435e9`` seconds (the default profile), the overhead 3 ms, and the charge ``p * sum(min(prefill, max(0, ttft -
r)))`` over the worker's sessions expected back in ``r`` seconds, ``p = F / (1 + F)``.
"""

from __future__ import annotations

import msgspec
import pytest

from policies import SessionStickyPolicy, build_policy, decode_policy_config
from policies.base import Snapshot
from policies.cache_aware import CacheAwarePolicy
from policies.config import CacheAwareConfig, SessionStickyConfig
from policies.returning import ReturningSessions, return_probability, returning_charge_s, returning_delay_s
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

N_COLD = 32_768
PREFILL_COLD_S = N_COLD / 40_000.0 + N_COLD**2 / 2.435e9
TTFT_COLD_S = 0.003 + PREFILL_COLD_S


def test_delay_is_the_part_of_the_prefill_still_running_when_each_turn_arrives():
    # ttft 3.0 s, own prefill 2.5 s (0.5 s of queue ahead): a turn due now waits all 2.5 s, one due in 1 s waits
    # the 2.0 s left, one due in 5 s waits nothing.
    assert returning_delay_s((0.0, 1.0, 5.0), 3.0, 2.5) == pytest.approx(4.5)
    assert returning_delay_s((), 3.0, 2.5) == 0.0
    assert returning_delay_s((3.0,), 3.0, 2.5) == 0.0


def test_return_probability_is_f_over_one_plus_f():
    assert return_probability(4, 12) == pytest.approx(0.75)  # F = 3 turns per session
    assert return_probability(3, 1) == pytest.approx(0.25)
    assert return_probability(0, 0) == 0.0


def test_sessions_are_expected_back_after_their_own_gap_or_the_fleets():
    r = ReturningSessions(idle_s=100.0)
    workers = (make_worker("w0", clock_s=2.5), make_worker("w1", clock_s=2.5))
    r.place("a", "w0", clock_s=0.0, now_s=0.0)
    r.place("b", "w1", clock_s=1.0, now_s=1.0)
    assert r.returning_in_s(workers) == {}  # no gap measured yet: nothing is charged
    r.place("a", "w0", clock_s=2.0, now_s=2.0)  # a's first gap: 2.0 s
    assert r.mean_gap_s == pytest.approx(2.0)
    # a: its own gap 2.0, placed 0.5 s ago -> back in 1.5 s; b: the fleet's gap 2.0, placed 1.5 s ago -> 0.5 s.
    assert r.returning_in_s(workers) == {"w0": pytest.approx((1.5,)), "w1": pytest.approx((0.5,))}
    assert r.returning_in_s(workers, without="a") == {"w1": pytest.approx((0.5,))}
    later = (make_worker("w0", clock_s=3.5), make_worker("w1", clock_s=3.5))
    # b is 2.5 s old, beyond the longest gap seen (2.0 s): left out; a is back in 0.5 s.
    assert r.returning_in_s(later) == {"w0": pytest.approx((0.5,))}
    r.place("b", "w1", clock_s=4.0, now_s=4.0)  # b's gap: 3.0 s, the longest now
    # At 5.0 a (own gap 2.0) is 3.0 s old: overdue, back any moment; b (own gap 3.0) is back in 2.0 s.
    at_5 = (make_worker("w0", clock_s=5.0), make_worker("w1", clock_s=5.0))
    assert r.returning_in_s(at_5) == {"w0": (0.0,), "w1": pytest.approx((2.0,))}
    assert r.forget_worker("w0") == 1 and "a" not in r and "b" in r


def test_sessions_unplaced_for_idle_s_are_forgotten():
    r = ReturningSessions(idle_s=10.0)
    r.place("a", "w0", clock_s=0.0, now_s=0.0)
    r.place("b", "w0", clock_s=5.0, now_s=5.0)
    r.place("c", "w1", clock_s=11.0, now_s=11.0)
    assert ("a" in r, "b" in r, "c" in r) == (False, True, True)


def test_cold_long_prefill_goes_to_the_worker_with_fewer_returning_sessions():
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    view = msgspec.structs.replace(make_view(N_COLD, session_key="new"), is_new_session=True,
                                   session_return_probability=0.75)
    snapshot = make_snapshot(make_worker("w0", returning_in_s=(0.2, 0.5)), make_worker("w1", returning_in_s=(0.5,)))
    decision = policy.select(view, snapshot)
    assert (decision.worker_id, decision.ranking) == ("w1", ("w1", "w0"))
    assert decision.scores == {"w0": pytest.approx(TTFT_COLD_S), "w1": pytest.approx(TTFT_COLD_S)}
    terms = policy.cost_terms(view, snapshot)
    charge_w0 = 0.75 * ((TTFT_COLD_S - 0.2) + (TTFT_COLD_S - 0.5))
    charge_w1 = 0.75 * (TTFT_COLD_S - 0.5)
    assert terms["w0"].returning_penalty_s == pytest.approx(charge_w0)
    assert terms["w1"].returning_penalty_s == pytest.approx(charge_w1)
    assert terms["w1"].cost_s == pytest.approx(TTFT_COLD_S + charge_w1)
    # Without the weight (no session has returned yet) nothing is charged: the tie goes to configuration order.
    plain = msgspec.structs.replace(view, session_return_probability=0.0)
    assert policy.select(plain, snapshot).worker_id == "w0"
    # A queue ahead outweighs the charge: w1 with 2 s of pending prefill loses to w0 with two returning sessions.
    busy = make_snapshot(make_worker("w0", returning_in_s=(0.2, 0.5)),
                         make_worker("w1", returning_in_s=(0.5,), num_pending_prefill_tokens=80_000))
    assert policy.select(view, busy).worker_id == "w0"


N_LONG_COLD = 106_000
PREFILL_LONG_COLD_S = N_LONG_COLD / 40_000.0 + N_LONG_COLD**2 / 2.435e9
N_SHORT_COLD = 8192
PREFILL_SHORT_COLD_S = N_SHORT_COLD / 40_000.0 + N_SHORT_COLD**2 / 2.435e9


def _twenty_returning_on_w0_and_a_queue_on_w1() -> Snapshot:
    """w0 idle with 20 sessions due back now; w1 with none and 3.0 s of queue (120,000 pending tokens)."""
    return make_snapshot(make_worker("w0", returning_in_s=(0.0,) * 20),
                         make_worker("w1", num_pending_prefill_tokens=120_000))


@pytest.mark.parametrize(("tail_s", "expected"), [(9.0, "w0"), (float("inf"), "w1")])
def test_the_charge_never_sends_a_long_cold_turn_into_a_queue_past_the_served_tail(tail_s, expected):
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    snapshot = _twenty_returning_on_w0_and_a_queue_on_w1()
    view = msgspec.structs.replace(make_view(N_LONG_COLD, session_key="new"), is_new_session=True,
                                   session_return_probability=0.75, session_return_tail_s=tail_s)
    decision = policy.select(view, snapshot)
    ttft_w0 = 0.003 + PREFILL_LONG_COLD_S  # 7.27 s
    ttft_w1 = ttft_w0 + 3.0  # 10.27 s: past the 9.0 s tail
    assert decision.scores == {"w0": pytest.approx(ttft_w0), "w1": pytest.approx(ttft_w1)}
    assert decision.worker_id == expected
    terms = policy.cost_terms(view, snapshot)
    # Uncapped, w0 is charged 0.75 * 20 * its prefill (109 s); the cap leaves it 9.0 - 7.27 s, so its cost is the tail.
    charge = min(0.75 * 20 * PREFILL_LONG_COLD_S, tail_s - ttft_w0)
    assert terms["w0"].returning_penalty_s == pytest.approx(charge)
    assert terms["w0"].cost_s == pytest.approx(min(ttft_w0 + 0.75 * 20 * PREFILL_LONG_COLD_S, tail_s))
    assert terms["w1"].returning_penalty_s == 0.0


def test_the_capped_charge_still_moves_a_short_cold_turn_off_returning_sessions():
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    snapshot = _twenty_returning_on_w0_and_a_queue_on_w1()
    view = msgspec.structs.replace(make_view(N_SHORT_COLD, session_key="new"), is_new_session=True,
                                   session_return_probability=0.75, session_return_tail_s=9.0)
    # w0: 0.24 s plus 0.75 * 20 * 0.23 s = 3.49 s of charge (within 9.0 - 0.24 s), 3.72 s; w1: 3.24 s, in the tail.
    ttft_w0 = 0.003 + PREFILL_SHORT_COLD_S
    terms = policy.cost_terms(view, snapshot)
    assert terms["w0"].returning_penalty_s == pytest.approx(0.75 * 20 * PREFILL_SHORT_COLD_S)
    assert terms["w0"].cost_s == pytest.approx(ttft_w0 + 0.75 * 20 * PREFILL_SHORT_COLD_S)
    assert terms["w1"].cost_s == pytest.approx(ttft_w0 + 3.0)
    assert policy.select(view, snapshot).worker_id == "w1"


def test_the_charge_is_capped_at_the_room_left_under_the_tail():
    assert returning_charge_s(0.5, (0.0, 0.0), 2.0, 1.5, tail_s=10.0) == pytest.approx(1.5)  # 0.5 * 3.0, room 8
    assert returning_charge_s(0.5, (0.0, 0.0), 2.0, 1.5, tail_s=3.0) == pytest.approx(1.0)  # room 1.0
    assert returning_charge_s(0.5, (0.0, 0.0), 2.0, 1.5, tail_s=2.0) == 0.0  # already at the tail
    assert returning_charge_s(0.5, (0.0, 0.0), 2.0, 1.5, tail_s=1.0) == 0.0  # past it
    assert returning_charge_s(0.5, (0.0, 0.0), 2.0, 1.5) == pytest.approx(1.5)  # no tail: no cap


def test_equal_returning_sessions_tie_as_before():
    policy = CacheAwarePolicy(CacheAwareConfig(enable_calibration=False))
    view = msgspec.structs.replace(make_view(N_COLD, session_key="new"), is_new_session=True,
                                   session_return_probability=0.5)
    snapshot = make_snapshot(make_worker("w0", returning_in_s=(0.3,), num_recent_assignments=2),
                             make_worker("w1", returning_in_s=(0.3,), num_recent_assignments=1))
    assert policy.select(view, snapshot).worker_id == "w1"  # equal charge: the worker given least lately
    # A turn due after this prefill ends is held up by nothing: both charges 0, the same tie.
    late = make_snapshot(make_worker("w0", returning_in_s=(5.0,)), make_worker("w1"))
    decision = policy.select(view, late)
    assert decision.worker_id == "w0"
    assert policy.cost_terms(view, late)["w0"].returning_penalty_s == 0.0


def _sticky(**fields: object) -> SessionStickyPolicy:
    policy = build_policy(decode_policy_config({"name": "session_sticky", **fields,
                                                "inner": {"name": "cache_aware", "enable_calibration": False}}))
    assert isinstance(policy, SessionStickyPolicy)
    return policy


def _place(policy: SessionStickyPolicy, key: str, num_tokens: int, clock_s: float, *, owner: str | None,
           only: str | None = None, cached: dict[str, int] | None = None,
           pending: dict[str, int] | None = None) -> str | None:
    """One request of session ``key`` at ``clock_s`` (every worker's clock), ``only`` healthy if given."""
    cached, pending = cached or {}, pending or {}
    workers = tuple(make_worker(w, clock_s=clock_s, is_healthy=only in (None, w),
                                num_gpu_cached_tokens=cached.get(w, 0), num_pending_prefill_tokens=pending.get(w, 0))
                    for w in ("w0", "w1"))
    snapshot = msgspec.structs.replace(make_snapshot(*workers, session_owner=owner), now_s=clock_s)
    return policy.select(make_view(num_tokens, session_key=key), snapshot).worker_id


N_LONG = 65_536
TTFT_LONG_S = 0.003 + N_LONG / 40_000.0 + N_LONG**2 / 2.435e9
TTFT_1K_S = 0.003 + 1024 / 40_000.0 + 1024**2 / 2.435e9
TTFT_2K_1K_CACHED_S = 0.003 + 1024 / 40_000.0 + (2048**2 - 1024**2) / 2.435e9
SERVED_TAIL_S = TTFT_2K_1K_CACHED_S + 0.96 * (TTFT_LONG_S - TTFT_2K_1K_CACHED_S)
"""The p99 of the fixture's five served estimates at 11.2 s (position 0.99 * 4 = 3.96 of the sorted five): 3.27 s."""


def _fleet_with_two_sessions_on_w0(policy: SessionStickyPolicy) -> None:
    """z's long turn was served on w1 long ago (it sets the fleet's tail and is not expected back); a and b live on
    w0, c on w1; a has returned once after 1.0 s (the only gap: F = 1/4, p = 0.2)."""
    assert _place(policy, "z", N_LONG, 0.0, owner=None, only="w1") == "w1"
    assert _place(policy, "a", 1024, 10.0, owner=None, only="w0") == "w0"
    assert _place(policy, "b", 1024, 10.5, owner=None, only="w0") == "w0"
    assert _place(policy, "c", 1024, 10.9, owner=None, only="w1") == "w1"
    assert _place(policy, "a", 2048, 11.0, owner="w0", cached={"w0": 1024}) == "w0"


def test_sticky_sends_a_new_sessions_cold_prefill_away_from_the_owner_of_returning_sessions():
    policy = _sticky()
    _fleet_with_two_sessions_on_w0(policy)
    # At 11.2 s: w0's a is back in 0.8 s, b in 0.3 s; w1's c in 0.7 s (z, 11.2 s old, is past the longest gap).
    # Same TTFT everywhere (1.26 s, within the 3.27 s tail): w1 is charged less.
    assert policy.returning is not None and policy.move_cost is not None
    workers = (make_worker("w0", clock_s=11.2), make_worker("w1", clock_s=11.2))
    assert policy.returning.returning_in_s(workers) == {"w0": pytest.approx((0.3, 0.8)),
                                                        "w1": pytest.approx((0.7,))}
    assert policy.move_cost.tail_s(11.2) == pytest.approx(SERVED_TAIL_S)
    assert _place(policy, "d", N_COLD, 11.2, owner=None) == "w1"
    # A cached turn of a session on w0 stays with its owner, however many of w0's sessions are about to return.
    assert _place(policy, "b", 4096, 11.5, owner="w0", cached={"w0": 2048}) == "w0"


def test_sticky_charges_no_cold_prefill_whose_estimate_is_past_the_served_tail():
    policy = _sticky()
    _fleet_with_two_sessions_on_w0(policy)
    # 81,920 tokens: 4.80 s, past the 3.27 s tail. With 0.1 s of queue on w1 (4,000 pending tokens), uncapped, w0
    # would be charged 0.2 * (4.5 + 4.0) = 1.70 s and w1 0.2 * 4.2 = 0.84 s (6.50 s against 5.74 s: sent to w1);
    # both capped to 0, it starts first on w0.
    assert 0.003 + 81_920 / 40_000.0 + 81_920**2 / 2.435e9 > SERVED_TAIL_S
    assert _place(policy, "e", 81_920, 11.2, owner=None, pending={"w1": 4000}) == "w0"


def test_among_equal_estimates_past_the_tail_the_smaller_charge_still_wins():
    policy = _sticky()
    _fleet_with_two_sessions_on_w0(policy)
    # 4.80 s on both, past the tail: both charges capped to 0, equal costs; w1 holds up one returning turn, w0 two.
    assert _place(policy, "e", 81_920, 11.2, owner=None) == "w1"


def test_without_the_charge_the_cold_prefill_ties_to_configuration_order():
    policy = _sticky(charge_returning_sessions=False)
    assert policy.returning is None
    _fleet_with_two_sessions_on_w0(policy)
    assert _place(policy, "d", N_COLD, 11.2, owner=None) == "w0"


def test_a_new_session_whose_head_a_worker_holds_is_not_charged():
    policy = _sticky()
    _fleet_with_two_sessions_on_w0(policy)
    # w0 holds the first 4,096 tokens: the cached head wins as before, though w0 has more sessions about to return.
    assert _place(policy, "d", N_COLD, 11.2, owner=None, cached={"w0": 4096}) == "w0"
    # w1 holds them: the head goes with it.
    assert _place(policy, "e", N_COLD, 11.2, owner=None, cached={"w1": 4096}) == "w1"


@pytest.mark.parametrize(("key", "value"), [("return_gap_window", 0), ("return_gap_window", "many"),
                                            ("charge_returning_sessions", "yes")])
def test_a_bad_returning_key_is_refused_naming_it(key, value):
    with pytest.raises(msgspec.ValidationError, match=key):
        msgspec.convert({key: value}, SessionStickyConfig)
