"""``cache_aware``: route to the minimum estimated TTFT, seconds (formula in ``policies/cost_model.py``).

Per request:

1. Candidates: healthy, not draining workers (``policies.candidates``).
2. Score each candidate: ``TTFTCostModel.estimate_s`` with its online speed factor (``TTFTCalibrator``).
3. Busy thresholds: a candidate at or over ``max_running_requests``, ``max_kv_usage`` or
   ``max_pending_prefill_tokens`` is saturated and excluded, unless every candidate is saturated (then all
   compete and the reason says so).
4. Order the rest by the tie-break rule below; temperature 0 takes the first, otherwise a seeded softmax draw.

Tie-break rule (deterministic): scores are compared at microsecond resolution (``round(score * 1e6)``); equal
scores prefer more GPU-cached tokens, then fewer running requests, then configuration order.

Softmax (as Dynamo's router does it): scores of the competing workers are min-max normalized to [0, 1] (all
equal: all 0), ``p_i = exp(-x_i / temperature) / sum_j exp(-x_j / temperature)``, one ``rng.random()`` draw.

The Decision: ``scores`` holds every candidate's estimate (saturated ones too, for the admin's decision list);
``ranking`` holds the competing workers, chosen first and the others by the order above; reasons are
``"min_ttft"``, ``"softmax"``, and ``"min_ttft_all_saturated"`` / ``"softmax_all_saturated"``.
"""

from __future__ import annotations

import logging
import math
import random

from policies.base import Decision, RequestView, Snapshot, WorkerState
from policies.candidates import eligible_workers, no_worker_decision
from policies.config import CacheAwareConfig
from policies.cost_model import TTFTBreakdown, TTFTCalibrator, TTFTCostModel

logger = logging.getLogger(__name__)

__all__ = ["CacheAwarePolicy"]

_SCORE_RESOLUTION_PER_S = 1e6
"""Scores closer than one microsecond tie."""


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
            w.worker_id: self.cost_model.breakdown(w, view.num_prompt_tokens, self.speed_factor(w.worker_id))
            for w in eligible_workers(snapshot)
        }

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose the candidate with the lowest estimated TTFT (see the module docstring)."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        num_prompt_tokens = view.num_prompt_tokens
        work_s = self.cost_model.work_s
        overhead_s = self.cost_model.overhead_s
        calibrator = self.calibrator
        scores: dict[str, float] = {}
        competing: list[tuple[int, int, int, int, WorkerState]] = []
        saturated: list[tuple[int, int, int, int, WorkerState]] = []
        for index, worker in enumerate(candidates):
            factor = 1.0 if calibrator is None else calibrator.speed_factor(worker.worker_id)
            score = overhead_s + factor * work_s(worker, num_prompt_tokens)
            scores[worker.worker_id] = score
            key = (
                round(score * _SCORE_RESOLUTION_PER_S),
                -worker.num_gpu_cached_tokens,
                worker.num_running_requests,
                index,
                worker,
            )
            (saturated if self.is_saturated(worker) else competing).append(key)
        suffix = ""
        if not competing:
            competing, suffix = saturated, "_all_saturated"
        competing.sort(key=_sort_key)
        ranked = [entry[4] for entry in competing]
        reason = "min_ttft"
        if self.config.temperature > 0.0 and len(ranked) > 1:
            pick = self._softmax_index([scores[w.worker_id] for w in ranked])
            ranked.insert(0, ranked.pop(pick))
            reason = "softmax"
        chosen = ranked[0]
        return Decision(
            worker_id=chosen.worker_id,
            reason=reason + suffix,
            scores=scores,
            predicted_cached_tokens=chosen.num_cached_tokens,
            ranking=tuple(w.worker_id for w in ranked),
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


def _sort_key(entry: tuple[int, int, int, int, WorkerState]) -> tuple[int, int, int, int]:
    """Tie-break order: rounded score, more GPU-cached tokens, fewer running requests, configuration order."""
    return entry[0], entry[1], entry[2], entry[3]
