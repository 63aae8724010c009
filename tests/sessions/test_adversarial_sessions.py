"""Many sessions expiring at once: reaping forgets exactly the expired ones, takes time linear in their number, and
yields to the event loop between slices, so the request path is never held for long."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.sessions.config import SessionsConfig
from router.sessions.factory import build_session_store
from router.sessions.memory import REAP_SLICE, MemorySessionStore
from router.sessions.redis_store import RedisSessionStore
from router.sessions.refresh_table import RefreshTable
from tests.ports import free_port
from tests.sessions.fakes import FakeClock

pytestmark = pytest.mark.unit

IDLE_S = 60.0


async def reap_counting_yields(reap) -> tuple[int, int]:
    """Run ``reap()`` next to a task that counts event loop turns; returns (reaped, turns seen meanwhile)."""
    num_turns = 0
    is_done = False

    async def ticker() -> None:
        nonlocal num_turns
        while not is_done:
            await asyncio.sleep(0)
            num_turns += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    num_turns = 0
    num_reaped = await reap()
    is_done = True
    await task
    return num_reaped, num_turns


@pytest.mark.asyncio
async def test_memory_store_reaps_many_expired_sessions_in_slices_and_keeps_the_live_ones() -> None:
    clock = FakeClock()
    store = MemorySessionStore(IDLE_S, clock=clock, max_num_sessions=200_000)
    num_expiring = 10 * REAP_SLICE + 7
    for i in range(num_expiring):
        store.claim_or_touch_sync(f"old-{i}", f"w{i % 3}")
    clock.now_s += 30.0
    store.claim_or_touch_sync("live", "w1")
    clock.now_s += IDLE_S - 29.0  # every "old-*" session is now idle past the timeout; "live" is not
    num_reaped, num_turns = await reap_counting_yields(store.reap_expired)
    assert num_reaped == num_expiring
    assert num_turns >= 10  # one yield after each full slice
    assert store.dump() == [("live", "w1", 1030.0)]
    assert store._by_worker == {"w1": {"live"}}
    stats = store.stats()
    assert (stats.num_live_sessions, stats.num_created_total, stats.num_expired_total) == (1, num_expiring + 1,
                                                                                            num_expiring)
    assert await store.reap_expired() == 0
    assert await store.drop_worker("w1") == 1 and store.dump() == []


@pytest.mark.asyncio
async def test_memory_store_reap_with_a_bound_takes_the_oldest_first() -> None:
    clock = FakeClock()
    store = MemorySessionStore(IDLE_S, clock=clock)
    for i in range(5):
        store.claim_or_touch_sync(f"k{i}", "w0")
        clock.now_s += 1.0
    clock.now_s = 1000.0 + IDLE_S + 2.0  # k0, k1, k2 expired (last used at 1000, 1001, 1002)
    assert store.reap_expired_sync(2) == 2
    assert [key for key, _, _ in store.dump()] == ["k2", "k3", "k4"]
    assert store.reap_expired_sync() == 1
    assert [key for key, _, _ in store.dump()] == ["k3", "k4"]


def _evict_and_reap_s(num_entries: int) -> float:
    """Seconds to evict ``num_entries`` entries at the bound and reap as many, with the exact outcome asserted."""
    table = RefreshTable(num_entries)
    for i in range(num_entries):
        table.refreshed(f"k{i}", "w0", 0.0)
    t0 = time.perf_counter()
    for i in range(num_entries):  # at the bound: each refresh of a new key evicts the oldest
        table.refreshed(f"n{i}", "w0", 5.0)
    table.refreshed("late", "w1", 20.0)
    assert len(table) == num_entries and table.get("n0") is None and table.get("n1") == ("w0", 5.0)
    assert table.reap(10.0) == num_entries - 1
    elapsed_s = time.perf_counter() - t0
    assert len(table) == 1 and table.get("late") == ("w1", 20.0)
    return elapsed_s


def test_refresh_table_reap_and_eviction_are_linear() -> None:
    """Deleting keys from the front of a plain dict made each later front lookup walk every deleted slot: reaping
    300,000 keys took about 12 s and each eviction at the bound O(entries). Both are linear now. The check is a
    ratio of two sizes measured back to back (10x the entries: about 10x the time when linear, about 100x when
    quadratic), so a loaded machine slows both alike instead of failing a wall-clock bound."""
    small_s = min(_evict_and_reap_s(30_000) for _ in range(3))
    large_s = _evict_and_reap_s(300_000)
    assert large_s < 35.0 * small_s, f"{large_s:.2f} s for 300,000 against {small_s:.3f} s for 30,000"


@pytest.mark.asyncio
async def test_redis_store_reap_yields_between_slices_without_touching_redis() -> None:
    clock = FakeClock()
    config = SessionsConfig(store="redis", url=f"redis://127.0.0.1:{free_port()}", idle_timeout_s=IDLE_S)
    store = build_session_store(config, clock=clock)
    assert isinstance(store, RedisSessionStore)
    try:
        num_expiring = 5 * REAP_SLICE + 1
        for i in range(num_expiring):  # what num_expiring claims answered by Redis leave behind
            store._refresh.refreshed(f"k{i}", "w0", clock.now_s)
        store._refresh.refreshed("live", "w0", clock.now_s + 30.0)
        clock.now_s += IDLE_S + 1.0
        num_reaped, num_turns = await reap_counting_yields(store.reap_expired)
        assert num_reaped == num_expiring
        assert num_turns >= 5
        assert len(store._refresh) == 1 and store._refresh.get("live") == ("w0", 1030.0)
        assert store.stats().num_expired_total == num_expiring
    finally:
        await store.aclose()


def test_refresh_table_counts_live_entries_from_the_oldest_on() -> None:
    """``stats()`` (each metrics scrape) counts live sessions: it reads only the expired entries at the front,
    never the whole table."""
    table = RefreshTable(100)
    for i in range(10):
        table.refreshed(f"k{i}", "w0", float(i))
    table.refreshed("k0", "w1", 20.0)  # refreshed again: moves to the end
    table.set_owner("k5", "w2")  # an owner change keeps the order
    assert [table.num_live(cutoff_s) for cutoff_s in (-1.0, 0.0, 1.0, 4.5, 9.0, 19.0, 20.0)] == [10, 10, 9, 6, 1, 1,
                                                                                                 0]
