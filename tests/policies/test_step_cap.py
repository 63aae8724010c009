"""Workers whose step cap binds (``long_prefill_token_threshold`` ``T`` below the budget ``B``): a request shares
each step with the youngest prefills queued ahead instead of waiting for all of them
(``policies.cost_model.shared_step_queue_s``).

Rates are powers of two so that every value below is exact in binary floating point: ``r_lin = 1024`` tokens/s and
``r_quad = 2**20`` token pairs/s. The pending prefills (as in ``test_queue_drain``)::

    A: u = 1024, pairs = 2**20    work 1 + 1 = 2 s
    B: u = 512,  pairs = 2**18    work 0.5 + 0.25 = 0.75 s

The request: n = 256 uncached, its own prefill 256/1024 + 256**2/2**20 = 0.25 + 0.0625 = 0.3125 s.
"""

from __future__ import annotations

import pytest

from policies import CacheAwareConfig, CacheAwarePolicy, SessionStickyPolicy, build_policy, decode_policy_config
from policies.cost_model import num_threshold_lanes, shared_step_queue_s
from tests.policies.builders import make_snapshot, make_view, make_worker

pytestmark = pytest.mark.unit

OVERHEAD_S = 0.003
OWN_PREFILL_S = 0.3125
A = (10.0, 1024, 2**20)
B = (10.0, 512, 2**18)


@pytest.mark.parametrize(("budget", "threshold", "lanes"), [
    (8192, 0, 0),  # off (vLLM's default)
    (8192, 8192, 0),  # at the budget: never binds
    (8192, 9000, 0),
    (8192, 5242, 1),  # 4 % of a 131,072-token context: one long prefill leaves 2,950 tokens a step
    (8192, 4096, 1),  # two capped prefills fill the budget exactly: the next one waits
    (8192, 4095, 2),
    (8192, 2048, 3),
])
def test_lanes(budget: int, threshold: int, lanes: int) -> None:
    assert num_threshold_lanes(budget, threshold) == lanes


def policy(threshold: int, budget: int = 1024) -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareConfig(
        prefill_linear_tokens_per_s=1024.0, prefill_quadratic_tokens_sq_per_s=float(2**20), enable_calibration=False,
        max_num_batched_tokens=budget, long_prefill_token_threshold=threshold))


# (case, threshold, pending, expected queue_s)
CASES = [
    # T = 0: the whole drained queue, as before
    ("off, A ahead", 0, (A,), 2.0),
    ("off, A then B ahead", 0, (A, B), 2.75),
    # T = 512 of 1024: s = 1 lane. A alone is the lane: wait max(0, 2 - 2) = 0; one step of 512 tokens beside it,
    # ceil(256 / (1024 - 512)) = 1, at A's 2 s / 1024 tokens: 512 * 2 / 1024 = 1 s (of A's 2 s left).
    ("one lane, A ahead", 512, (A,), 1.0),
    # B (the youngest) is the lane: A's 2 s first (wait 2.75 - 0.75), then B's 512-token chunk: 0.75 s, all of it.
    ("one lane, A then B ahead", 512, (A, B), 2.75),
    # T = 384: s = ceil(1024 / 384) - 1 = 2 lanes, A and B (W_y = 2.75 s over 1536 tokens): wait 0; budget left
    # 1024 - 2 * 384 = 256, one step; beside 768 * 2.75 / 1536 = 1.375 s.
    ("two lanes, A then B ahead", 384, (A, B), 1.375),
]


@pytest.mark.parametrize(("case", "threshold", "pending", "queue_s"), CASES, ids=[c[0] for c in CASES])
def test_the_queue_a_request_waits_for(case: str, threshold: int, pending: tuple, queue_s: float) -> None:
    cache_aware = policy(threshold)
    worker = make_worker("w0", num_pending_prefill_tokens=sum(p[1] for p in pending),
                         num_pending_prefill_token_pairs=sum(p[2] for p in pending), pending_prefills=pending,
                         clock_s=10.0)
    view = make_view(256)
    snapshot = make_snapshot(worker)
    assert cache_aware.select(view, snapshot).scores == {"w0": OVERHEAD_S + queue_s + OWN_PREFILL_S}
    terms = cache_aware.cost_terms(view, snapshot)["w0"]
    assert (terms.queue_s, terms.ttft_s) == (queue_s, OVERHEAD_S + queue_s + OWN_PREFILL_S)


