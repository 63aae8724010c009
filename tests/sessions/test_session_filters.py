"""Admin views of the session table: ``find_sessions`` (age and idle time, filters) and ``drop_sessions`` (bulk
drop by the same filters), on the memory store with an injected clock and on the Redis store against a real
redis-server (Redis's own clock: real, short waits)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from router.sessions.base import SessionFilter, SessionInfo
from router.sessions.config import SessionsConfig
from router.sessions.factory import build_session_store
from router.sessions.memory import REAP_SLICE, MemorySessionStore
from router.sessions.redis_scripts import SWEEP_PAGE
from router.sessions.redis_store import RedisSessionStore
from tests.sessions.fakes import FakeClock


async def memory_table() -> tuple[MemorySessionStore, FakeClock]:
    """Four sessions: ``sid:a`` (w1, created 1000, used 1005), ``sid:t1-b`` (w2, 1001), ``sid:t1-c`` (w1, 1002),
    ``user:d`` (w2, 1003); one expired (``sid:old``, used 980); now is 1006."""
    clock = FakeClock(980.0)
    store = MemorySessionStore(20.0, clock=clock)
    await store.claim_or_touch("sid:old", "w1")
    for now_s, key, worker in ((1000.0, "sid:a", "w1"), (1001.0, "sid:t1-b", "w2"), (1002.0, "sid:t1-c", "w1"),
                               (1003.0, "user:d", "w2"), (1005.0, "sid:a", "w9")):
        clock.now_s = now_s
        await store.claim_or_touch(key, worker)
    clock.now_s = 1006.0
    return store, clock


A = SessionInfo("sid:a", "w1", 1005.0, 1000.0, 1.0, 6.0)
B = SessionInfo("sid:t1-b", "w2", 1001.0, 1001.0, 5.0, 5.0)
C = SessionInfo("sid:t1-c", "w1", 1002.0, 1002.0, 4.0, 4.0)
D = SessionInfo("user:d", "w2", 1003.0, 1003.0, 3.0, 3.0)


@pytest.mark.unit
@pytest.mark.parametrize(("match", "expected"), [
    (SessionFilter(), [A, D, C, B]),
    (SessionFilter(worker_id="w1"), [A, C]),
    (SessionFilter(worker_id="w9"), []),
    (SessionFilter(key_prefix="sid:t1-"), [C, B]),
    (SessionFilter(min_idle_s=4.0), [C, B]),
    (SessionFilter(max_idle_s=3.0), [A, D]),
    (SessionFilter(min_idle_s=3.0, max_idle_s=4.0), [D, C]),
    (SessionFilter(min_age_s=5.0), [A, B]),
    (SessionFilter(worker_id="w2", key_prefix="sid:", min_age_s=5.0), [B]),
    (SessionFilter(min_idle_s=19.0), []),  # sid:old (idle 26 s) is expired: never listed
])
async def test_memory_find_sessions_by_filter(match: SessionFilter, expected: list[SessionInfo]) -> None:
    store, _ = await memory_table()
    assert await store.find_sessions(match, 100) == expected
    assert await store.find_sessions(match, 1) == expected[:1]


@pytest.mark.unit
async def test_memory_drop_sessions_by_filter() -> None:
    store, _ = await memory_table()
    assert await store.drop_sessions(SessionFilter(min_idle_s=4.0)) == 2  # B and C
    assert await store.find_sessions(SessionFilter(), 100) == [A, D]
    assert await store.drop_sessions(SessionFilter(worker_id="w2")) == 1
    assert await store.drop_sessions(SessionFilter(worker_id="w2")) == 0
    assert [(k, w) for k, w, _ in store.dump()] == [("sid:old", "w1"), ("sid:a", "w1")]  # the expired one: reaped
    assert store.stats().num_dropped_total == 3
    assert await store.drop_sessions(SessionFilter()) == 1 and await store.num_sessions() == 0


@pytest.mark.unit
async def test_memory_scans_in_slices_and_keep_age_across_moves() -> None:
    clock = FakeClock()
    store = MemorySessionStore(3600.0, clock=clock)
    num = 3 * REAP_SLICE + 7
    for i in range(num):
        clock.now_s = 1000.0 + i / 1000
        await store.claim_or_touch(f"sid:s{i}", f"w{i % 3}")
    clock.now_s = 2000.0
    newest = await store.find_sessions(SessionFilter(), 3)
    assert [e.session_key for e in newest] == [f"sid:s{num - 1}", f"sid:s{num - 2}", f"sid:s{num - 3}"]
    by_worker = await store.find_sessions(SessionFilter(worker_id="w1"), 2)  # newest first across slices too
    assert [e.session_key for e in by_worker] == [f"sid:s{i}" for i in (num - 3, num - 6)]
    assert await store.move("sid:s0", "w0", "w2")
    moved = await store.find_sessions(SessionFilter(max_idle_s=0.0), 10)
    assert moved == [SessionInfo("sid:s0", "w2", 2000.0, 1000.0, 0.0, 1000.0)]  # used now, created then
    num_w0 = len(range(0, num, 3)) - 1  # sid:s0 moved to w2
    assert await store.drop_sessions(SessionFilter(worker_id="w0")) == num_w0
    assert await store.drop_sessions(SessionFilter(min_idle_s=500.0)) == num - num_w0 - 1  # all but sid:s0
    assert [e.session_key for e in await store.find_sessions(SessionFilter(), 10)] == ["sid:s0"]


# -- the Redis store ----------------------------------------------------------------------------------------------


@pytest.fixture
async def redis_stores(redis_url: str, redis_key_prefix: str) -> AsyncIterator[list[RedisSessionStore]]:
    """Two replicas' stores on one Redis; TTLs refreshed at every use (``refresh_fraction`` tiny)."""
    config = SessionsConfig(store="redis", url=redis_url, key_prefix=redis_key_prefix, idle_timeout_s=60.0,
                            refresh_fraction=1e-6, command_timeout_s=5.0, connect_timeout_s=5.0,
                            enable_local_cache=True)
    made = []
    for _ in range(2):
        store = build_session_store(config, clock=time.monotonic)
        assert isinstance(store, RedisSessionStore)
        await store.start()
        made.append(store)
    yield made
    for store in made:
        await store.aclose()


