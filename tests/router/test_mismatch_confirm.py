"""A mismatch nothing explains, with a pool watcher: counted once the watcher has asked the master about the blocks
not served; those evicted make it a forecast miss (``RequestLifecycle.count_mismatch``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from router.lifecycle import RequestLifecycle
from router.metrics import GatewayMetrics
from router.mismatch import NUM_CAUSE_REREADS

pytestmark = pytest.mark.unit


class Ticket:
    """An index ticket whose journals explain nothing for its first ``num_unexplained`` readings, then ``later``."""

    def __init__(self, watcher: Watcher, later: str = "index", num_unexplained: int = 1) -> None:
        self.watcher = watcher
        self.later, self.num_unexplained = later, num_unexplained
        self.num_reads = self.num_closes = 0

    def mismatch_cause(self, worker_id: str, predicted: int, reported: int) -> str:
        self.num_reads += 1
        return "index" if self.num_reads <= self.num_unexplained else self.later

    def close_window(self) -> None:
        self.num_closes += 1

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


async def settle(lc: RequestLifecycle) -> None:
    await asyncio.gather(*lc.mismatches._confirming)


async def test_evicted_blocks_found_by_the_watcher_count_as_a_forecast_miss():
    watcher = Watcher(gone=3)
    lc, metrics = lifecycle(watcher)
    ticket = Ticket(watcher)
    assert lc.count_mismatch("w", ticket, predicted=40, reported=28)  # type: ignore[arg-type]
    assert metrics.worker("w").num_mismatches["evicted"] == 0  # not counted before the master answered
    assert ticket.num_closes == 0  # its journal stamp held open for the confirmation
    await settle(lc)
    assert watcher.asked == [("m", [7, 8, 9])]
    assert metrics.worker("w").num_mismatches["evicted"] == 1 and metrics.worker("w").num_mismatches["index"] == 0
    assert ticket.num_closes == 1


async def test_events_that_came_while_the_master_was_asked_give_the_cause_read_again():
    cases = (  # (cause once the events are in, readings explaining nothing, counts, readings)
        ("evicted", 1, (1, 0, 0), 2),  # in when the master answered (the first reading is at the answer)
        ("pending", 5, (0, 1, 0), 6),  # in at the fourth reading after that
        ("pending", 2 + NUM_CAUSE_REREADS, (0, 0, 1), 2 + NUM_CAUSE_REREADS),  # too late: a wrong index
        ("index", 1, (0, 0, 1), 2 + NUM_CAUSE_REREADS),
    )
    for later, num_unexplained, counts, num_reads in cases:
        watcher = Watcher(gone=0)  # the master holds every block (put back, say, by the worker before its answer)
        lc, metrics = lifecycle(watcher)
        ticket = Ticket(watcher, later=later, num_unexplained=num_unexplained)
        assert lc.count_mismatch("w", ticket, predicted=40, reported=28)  # type: ignore[arg-type]
        await settle(lc)
        num = metrics.worker("w").num_mismatches
        assert (num["evicted"], num["pending"], num["index"]) == counts
        assert (ticket.num_reads, ticket.num_closes) == (num_reads, 1)


async def test_blocks_the_master_still_holds_stay_a_wrong_index_and_without_a_watcher_it_counts_at_once():
    watcher = Watcher(gone=0)
    lc, metrics = lifecycle(watcher)
    lc.count_mismatch("w", Ticket(watcher), predicted=40, reported=28)  # type: ignore[arg-type]
    await settle(lc)
    assert metrics.worker("w").num_mismatches["index"] == 1
    bare, counts = lifecycle(None)
    assert not bare.count_mismatch("w", Ticket(Watcher(0)), predicted=8, reported=0)  # type: ignore[arg-type]
    assert counts.worker("w").num_mismatches["index"] == 1


async def test_the_pd_prefill_legs_mismatches_count_through_the_same_confirmation():
    from router.pd import PDLifecycle

    metrics, watcher = GatewayMetrics(), Watcher(gone=2)
    pd = PDLifecycle(Router(watcher), None, None, metrics, None)  # type: ignore[arg-type]
    ticket = Ticket(watcher)
    assert pd.mismatches.count("w", ticket, predicted=40, reported=28)  # type: ignore[arg-type]
    await asyncio.gather(*pd.mismatches._confirming)
    assert watcher.asked == [("m", [7, 8, 9])] and ticket.num_closes == 1
    assert metrics.worker("w").num_mismatches["evicted"] == 1 and metrics.worker("w").num_mismatches["index"] == 0
