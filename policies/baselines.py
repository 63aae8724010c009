"""Baseline policies for comparison: round_robin, random, least_loaded, power_of_two.

None of them looks at the prefix index. All skip unhealthy and draining workers, return
``Decision(worker_id=None, reason="no_workers" | "no_healthy_worker")`` without a candidate, rank every
candidate best first (retries walk ``ranking``), and predict the chosen worker's ``num_cached_tokens`` (the index
knows it even when the policy ignores it, so the honesty check works for baselines too).

Scores: ``least_loaded`` and ``power_of_two`` score a worker by its load (running + waiting requests; lower is
better); ``round_robin`` and ``random`` score by position in the ranking (0.0 = chosen).
"""

from __future__ import annotations

import logging
import random

from policies.base import Decision, RequestView, Snapshot, WorkerState
from policies.candidates import eligible_workers, load_key, no_worker_decision, num_load_requests
from policies.config import LeastLoadedConfig, PowerOfTwoConfig, RandomConfig, RoundRobinConfig

logger = logging.getLogger(__name__)

__all__ = ["LeastLoadedPolicy", "PowerOfTwoPolicy", "RandomPolicy", "RoundRobinPolicy", "least_loaded_decision"]


def _ranked_decision(ranked: list[WorkerState], reason: str, scores: dict[str, float]) -> Decision:
    """Decision for ``ranked[0]`` with ``ranked`` as the ranking."""
    chosen = ranked[0]
    return Decision(
        worker_id=chosen.worker_id,
        reason=reason,
        scores=scores,
        predicted_cached_tokens=chosen.num_cached_tokens,
        ranking=tuple(w.worker_id for w in ranked),
    )


def _positional(ranked: list[WorkerState], reason: str) -> Decision:
    """Decision scoring each worker by its position in ``ranked``."""
    return _ranked_decision(ranked, reason, {w.worker_id: float(i) for i, w in enumerate(ranked)})


def least_loaded_decision(candidates: list[WorkerState], reason: str = "least_loaded") -> Decision:
    """Least-loaded decision over non-empty ``candidates`` (configuration order breaks ties).

    Args:
        candidates: eligible workers in configuration order; must not be empty.
        reason: the decision's reason.

    Raises:
        ValueError: ``candidates`` is empty.
    """
    if not candidates:
        raise ValueError("least_loaded_decision needs at least one candidate")
    ranked = sorted(candidates, key=load_key)  # stable: configuration order breaks ties
    return _ranked_decision(ranked, reason, {w.worker_id: float(num_load_requests(w)) for w in ranked})


class RoundRobinPolicy:
    """The next candidate in configuration order, cycling; skips unhealthy and draining workers.

    State: one counter, advanced by one per decision that finds a candidate. With a changing candidate set the
    counter is taken modulo the current number of candidates.
    """

    name = "round_robin"

    def __init__(self, config: RoundRobinConfig) -> None:
        self.config = config
        self._num_decisions = 0

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose the next candidate; ranking continues the cycle from it."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        start = self._num_decisions % len(candidates)
        self._num_decisions += 1
        return _positional(candidates[start:] + candidates[:start], self.name)


class RandomPolicy:
    """A uniformly random candidate from a seeded RNG; ranking lists the rest in configuration order."""

    name = "random"

    def __init__(self, config: RandomConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Draw one candidate (one RNG draw per decision with a candidate)."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        index = self._rng.randrange(len(candidates))
        return _positional([candidates[index], *candidates[:index], *candidates[index + 1 :]], self.name)


class LeastLoadedPolicy:
    """Fewest running + waiting requests, then fewest pending prefill tokens, then configuration order."""

    name = "least_loaded"

    def __init__(self, config: LeastLoadedConfig) -> None:
        self.config = config

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose the least-loaded candidate; ranking is every candidate by load."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        return least_loaded_decision(candidates, self.name)


class PowerOfTwoPolicy:
    """Power of two choices (Mitzenmacher): two distinct random candidates, the less loaded wins.

    Load compares (running + waiting requests, pending prefill tokens); on a tie the first drawn wins. Ranking:
    the winner, the other drawn worker, then the rest by load.
    """

    name = "power_of_two"

    def __init__(self, config: PowerOfTwoConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Draw two candidates (one ``rng.sample`` per decision with two or more candidates)."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        scores = {w.worker_id: float(num_load_requests(w)) for w in candidates}
        if len(candidates) == 1:
            return _ranked_decision(candidates, self.name, scores)
        i, j = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[i], candidates[j]
        if load_key(second) < load_key(first):
            first, second = second, first
        rest = sorted((w for k, w in enumerate(candidates) if k != i and k != j), key=load_key)
        return _ranked_decision([first, second, *rest], self.name, scores)
