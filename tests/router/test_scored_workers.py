"""Large fleets: a decision scores the prefix holders plus a bounded, rotating load sample, not every worker."""

from __future__ import annotations

import pytest

from events.types import BlockStored, EventBatch
from router.block_hash import hash_token_blocks
from router.config import CircuitBreakerConfig, WorkerConfig
from router.fleet import WorkerRuntime
from router.index import IndexConfig, PrefixIndex
from router.index.result import MatchResult, WorkerMatch
from router.routing import LOAD_SAMPLE, MAX_SCORED_WORKERS, scored_workers

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


def test_a_prefix_the_whole_fleet_holds_scores_the_deepest_holders_and_the_sample() -> None:
    """100 workers hold the first block of a prompt (a shared system prompt), each to a depth of 1 to 5 blocks: a
    decision scores the 64 deepest (deepest first, then in the order the index first saw them) and 8 others."""
    workers = _fleet(100)
    by_id = {w.worker_id: w for w in workers}
    index = PrefixIndex(IndexConfig(block_size=2))
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, 2)
    for i in range(100):
        depth = 1 + i % 5
        event = BlockStored(tuple(range(1, depth + 1)), None, tuple(tokens[: 2 * depth]), 2)
        index.apply(EventBatch(f"w{i}", 0, 1, 0.0, (event,)))
    match = index.match(hashes)
    ids = [w.worker_id for w in scored_workers(workers, by_id, match, 0)]
    deepest = [f"w{i}" for depth in (5, 4, 3, 2) for i in range(100) if 1 + i % 5 == depth][:MAX_SCORED_WORKERS]
    assert ids[:MAX_SCORED_WORKERS] == deepest
    assert ids[MAX_SCORED_WORKERS:] == ["w0", "w5", "w10", "w15", "w20", "w21", "w25", "w26"]
    assert [match.workers[w].num_gpu_blocks for w in ("w4", "w3", "w0")] == [5, 4, 1]
