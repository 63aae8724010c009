"""The in-memory session store: claims, idle expiry on an injected clock, moves, drops, bounds, counters."""

from __future__ import annotations

import pytest

from router.sessions.base import SessionEntry, SessionStore
from router.sessions.memory import MemorySessionStore
from tests.sessions.fakes import FakeClock

pytestmark = pytest.mark.unit


def make_store(idle_timeout_s: float = 10.0, max_num_sessions: int = 100) -> tuple[MemorySessionStore, FakeClock]:
    clock = FakeClock()
    return MemorySessionStore(idle_timeout_s, clock=clock, max_num_sessions=max_num_sessions), clock


def test_satisfies_protocol() -> None:
    store, _ = make_store()
    as_protocol: SessionStore = store
    assert as_protocol.idle_timeout_s == 10.0


async def test_first_claim_then_touch_returns_owner() -> None:
    store, clock = make_store()
    assert await store.claim_or_touch("s1", "w1") == SessionEntry("s1", "w1", 1000.0, True)
    clock.now_s = 1005.0
    # a different proposal does not take the session
    assert await store.claim_or_touch("s1", "w2") == SessionEntry("s1", "w1", 1005.0, False)
    assert store.dump() == [("s1", "w1", 1005.0)]


async def test_idle_expiry_is_exact_on_the_boundary() -> None:
    store, clock = make_store(idle_timeout_s=10.0)
    await store.claim_or_touch("s1", "w1")
    clock.now_s = 1009.5
    assert (await store.claim_or_touch("s1", "w2")).worker_id == "w1"  # touched at 1009.5
    clock.now_s = 1019.5  # exactly idle_timeout_s later: expired
    assert await store.num_sessions() == 0
    assert await store.claim_or_touch("s1", "w2") == SessionEntry("s1", "w2", 1019.5, True)
    stats = store.stats()
    assert (stats.num_created_total, stats.num_expired_total, stats.num_live_sessions) == (2, 1, 1)


async def test_reap_pops_oldest_first_and_counts() -> None:
    store, clock = make_store(idle_timeout_s=10.0)
    for i, key in enumerate(["a", "b", "c"]):
        clock.now_s = 1000.0 + i
        await store.claim_or_touch(key, f"w{i}")
    clock.now_s = 1011.0  # a (1000) and b (1001) expired, c (1002) live
    assert await store.num_sessions() == 1
    assert await store.reap_expired() == 2
    assert store.dump() == [("c", "w2", 1002.0)]
    assert store.stats().num_expired_total == 2
    assert await store.reap_expired() == 0


async def test_move_is_compare_and_set() -> None:
    store, clock = make_store()
    await store.claim_or_touch("s1", "w1")
    clock.now_s = 1003.0
    assert await store.move("s1", "w2", "w3") is False
    assert await store.move("s1", "w1", "w3") is True
    assert await store.move("s1", "w1", "w4") is False  # the second mover loses
    assert store.dump() == [("s1", "w3", 1003.0)]
    assert await store.drop_worker("w1") == 0
    stats = store.stats()
    assert (stats.num_moved_total, stats.num_move_conflicts_total) == (1, 2)


async def test_move_of_expired_or_unknown_session_fails() -> None:
    store, clock = make_store(idle_timeout_s=10.0)
    assert await store.move("nope", "w1", "w2") is False
    await store.claim_or_touch("s1", "w1")
    clock.now_s = 1010.0
    assert await store.move("s1", "w1", "w2") is False


async def test_drop_and_drop_worker() -> None:
    store, clock = make_store()
    await store.claim_or_touch("a", "w1")
    await store.claim_or_touch("b", "w1")
    await store.claim_or_touch("c", "w2")
    assert await store.drop("c") is True
    assert await store.drop("c") is False
    assert await store.drop_worker("w1") == 2
    assert store.dump() == []
    assert store.stats().num_dropped_total == 3


async def test_list_sessions_most_recent_first_without_expired() -> None:
    store, clock = make_store(idle_timeout_s=10.0)
    for i, key in enumerate(["a", "b", "c", "d"]):
        clock.now_s = 1000.0 + i
        await store.claim_or_touch(key, "w1")
    clock.now_s = 1004.0
    await store.claim_or_touch("a", "w9")  # touch: a is now the most recent
    assert [e.session_key for e in await store.list_sessions(3)] == ["a", "d", "c"]
    clock.now_s = 1012.5  # b (1001) and c (1002) expired
    assert await store.list_sessions(10) == [
        SessionEntry("a", "w1", 1004.0, False),
        SessionEntry("d", "w1", 1003.0, False),
    ]
    with pytest.raises(ValueError):
        await store.list_sessions(-1)


async def test_bound_evicts_least_recently_used() -> None:
    store, clock = make_store(max_num_sessions=2)
    for i, key in enumerate(["a", "b", "c"]):
        clock.now_s = 1000.0 + i
        await store.claim_or_touch(key, "w1")
    assert [k for k, _, _ in store.dump()] == ["b", "c"]
    assert store.stats().num_evicted_total == 1


async def test_bad_arguments_raise_value_error_and_change_nothing() -> None:
    store, _ = make_store()
    with pytest.raises(ValueError):
        await store.claim_or_touch("", "w1")
    with pytest.raises(ValueError):
        await store.claim_or_touch("s", "")
    with pytest.raises(ValueError):
        await store.move("s", "w1", "")
    assert store.dump() == []
    with pytest.raises(ValueError):
        MemorySessionStore(0.0)