def test_a_long_request_runs_beside_the_lane_for_as_many_steps_as_it_needs() -> None:
    # n = 1536 uncached behind A with T = 512: ceil(1536 / 512) = 3 steps of A's 512-token chunks, 3 s of work,
    # capped at A's 2 s left: the request waits for all of A (it still shares every step with it).
    assert shared_step_queue_s((A,), 2.0, 1536, 1, 512, 1024, 1 / 1024, 1 / 2**20) == 2.0
    # n = 512: one step, 1 s of A's
    assert shared_step_queue_s((A,), 2.0, 512, 1, 512, 1024, 1 / 1024, 1 / 2**20) == 1.0
    # A half served (1 s left): the step takes at most what is left
    assert shared_step_queue_s((A,), 1.0, 256, 1, 512, 1024, 1 / 1024, 1 / 2**20) == 1.0
    # a pending entry fully cached (0 tokens) takes no lane: B is the lane, A waited for
    assert shared_step_queue_s((A, B, (10.0, 0, 0)), 2.75, 256, 1, 512, 1024, 1 / 1024, 1 / 2**20) == 2.75


R_LIN, R_QUAD = 40_000.0, 2.435e9


@pytest.mark.parametrize(("threshold", "expected"), [
    (0, ("idle", "sticky_moved", "owner_costlier")),
    (5242, ("owner", "sticky", "")),
])
def test_a_short_turn_behind_a_long_cold_prefill_stays_when_the_workers_cap_it(
    threshold: int, expected: tuple[str, str, str],
) -> None:
    """``test_move_cost``'s case: a 16,842-token turn whose owner holds 16,512 of its tokens, behind a 123,058-token
    cold prefill admitted at this instant; the other worker is idle and cold. Off, the owner is estimated at the
    whole 9.3 s prefill and the turn moves; with the workers' cap at 5,242 of 8,192 tokens (4 % of 131,072), the
    330 tokens run in the next step beside one 5,242-token chunk of it: 0.52 s, and the turn keeps its hit."""
    policy = build_policy(decode_policy_config({
        "name": "session_sticky", "inner": {"name": "cache_aware", "long_prefill_token_threshold": threshold}}))
    assert isinstance(policy, SessionStickyPolicy) and policy.move_cost is not None
    for _ in range(99):
        policy.move_cost.observe(1.0, is_new=False, clock_s=10.0)
    policy.move_cost.observe(16.6, is_new=True, clock_s=20.0)
    blocker_s = 123_058 / R_LIN + 123_058**2 / R_QUAD  # 9.2955 s
    owner = make_worker("owner", num_gpu_cached_tokens=16_512, num_pending_prefill_tokens=123_058,
                        num_pending_prefill_token_pairs=123_058**2, pending_prefills=((100.0, 123_058, 123_058**2),),
                        clock_s=100.0)
    idle = make_worker("idle", clock_s=100.0)
    decision = policy.select(make_view(16_842, session_key="sid:s"), make_snapshot(owner, idle, session_owner="owner"))
    own_prefill_s = (16_842 - 16_512) / R_LIN + (16_842**2 - 16_512**2) / R_QUAD
    queue_s = blocker_s if not threshold else 5242 * blocker_s / 123_058  # one step: ceil(330 / 2950) = 1
    assert decision.scores["owner"] == pytest.approx(OVERHEAD_S + queue_s + own_prefill_s, rel=1e-9)
    assert decision.scores["idle"] == pytest.approx(OVERHEAD_S + 16_842 / R_LIN + 16_842**2 / R_QUAD, rel=1e-9)
    assert (decision.worker_id, decision.reason, decision.detail) == expected
