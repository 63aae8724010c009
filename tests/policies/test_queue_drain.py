"""The queue term drains: a worker serves its pending prefills in admission order at its profiled rate, so what a
new request waits behind is the work admitted minus the work done since (``policies.cost_model.drained_prefill_s``).

Rates are powers of two so that every value below is exact in binary floating point: ``r_lin = 1024`` tokens/s
(1/1024 s per token) and ``r_quad = 2**20`` token pairs/s. The three requests used throughout::

    A: n = 1024, k = 0     u = 1024, pairs = 1024**2 = 2**20           work 1024/1024 + 2**20/2**20 = 1 + 1 = 2 s
    B: n = 512,  k = 0     u = 512,  pairs = 512**2 = 2**18            work 0.5 + 0.25 = 0.75 s
    C: n = 2048, k = 1024  u = 1024, pairs = 2048**2 - 1024**2 = 3 * 2**20   work 1 + 3 = 4 s
"""

from __future__ import annotations

import pytest

from policies import CacheAwareConfig, CacheAwarePolicy
from policies.base import PendingPrefill
from policies.cost_model import TTFTCalibrator, drained_prefill_s
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

S_PER_TOKEN = 1.0 / 1024
S_PER_TOKEN_SQ = 1.0 / 2**20
OVERHEAD_S = 0.003


def a_at(t: float) -> PendingPrefill:
    return (t, 1024, 2**20)


def b_at(t: float) -> PendingPrefill:
    return (t, 512, 2**18)


def c_at(t: float) -> PendingPrefill:
    return (t, 1024, 3 * 2**20)


def drained(pending: list[PendingPrefill], done_at_s: float, now_s: float, speed_factor: float = 1.0) -> float:
    return drained_prefill_s(pending, done_at_s, now_s, S_PER_TOKEN, S_PER_TOKEN_SQ, speed_factor)


@pytest.mark.parametrize(("now_s", "expected_s"), [
    (10.0, 2.0),  # just admitted: all of A's 2 s
    (11.0, 1.0),  # 1 s served
    (11.5, 0.5),
    (12.0, 0.0),  # its modelled work is done
    (13.0, 0.0),  # still no first byte (late): nothing more, never negative
    (9.0, 2.0),  # a clock before the admission serves nothing
])
def test_one_request_drains_at_the_profiled_rate(now_s: float, expected_s: float) -> None:
    assert drained([a_at(10.0)], 0.0, now_s) == expected_s


def test_a_queue_is_served_head_first_from_the_first_admission() -> None:
    # A@10, B@10.5, C@11, now 12.5: 2 + 0.75 + 4 = 6.75 s admitted, the worker busy since 10: 6.75 - 2.5 = 4.25 s.
    # Step by step: A: 2; B: 2 - 0.5 + 0.75 = 2.25; C: 2.25 - 0.5 + 4 = 5.75; now: 5.75 - 1.5 = 4.25.
    assert drained([a_at(10.0), b_at(10.5), c_at(11.0)], 0.0, 12.5) == 4.25


def test_an_idle_gap_serves_nothing_ahead_of_the_next_admission() -> None:
    # A@10 is modelled done at 12 (first byte not seen yet); the worker idles until B@20: B's 0.75 s, 0.25 s served.
    # Work admitted minus time since the head (2.75 - 10.25) would say 0: the idle gap is not work done.
    assert drained([a_at(10.0), b_at(20.0)], 0.0, 20.25) == 0.5


def test_nothing_pending_is_served_before_the_last_finished_prefill() -> None:
    # A@10 was modelled to finish at 12 but its first byte came at 13 (the worker was slower): B@10.5 and C@11
    # waited behind it until 13, so at 14 one second of them is served: 0.75 + 4 - 1 = 3.75 s.
    assert drained([b_at(10.5), c_at(11.0)], 13.0, 14.0) == 3.75
    # Credited from their own admissions instead (no finished prefill known), they would be 1.25 s:
    # B: 0.75; C: 0.75 - 0.5 + 4 = 4.25; now 14: 4.25 - 3 = 1.25.
    assert drained([b_at(10.5), c_at(11.0)], 0.0, 14.0) == 1.25


def test_a_slower_worker_serves_less_work_per_second() -> None:
    # speed factor 2: one second of the worker's clock serves 0.5 s of profiled work: A@10 at 11 has 1.5 s left.
    assert drained([a_at(10.0)], 0.0, 11.0, speed_factor=2.0) == 1.5


def policy() -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareConfig(prefill_linear_tokens_per_s=1024.0,
                                             prefill_quadratic_tokens_sq_per_s=float(2**20), enable_calibration=False))


def test_the_policy_prices_the_drained_queue_and_the_sums_without_a_list() -> None:
    queue = [a_at(10.0), b_at(10.5), c_at(11.0)]
    # The same three requests: w0 with the list at 12.5 (4.25 s left), w1 with their sums only (all 6.75 s):
    # u = 1024 + 512 + 1024 = 2560 tokens, pairs = 2**20 + 2**18 + 3 * 2**20 = 4_456_448.
    drained_worker = make_worker("w0", num_pending_prefill_tokens=2560, num_pending_prefill_token_pairs=4_456_448,
                                 pending_prefills=tuple(queue), clock_s=12.5)
    summed_worker = make_worker("w1", num_pending_prefill_tokens=2560, num_pending_prefill_token_pairs=4_456_448)
    cache_aware = policy()
    view = make_view(1024)  # uncached everywhere: prefill 1 + 1 = 2 s
    decision = cache_aware.select(view, make_snapshot(summed_worker, drained_worker))
    assert decision.scores == {"w0": OVERHEAD_S + (4.25 + 2.0), "w1": OVERHEAD_S + (6.75 + 2.0)}
    assert decision.worker_id == "w0" and decision.ranking == ("w0", "w1")
    terms = cache_aware.cost_terms(view, make_snapshot(summed_worker, drained_worker))
    assert (terms["w0"].queue_s, terms["w1"].queue_s) == (4.25, 6.75)
    assert terms["w0"].ttft_s == decision.scores["w0"] and terms["w1"].ttft_s == decision.scores["w1"]
    # at 16 the worker has served all 6.75 s (busy since 10): only the request's own prefill is left
    idle = make_worker("w0", num_pending_prefill_tokens=2560, num_pending_prefill_token_pairs=4_456_448,
                       pending_prefills=tuple(queue), clock_s=16.75)
    assert cache_aware.select(view, make_snapshot(idle)).scores == {"w0": OVERHEAD_S + 2.0}


def test_the_speed_factor_slows_the_drain_and_scales_what_is_left() -> None:
    config = CacheAwareConfig(prefill_linear_tokens_per_s=1024.0, prefill_quadratic_tokens_sq_per_s=float(2**20))
    cache_aware = CacheAwarePolicy(config, TTFTCalibrator(config, {"w0": 2.0}))
    worker = make_worker("w0", num_pending_prefill_tokens=1024, num_pending_prefill_token_pairs=2**20,
                         pending_prefills=(a_at(10.0),), clock_s=11.0)
    # f = 2: A has 2 - 1 / 2 = 1.5 s of profiled work left; the request's own prefill is 2 s: 0.003 + 2 * 3.5
    view = make_view(1024)
    assert cache_aware.select(view, make_snapshot(worker)).scores == {"w0": OVERHEAD_S + 2.0 * (1.5 + 2.0)}
    assert cache_aware.cost_terms(view, make_snapshot(worker))["w0"].queue_s == 2.0 * 1.5
