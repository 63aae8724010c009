"""Large fleets: a decision scores the prefix holders plus a bounded, rotating load sample, not every worker."""

from __future__ import annotations

import pytest

from router.config import CircuitBreakerConfig, WorkerConfig
from router.fleet import WorkerRuntime
from router.index.result import MatchResult, WorkerMatch
from router.routing import LOAD_SAMPLE, scored_workers

pytestmark = pytest.mark.unit


def _fleet(n: int) -> tuple[WorkerRuntime, ...]:
    return tuple(WorkerRuntime(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", model="m"), 16,
                               CircuitBreakerConfig()) for i in range(n))


def test_holders_then_a_window_that_moves_each_decision() -> None:
    workers = _fleet(100)
    by_id = {w.worker_id: w for w in workers}
    match = MatchResult({"w42": WorkerMatch("w42", 0, 10), "w3": WorkerMatch("w3", 0, 4)}, 10)
    ids = [w.worker_id for w in scored_workers(workers, by_id, match, 0)]
    assert ids == ["w42", "w3", "w0", "w1", "w2", "w4", "w5", "w6", "w7", "w8"]  # w3 is a holder, not sampled twice
    ids = [w.worker_id for w in scored_workers(workers, by_id, match, 1)]
    assert ids == ["w42", "w3", *(f"w{i}" for i in range(8, 16))]
    # The window wraps around the candidates.
    ids = [w.worker_id for w in scored_workers(workers, by_id, None, 12)]
    assert ids == ["w96", "w97", "w98", "w99", "w0", "w1", "w2", "w3"]
    assert len(ids) == LOAD_SAMPLE


def test_a_removed_holder_is_skipped_and_a_small_fleet_is_all_sampled() -> None:
    workers = _fleet(5)
    by_id = {w.worker_id: w for w in workers}
    match = MatchResult({"gone": WorkerMatch("gone", 0, 3), "w4": WorkerMatch("w4", 0, 3)}, 3)
    assert [w.worker_id for w in scored_workers(workers, by_id, match, 0)] == ["w4", "w0", "w1", "w2", "w3"]
