"""``cache_aware``: route to the minimum estimated TTFT, seconds (formula in ``policies/cost_model.py``).

Per request:

1. Candidates: healthy, not draining workers (``policies.candidates``).
2. Score each candidate: ``TTFTCostModel.estimate_s`` with its online speed factor (``TTFTCalibrator``), and
   rank by that score plus the recompute penalty (below).
3. Busy thresholds: a candidate at or over ``max_running_requests``, ``max_kv_usage`` or
   ``max_pending_prefill_tokens`` is saturated and excluded, unless every candidate is saturated (then all
   compete and the reason says so).
4. Order the rest by the tie-break rule below; temperature 0 takes the first, otherwise a seeded softmax draw.

Ranking cost: ``ttft + recompute_penalty * prefill + decode_penalty * decode_load + memory + returning`` where
``prefill`` is the (speed-scaled) prefill time of the tokens the worker lacks and ``decode_load`` the (speed-scaled)
decode time that sharing the worker's batch adds to this request and to those already running there
(``TTFTCostModel.decode_load_s``). With both penalties at 0 the policy is greedy on this request's TTFT; the
recompute penalty also charges the work a recompute adds to the fleet: every request queued behind this one on
that worker waits for the recomputed tokens, and a conversation moved off the worker holding its prefix loses that
prefix's hit. It applies equally to every worker for a prompt nobody holds, so it only matters when some worker
has a hit. A request that opens a session (``RequestView.is_new_session``) is ranked without it: what it finds
cached is a head shared by many sessions, which a worker lacking it computes once and then holds for all of them,
so charging it again would pile every new session onto the head's first holder. The decode penalty keeps requests
that share a prefix (one system prompt for every session) from all landing on the worker that holds it while others
idle: past a few running requests there, the decode time they would share outweighs the prefill the hit saves.
``memory`` prices what placing the prompt there costs the
next turns of the sessions living on that worker: with ``C`` its GPU capacity in tokens and ``R`` the prompt
tokens of the live sessions it owns, each projected over its expected remaining turns (this request's session left
out; ``policies.residents``), and ``m = n + g`` this session's projected prompt (``g``:
``RequestView.num_expected_growth_tokens``), the ``min(m, max(0, R + m - C))`` tokens that do not fit evict as many
of theirs, each recomputed at a session's next turn: ``memory = that * (1 / r_lin)`` (speed-scaled; 0 while ``C``
is unknown). It spreads sessions by the memory
their conversations take, which no instantaneous load shows. ``returning`` (when ``session_sticky`` fills
``WorkerState.returning_in_s`` for a new session's request) is the wait the request's prefill imposes on the
worker's live sessions expected back while it runs, weighted by the chance that a session returns
and capped so that it raises the cost to the fleet's served tail at most (``RequestView.session_return_tail_s``;
``policies/returning.py``): a cold prefill goes where fewer owned sessions are about to return, but not into a
queue that would make it the fleet's slowest.
``Decision.scores`` stay the estimated TTFT (the calibrator
compares them with observed TTFTs; ``session_sticky``'s margins compare them).

Tie-break rule (deterministic): ranking costs are compared at microsecond resolution (``round(cost * 1e6)``);
equal costs prefer the smaller returning charge before its cap (the cap makes the charge 0 on every worker whose
estimate is past the tail; among equal estimates the one holding up fewer returning turns still wins), then more
GPU-cached tokens, then the lighter load (fewer running plus waiting requests, then fewer
pending prefill tokens), then fewer tokens of live sessions it owns (``WorkerState.num_resident_tokens``: the next
turns it will be asked to hold), then fewer recent assignments (``WorkerState.num_recent_assignments``: the worker
given least lately, so cold sessions on an idle fleet spread), and only then configuration order.

Softmax (as Dynamo's router does it): ranking costs of the competing workers are min-max normalized to [0, 1] (all
equal: all 0), ``p_i = exp(-x_i / temperature) / sum_j exp(-x_j / temperature)``, one ``rng.random()`` draw.

The Decision: ``scores`` holds every candidate's estimate (saturated ones too, for the admin's decision list);
``ranking`` holds the competing workers, chosen first and the others by the order above; reasons are
``"min_ttft"``, ``"softmax"``, and ``"min_ttft_all_saturated"`` / ``"softmax_all_saturated"``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from operator import itemgetter

import msgspec

from policies.base import Decision, RequestView, Snapshot, WorkerState
from policies.candidates import eligible_workers, no_worker_decision
from policies.config import CacheAwareConfig
from policies.cost_model import (
    TTFTBreakdown,
    TTFTCalibrator,
    TTFTCostModel,
    drained_prefill_s,
    shared_step_queue_s,
)
from policies.returning import capped_charge_s, returning_charge_s, returning_delay_s

logger = logging.getLogger(__name__)

__all__ = ["CacheAwarePolicy", "CostTerms"]


class CostTerms(msgspec.Struct, frozen=True, gc=False):
    """One candidate's ranking cost term by term (seconds, each already scaled by the speed factor).

    Attributes:
        queue_s: queued work ahead of the request.
        prefill_s: prefill of the tokens the worker lacks.
        restore_s: restore of blocks held only on CPU or in the pool.
        overhead_s: fixed per-request time.
        ttft_s: the estimated TTFT, ``overhead_s + queue_s + prefill_s + restore_s`` (``Decision.scores``).
        recompute_penalty_s: ``recompute_penalty * prefill_s``.
        decode_load_penalty_s: ``decode_penalty`` times the decode load (``TTFTCostModel.decode_load_s``).
        cost_s: what the candidates are ranked by: ``ttft_s + recompute_penalty_s + decode_load_penalty_s +
            memory_penalty_s + returning_penalty_s``.
        speed_factor: the worker's online speed factor.
        num_computed_tokens: prompt tokens the worker would compute.
        is_saturated: over a busy threshold (competes only when every candidate is).
    """

    queue_s: float
    prefill_s: float
    restore_s: float
    overhead_s: float
    ttft_s: float
    recompute_penalty_s: float
    decode_load_penalty_s: float
    cost_s: float
    speed_factor: float
    num_computed_tokens: int
    is_saturated: bool
    memory_penalty_s: float = 0.0
    """The recompute that the prompt's overflow of the worker's GPU capacity costs its resident sessions."""
    returning_penalty_s: float = 0.0
    """The wait the request's prefill imposes on the worker's sessions expected back during it
    (``RequestView.session_return_probability`` times ``policies.returning.returning_delay_s``, capped at the served
    tail: ``policies.returning.returning_charge_s``)."""

_SCORE_RESOLUTION_PER_S = 1e6
"""Scores closer than one microsecond tie."""
_WORKER_ID_OF_KEY = itemgetter(9)
"""The worker id of a sort key (see ``select``)."""


class CacheAwarePolicy:
    """Minimum estimated TTFT with busy thresholds, optional softmax, and online speed correction.

    Args:
        config: constants, thresholds, temperature and seed.
        calibrator: where per-worker speed factors are read from; ``None`` with ``enable_calibration`` creates
            one, ``None`` without it uses 1.0 everywhere.

    Attributes:
        calibrator: the ``TTFTCalibrator`` the gateway feeds with observed TTFTs (``None`` when disabled).
        cost_model: the ``TTFTCostModel`` evaluating the formula.
    """

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig, calibrator: TTFTCalibrator | None = None) -> None:
        self.config = config
        self.cost_model = TTFTCostModel(config)
        if calibrator is None and config.enable_calibration:
            calibrator = TTFTCalibrator(config)
        self.calibrator: TTFTCalibrator | None = calibrator if config.enable_calibration else None
        self._rng = random.Random(config.seed)
        self._log_factors: Mapping[str, float] = (
            self.calibrator.log_speed_factors_view() if self.calibrator is not None else {}
        )
        model = self.cost_model
        max_running, max_kv_usage, max_pending = (
            config.max_running_requests, config.max_kv_usage, config.max_pending_prefill_tokens)
        self._constants = (
            model.s_per_token, model.s_per_token_sq, model.host_s_per_token, model.pool_s_per_token,
            model.per_waiting_request_s, model.per_running_request_s, model.overhead_s, config.recompute_penalty,
            max_running, max_kv_usage, max_pending,
            max_running is not None or max_kv_usage is not None or max_pending is not None,
            config.decode_penalty * model.kv_read_s_per_token,
            config.decode_penalty * 2.0 * model.decode_s_per_sequence, config.decode_horizon_tokens,
        )
        """``select``'s constants in one tuple (config and cost model are fixed for the policy's life)."""

    def is_saturated(self, worker: WorkerState) -> bool:
        """True when ``worker`` is at or over a configured busy threshold."""
        config = self.config
        return (
            (config.max_running_requests is not None and worker.num_running_requests >= config.max_running_requests)
            or (config.max_kv_usage is not None and worker.kv_usage >= config.max_kv_usage)
            or (
                config.max_pending_prefill_tokens is not None
                and worker.num_pending_prefill_tokens >= config.max_pending_prefill_tokens
            )
        )

    def speed_factor(self, worker_id: str) -> float:
        """The factor the cost model applies to ``worker_id`` now (1.0 without calibration)."""
        return 1.0 if self.calibrator is None else self.calibrator.speed_factor(worker_id)

    def explain(self, view: RequestView, snapshot: Snapshot) -> dict[str, TTFTBreakdown]:
        """Every candidate's estimate term by term (for the admin's decision list; not on the hot path)."""
        return {
            w.worker_id: self.cost_model.breakdown(w, view.num_prompt_tokens, self.speed_factor(w.worker_id),
                                                   view.num_max_output_tokens)
            for w in eligible_workers(snapshot)
        }

    def memory_s(self, worker: WorkerState, num_projected_tokens: int) -> float:
        """The memory term of the module docstring for a projected prompt of ``num_projected_tokens`` (``m``) on
        ``worker``, unscaled (seconds; 0 while its capacity is unknown)."""
        capacity = worker.num_gpu_capacity_tokens
        if not capacity:
            return 0.0
        over = min(num_projected_tokens, worker.num_resident_tokens + num_projected_tokens - capacity)
        return over * self.cost_model.s_per_token if over > 0 else 0.0

    def cost_terms(self, view: RequestView, snapshot: Snapshot) -> dict[str, CostTerms]:
        """Every candidate's ranking cost term by term, as ``select`` adds them (the admin's decision list)."""
        config = self.config
        out: dict[str, CostTerms] = {}
        for w in eligible_workers(snapshot):
            b = self.cost_model.breakdown(w, view.num_prompt_tokens, self.speed_factor(w.worker_id),
                                          view.num_max_output_tokens)
            f = b.speed_factor
            recompute = (0.0 if view.is_new_session else config.recompute_penalty) * f * b.prefill_s
            decode = config.decode_penalty * f * b.decode_load_s
            memory = f * self.memory_s(w, view.num_prompt_tokens + view.num_expected_growth_tokens)
            returning = 0.0
            if view.session_return_probability and w.returning_in_s:
                returning = returning_charge_s(view.session_return_probability, w.returning_in_s, b.ttft_s,
                                               f * b.prefill_s, view.session_return_tail_s)
            out[w.worker_id] = CostTerms(
                queue_s=f * b.queue_s, prefill_s=f * b.prefill_s, restore_s=f * b.restore_s, overhead_s=b.overhead_s,
                ttft_s=b.ttft_s, recompute_penalty_s=recompute, decode_load_penalty_s=decode,
                cost_s=b.ttft_s + recompute + decode + memory + returning, speed_factor=f,
                num_computed_tokens=b.num_computed_tokens, is_saturated=self.is_saturated(w), memory_penalty_s=memory,
                returning_penalty_s=returning,
            )
        return out

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose the candidate with the lowest estimated TTFT (see the module docstring)."""
        # The cost model's formula (TTFTCostModel.work_s) and is_saturated, inlined: this loop is the request path.
        (s_per_token, s_per_token_sq, host_s_per_token, pool_s_per_token, per_waiting_s, per_running_s, overhead_s,
         recompute_penalty, max_running, max_kv_usage, max_pending, has_thresholds, decode_s_per_token,
         decode_s_per_two_sequences, decode_horizon_tokens) = self._constants
        if view.is_new_session:
            recompute_penalty = 0.0
        num_lanes = self.cost_model.num_lanes  # the workers' step cap (TTFTCostModel.breakdown, shared_step_queue_s)
        threshold = self.config.long_prefill_token_threshold
        step_budget = self.config.max_num_batched_tokens
        return_probability = view.session_return_probability
        return_tail_s = view.session_return_tail_s
        n = view.num_prompt_tokens
        n_sq = n * n
        projected = n + view.num_expected_growth_tokens
        # TTFTCostModel.decode_load_s times decode_penalty, per running request and per context token in flight.
        steps = view.num_max_output_tokens
        if steps > decode_horizon_tokens:
            steps = decode_horizon_tokens
        decode_s_per_inflight_token = steps * decode_s_per_token
        decode_s_per_running = steps * decode_s_per_two_sequences + n * decode_s_per_inflight_token
        factors = self._log_factors
        workers = snapshot.workers
        scores: dict[str, float] = {}
        # Sort keys (rounded cost, rounded returning delay before its cap, -GPU-cached tokens, running + waiting
        # requests, pending prefill tokens, resident session tokens, recent assignments, position in snapshot, cost,
        # worker id); the position is unique, so the items after it are never compared.
        competing: list[tuple[int, int, int, int, int, int, int, int, float, str]] = []
        saturated: list[tuple[int, int, int, int, int, int, int, int, float, str]] = []
        prefill_uncached = n * s_per_token + n_sq * s_per_token_sq  # the prefill below with k = 0
        for index, w in enumerate(workers):
            if not w.is_healthy or w.is_draining:  # policies.candidates.is_eligible, inlined
                continue
            # Terms that are zero are skipped: adding 0.0 changes no float, so the sums equal the full formula.
            k_gpu = w.num_gpu_cached_tokens
            k_cpu = w.num_cpu_cached_tokens
            k_pool = w.num_pool_cached_tokens
            has_lower = k_cpu or k_pool
            if has_lower:
                if k_gpu > n:
                    k_gpu = n
                if k_cpu > n - k_gpu:
                    k_cpu = n - k_gpu
                if k_pool > n - k_gpu - k_cpu:
                    k_pool = n - k_gpu - k_cpu
                k = k_gpu + k_cpu + k_pool
                prefill = (n - k) * s_per_token + (n_sq - k * k) * s_per_token_sq if k else prefill_uncached
            elif k_gpu:
                k = n if k_gpu > n else k_gpu
                prefill = (n - k) * s_per_token + (n_sq - k * k) * s_per_token_sq if k else prefill_uncached
            else:
                k = 0
                prefill = prefill_uncached
            worker_id = w.worker_id
            factor = 1.0
            if factors:
                log_factor = factors.get(worker_id)
                if log_factor is not None:
                    factor = math.exp(log_factor)
            pending, waiting, running = w.num_pending_prefill_tokens, w.num_waiting_requests, w.num_running_requests
            queued = w.pending_prefills
            if queued:
                queued_s = drained_prefill_s(queued, w.prefill_done_at_s, w.clock_s, s_per_token, s_per_token_sq,
                                             factor)
                if num_lanes:
                    queued_s = shared_step_queue_s(queued, queued_s, n - k, num_lanes, threshold, step_budget,
                                                   s_per_token, s_per_token_sq)
                work = queued_s + waiting * per_waiting_s + running * per_running_s + prefill
            elif pending or waiting or running:
                work = (pending * s_per_token + w.num_pending_prefill_token_pairs * s_per_token_sq
                        + waiting * per_waiting_s + running * per_running_s + prefill)
            else:
                work = prefill
            if has_lower:
                work = work + k_cpu * host_s_per_token + k_pool * pool_s_per_token
            inflight_tokens = w.num_inflight_prompt_tokens
            decode = (running * decode_s_per_running + inflight_tokens * decode_s_per_inflight_token
                      if running or inflight_tokens else 0.0)
            capacity = w.num_gpu_capacity_tokens
            if capacity:  # self.memory_s(w, m), inlined, added to the decode term (both rank only)
                over = w.num_resident_tokens + projected - capacity
                if over > 0:
                    decode += (projected if over > projected else over) * s_per_token
            if factor != 1.0:
                work *= factor
                prefill *= factor
                decode *= factor
            score = overhead_s + work
            scores[worker_id] = score
            cost = score + recompute_penalty * prefill + decode
            held_up = 0
            if return_probability and w.returning_in_s:
                delay = return_probability * returning_delay_s(w.returning_in_s, score, prefill)
                cost += capped_charge_s(delay, score, return_tail_s)
                held_up = round(delay * _SCORE_RESOLUTION_PER_S)
            key = (round(cost * _SCORE_RESOLUTION_PER_S), held_up, -w.num_gpu_cached_tokens, running + waiting,
                   pending, w.num_resident_tokens, w.num_recent_assignments, index, cost, worker_id)
            if has_thresholds and (
                (max_running is not None and running >= max_running)
                or (max_kv_usage is not None and w.kv_usage >= max_kv_usage)
                or (max_pending is not None and pending >= max_pending)
            ):  # is_saturated(w), inlined
                saturated.append(key)
            else:
                competing.append(key)
        reason = "min_ttft"
        if not competing:
            if not saturated:
                return no_worker_decision(snapshot)
            competing, reason = saturated, "min_ttft_all_saturated"
        if len(competing) > 1:
            competing.sort()
            if self.config.temperature > 0.0:
                pick = self._softmax_index([key[8] for key in competing])
                competing.insert(0, competing.pop(pick))
                reason = "softmax" + reason[8:]
        chosen = workers[competing[0][7]]
        return Decision(
            chosen.worker_id,
            reason,
            scores,
            chosen.num_gpu_cached_tokens + chosen.num_cpu_cached_tokens + chosen.num_pool_cached_tokens,
            tuple(map(_WORKER_ID_OF_KEY, competing)),
        )

    def _softmax_index(self, scores_s: list[float]) -> int:
        """Index drawn with probability softmax(-minmax(scores) / temperature); one RNG draw."""
        low, high = min(scores_s), max(scores_s)
        span = high - low
        temperature = self.config.temperature
        if span <= 0.0:
            weights = [1.0] * len(scores_s)
        else:
            weights = [math.exp(-((s - low) / span) / temperature) for s in scores_s]
        threshold = self._rng.random() * sum(weights)
        cumulative = 0.0
        for i, weight in enumerate(weights):
            cumulative += weight
            if threshold < cumulative:
                return i
        return len(weights) - 1