@pytest.mark.integration
async def test_redis_find_and_drop_sessions_by_filter(redis_stores: list[RedisSessionStore]) -> None:
    a, b = redis_stores
    await a.claim_or_touch("sid:a", "w1")
    await b.claim_or_touch("sid:t1-b", "w2")
    await asyncio.sleep(0.6)
    await a.claim_or_touch("sid:t1-c", "w1")
    await asyncio.sleep(0.01)  # Redis's clock is in ms: sessions used in one ms would list in key order
    await b.claim_or_touch("sid:a", "w9")  # used again: idle 0, age 0.6 s
    listed = await b.find_sessions(SessionFilter(), 10)
    assert [(e.session_key, e.worker_id) for e in listed] == [("sid:a", "w1"), ("sid:t1-c", "w1"),
                                                               ("sid:t1-b", "w2")]
    by_key = {e.session_key: e for e in listed}
    assert by_key["sid:a"].age_s >= 0.6 > by_key["sid:a"].idle_s
    assert by_key["sid:t1-b"].idle_s >= 0.6 and by_key["sid:t1-c"].age_s < 0.6
    assert by_key["sid:a"].created_s == pytest.approx(by_key["sid:t1-b"].created_s, abs=0.3)
    assert by_key["sid:a"].last_used_s - by_key["sid:a"].created_s >= 0.6
    assert [e.session_key for e in await a.find_sessions(SessionFilter(worker_id="w1"), 10)] == [
        "sid:a", "sid:t1-c"]
    assert [e.session_key for e in await a.find_sessions(SessionFilter(key_prefix="sid:t1-"), 10)] == [
        "sid:t1-c", "sid:t1-b"]
    assert [e.session_key for e in await a.find_sessions(SessionFilter(min_idle_s=0.5), 10)] == ["sid:t1-b"]
    assert [e.session_key for e in await a.find_sessions(SessionFilter(max_idle_s=0.5), 10)] == [
        "sid:a", "sid:t1-c"]
    assert [e.session_key for e in await a.find_sessions(SessionFilter(min_age_s=0.5), 10)] == [
        "sid:a", "sid:t1-b"]
    assert await a.move("sid:a", "w1", "w3")
    moved = (await a.find_sessions(SessionFilter(worker_id="w3"), 10))[0]
    assert moved.created_s == by_key["sid:a"].created_s  # a move keeps the creation time

    # A bulk drop on one replica is seen by the other: its cached owner is gone, the next claim is a new session.
    assert (await b.claim_or_touch("sid:t1-b", "w5")).worker_id == "w2"
    assert await a.drop_sessions(SessionFilter(key_prefix="sid:t1-")) == 2
    assert await b.num_sessions() == 1

    async def b_forgot() -> bool:
        return (await b.claim_or_touch("sid:t1-b", "w5")).worker_id == "w5"

    deadline = time.monotonic() + 10
    while not await b_forgot():
        assert time.monotonic() < deadline, "replica b kept a dropped session"
        await asyncio.sleep(0.01)
    assert a.stats().num_dropped_total == 2


@pytest.mark.integration
async def test_redis_bulk_drop_walks_every_page(redis_stores: list[RedisSessionStore]) -> None:
    a, _ = redis_stores
    num = SWEEP_PAGE * 2 + 13
    for start in range(0, num, 200):
        await asyncio.gather(*(a.claim_or_touch(f"p:{i}", f"w{i % 2}") for i in range(start, min(num, start + 200))))
    await asyncio.gather(*(a.claim_or_touch(f"q:{i}", "w0") for i in range(5)))
    assert len(await a.find_sessions(SessionFilter(worker_id="w1"), 10_000)) == num // 2
    assert len(await a.find_sessions(SessionFilter(key_prefix="p:"), SWEEP_PAGE + 1)) == SWEEP_PAGE + 1
    assert await a.drop_sessions(SessionFilter(worker_id="w0", key_prefix="p:")) == (num + 1) // 2
    assert await a.drop_sessions(SessionFilter(key_prefix="p:")) == num // 2
    assert sorted(e.session_key for e in await a.find_sessions(SessionFilter(), 100)) == [f"q:{i}" for i in range(5)]
