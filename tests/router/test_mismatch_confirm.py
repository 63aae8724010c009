"""A mismatch nothing explains, with a pool watcher: counted once the watcher has asked the master about the blocks
not served; those evicted make it a forecast miss (``RequestLifecycle.count_mismatch``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from router.lifecycle import RequestLifecycle
from router.metrics import GatewayMetrics

pytestmark = pytest.mark.unit


class Ticket:
    """An index ticket whose journals explain nothing."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def mismatch_cause(self, worker_id: str, predicted: int, reported: int) -> str:
        return "index"

    def missed_blocks(self, predicted: int, reported: int) -> tuple[str, Sequence[int]]:
        return "m", list(range(reported // 4, predicted // 4))


class Watcher:
    def __init__(self, gone: int) -> None:
        self.gone, self.dropped, self.asked = gone, 0, []

    async def confirm_gone(self, model: str, hashes: Sequence[int]) -> int:
        self.asked.append((model, list(hashes)))
        await asyncio.sleep(0)
        self.dropped = self.gone
        return self.gone


class Router:
    def __init__(self, watcher: Watcher | None) -> None:
        self.pool_watcher = watcher


def lifecycle(watcher: Watcher | None) -> tuple[RequestLifecycle, GatewayMetrics]:
    metrics = GatewayMetrics()
    return RequestLifecycle(Router(watcher), None, None, None, metrics), metrics  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_evicted_blocks_found_by_the_watcher_count_as_a_forecast_miss():
    watcher = Watcher(gone=3)
    lc, metrics = lifecycle(watcher)
    lc.count_mismatch("w", Ticket(watcher), predicted=40, reported=28)  # type: ignore[arg-type]
    assert metrics.worker("w").num_mismatches["evicted"] == 0  # not counted before the master answered
    await settle()
    assert watcher.asked == [("m", [7, 8, 9])]
    assert metrics.worker("w").num_mismatches["evicted"] == 1 and metrics.worker("w").num_mismatches["index"] == 0


async def test_blocks_the_master_still_holds_stay_a_wrong_index_and_without_a_watcher_it_counts_at_once():
    watcher = Watcher(gone=0)
    lc, metrics = lifecycle(watcher)
    lc.count_mismatch("w", Ticket(watcher), predicted=40, reported=28)  # type: ignore[arg-type]
    await settle()
    assert metrics.worker("w").num_mismatches["index"] == 1
    bare, counts = lifecycle(None)
    bare.count_mismatch("w", Ticket(Watcher(0)), predicted=8, reported=0)  # type: ignore[arg-type]
    assert counts.worker("w").num_mismatches["index"] == 1
