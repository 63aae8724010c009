"""The Redis session store against a real redis-server: two store instances play two gateway replicas."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from router.sessions.config import SessionsConfig
from router.sessions.factory import build_session_store
from router.sessions.redis_store import RedisSessionStore
from tests.sessions.fakes import FakeClock

pytestmark = pytest.mark.integration

DEADLINE_S = 10.0


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it is true, failing after DEADLINE_S (no fixed sleeps)."""
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def stores() -> AsyncIterator[list[RedisSessionStore]]:
    """Collects stores made by ``make``; closes them after the test."""
    made: list[RedisSessionStore] = []
    yield made
    for store in made:
        await store.aclose()


@pytest.fixture
def make(redis_url: str, redis_key_prefix: str, stores: list[RedisSessionStore]):
    async def _make(url: str | None = None, clock: Callable[[], float] = time.monotonic, environ=None,
                    **overrides) -> RedisSessionStore:
        # Generous timeouts: on a loaded machine a burst of commands (and the new connections it opens) can take
        # longer than the default 0.5 s, which would (correctly) send claims to the local fallback; tests of that
        # set their own.
        fields = dict(store="redis", url=url or redis_url, key_prefix=redis_key_prefix, idle_timeout_s=60.0,
                      reconnect_interval_s=0.05, command_timeout_s=5.0, connect_timeout_s=5.0)
        fields.update(overrides)
        store = build_session_store(SessionsConfig(**fields), clock=clock, environ=environ)
        assert isinstance(store, RedisSessionStore)
        stores.append(store)
        await store.start()
        return store

    return _make


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_first_claims_from_two_replicas_end_with_one_owner(make, raw, redis_key_prefix) -> None:
    a, b = await make(), await make()
    keys = [f"conv-{i}" for i in range(40)]
    results = await asyncio.gather(*(store.claim_or_touch(key, worker)
                                     for key in keys for store, worker in ((a, "w-a"), (b, "w-b"))))
    for i, key in enumerate(keys):
        first, second = results[2 * i], results[2 * i + 1]
        assert first.worker_id == second.worker_id
        assert [first.is_new, second.is_new].count(True) == 1
        stored = await raw.hget(f"{redis_key_prefix}s:{key}", "w")
        assert stored == first.worker_id.encode()
    assert a.stats().num_created_total + b.stats().num_created_total == 40
    assert await a.num_sessions() == 40


async def test_key_layout_and_ttl_refresh_is_throttled(make, raw, redis_key_prefix) -> None:
    clock = FakeClock()
    a = await make(clock=clock, idle_timeout_s=100.0, refresh_fraction=0.5)
    first = await a.claim_or_touch("s1", "w1")
    assert (first.worker_id, first.is_new) == ("w1", True)
    key = f"{redis_key_prefix}s:s1"
    stored = await raw.hgetall(key)
    assert stored[b"w"] == b"w1" and int(stored[b"t"]) == round(first.last_used_s * 1000)
    assert 99_000 < await raw.pttl(key) <= 100_000
    assert await raw.zscore(f"{redis_key_prefix}idx", "s1") == int(stored[b"t"])
    assert await raw.zscore(f"{redis_key_prefix}w:w1", "s1") == int(stored[b"t"])
    await raw.pexpire(key, 30_000)
    clock.now_s += 49.0  # under refresh_fraction * idle_timeout_s = 50 s since the last refresh: no refresh
    assert (await a.claim_or_touch("s1", "w2")).worker_id == "w1"
    assert await raw.pttl(key) <= 30_000
    clock.now_s += 1.0  # 50 s since the last refresh: refreshed
    assert (await a.claim_or_touch("s1", "w2")).worker_id == "w1"
    assert await raw.pttl(key) > 99_000


async def test_idle_session_expires_in_redis(make, raw, redis_key_prefix) -> None:
    a, b = await make(idle_timeout_s=0.2), await make(idle_timeout_s=0.2)
    assert (await a.claim_or_touch("s1", "w1")).is_new
    assert (await b.claim_or_touch("s1", "w2")).worker_id == "w1"

    async def expired() -> bool:
        return await raw.exists(f"{redis_key_prefix}s:s1") == 0

    await eventually(expired, "the session key to expire")
    assert await b.num_sessions() == 0
    assert await b.list_sessions(10) == []
    entry = await b.claim_or_touch("s1", "w2")
    assert (entry.worker_id, entry.is_new) == ("w2", True)
    assert (await a.claim_or_touch("s1", "w1")).worker_id == "w2"


async def test_failover_move_is_seen_by_the_other_replica_through_its_cache(make) -> None:
    # A long cache TTL: only the pub/sub invalidation can make b see the move.
    a = await make(enable_local_cache=True, local_cache_ttl_s=600.0)
    b = await make(enable_local_cache=True, local_cache_ttl_s=600.0)

    async def both_subscribed() -> bool:
        return a.is_cache_active and b.is_cache_active

    await eventually(both_subscribed, "both replicas to subscribe")
    assert (await a.claim_or_touch("s1", "w1")).is_new
    fetched = await b.claim_or_touch("s1", "w9")  # from Redis, now cached on b
    assert (fetched.worker_id, fetched.is_new) == ("w1", False)
    assert await b.claim_or_touch("s1", "w9") == fetched
    assert b.stats().num_cache_hits_total == 1
    assert await a.move("s1", "w1", "w2") is True

    async def b_sees_w2() -> bool:
        return (await b.claim_or_touch("s1", "w9")).worker_id == "w2"

    await eventually(b_sees_w2, "replica b to see the move")
    assert await b.move("s1", "w1", "w3") is False  # b's stale view cannot move it back
    assert (await a.claim_or_touch("s1", "w9")).worker_id == "w2"
    assert b.stats().num_move_conflicts_total == 1 and a.stats().num_moved_total == 1


async def test_concurrent_moves_compare_and_set_one_wins(make, raw, redis_key_prefix) -> None:
    a, b = await make(), await make()
    await a.claim_or_touch("s1", "w1")
    moved_a, moved_b = await asyncio.gather(a.move("s1", "w1", "w2"), b.move("s1", "w1", "w3"))
    assert [moved_a, moved_b].count(True) == 1
    winner = "w2" if moved_a else "w3"
    assert await raw.hget(f"{redis_key_prefix}s:s1", "w") == winner.encode()
    assert await raw.zrange(f"{redis_key_prefix}w:w1", 0, -1) == []
    assert await raw.zrange(f"{redis_key_prefix}w:{winner}", 0, -1) == [b"s1"]
    assert await a.move("nope", "w1", "w2") is False


async def test_list_drop_and_drop_worker_across_replicas(make, raw, redis_key_prefix) -> None:
    a, b = await make(), await make()
    await a.claim_or_touch("s1", "w1")
    await b.claim_or_touch("s2", "w1")
    await b.claim_or_touch("s3", "w2")
    listed = await a.list_sessions(10)
    assert sorted((e.session_key, e.worker_id) for e in listed) == [("s1", "w1"), ("s2", "w1"), ("s3", "w2")]
    assert [e.session_key for e in await a.list_sessions(1)] == [max(listed, key=lambda e: e.last_used_s).session_key]
    assert await a.drop("s3") is True
    assert await b.drop("s3") is False
    assert await a.drop_worker("w1") == 2
    assert await b.num_sessions() == 0
    assert await raw.keys(f"{redis_key_prefix}*") == []
    assert (await b.claim_or_touch("s1", "w5")).is_new


async def test_redis_stopped_and_started_again(restartable_redis, make, caplog) -> None:
    caplog.set_level(logging.INFO, logger="router.sessions")
    url = restartable_redis.url
    a, b = await make(url=url), await make(url=url)
    assert (await a.claim_or_touch("known", "w1")).is_new
    assert (await b.claim_or_touch("known", "w2")).worker_id == "w1"
    restartable_redis.stop()

    # Every request still gets an answer; sessions this replica knew stay on their owner.
    assert (await a.claim_or_touch("known", "w7")).worker_id == "w1"
    assert (await b.claim_or_touch("known", "w7")).worker_id == "w1"
    assert a.is_degraded and b.is_degraded
    new_a = await a.claim_or_touch("new", "w3")
    new_b = await b.claim_or_touch("new", "w4")
    assert (new_a.worker_id, new_b.worker_id) == ("w3", "w4")  # diverged while apart
    for _ in range(20):
        assert (await a.claim_or_touch("new", "w9")).worker_id == "w3"
    assert await a.move("known", "w1", "w5") is True
    assert (await a.list_sessions(10))[0].session_key == "known"
    stats = a.stats()
    assert (stats.is_degraded, stats.num_fallbacks_total) == (True, 1)
    unavailable = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert len(unavailable) == 2  # one line per replica per outage

    restartable_redis.start()  # empty: no persistence

    async def converged() -> bool:
        return not a.is_degraded and not b.is_degraded

    await eventually(converged, "both replicas to leave degraded mode")
    owner_a = (await a.claim_or_touch("new", "w9")).worker_id
    owner_b = (await b.claim_or_touch("new", "w9")).worker_id
    assert owner_a == owner_b and owner_a in ("w3", "w4")
    # "known": a wrote back its local move (w5) or b wrote back w1, whichever came first; both now agree.
    assert (await a.claim_or_touch("known", "w9")).worker_id == (await b.claim_or_touch("known", "w9")).worker_id
    assert await a.num_sessions() == 2
    assert len([r for r in caplog.records if "is back" in r.getMessage()]) == 2


async def test_secrets_never_in_logs_or_repr(tmp_path, caplog) -> None:
    from tests.redis_server import make_redis_server

    password = "pa55-Sekrit-42"
    server = make_redis_server(tmp_path, password=password)
    server.start()
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(password + "\n")
    caplog.set_level(logging.DEBUG)
    made: list[RedisSessionStore] = []
    try:
        for config in (
            SessionsConfig(store="redis", url=server.url, password_file=str(secret_file), reconnect_interval_s=0.05),
            SessionsConfig(store="redis", url_env="KV_URL", reconnect_interval_s=0.05),
        ):
            store = build_session_store(config, environ={"KV_URL": f"redis://:{password}@127.0.0.1:{server.port}/0"})
            assert isinstance(store, RedisSessionStore)
            made.append(store)
            await store.start()
            assert (await store.claim_or_touch("s", "w1")).worker_id == "w1"
            assert not store.is_degraded
        wrong = build_session_store(SessionsConfig(store="redis", url_env="KV_URL"),
                                    environ={"KV_URL": f"redis://:{password}x@127.0.0.1:{server.port}/0"})
        assert isinstance(wrong, RedisSessionStore)
        made.append(wrong)
        assert (await wrong.claim_or_touch("s", "w2")).worker_id == "w2"  # auth fails: the fallback answers
        assert wrong.is_degraded
        server.stop()
        for store in made:
            await store.claim_or_touch("s2", "w1")
        shown = caplog.text + "".join(repr(s) + repr(s.stats()) for s in made) + repr(config)
        assert "Redis unavailable" in caplog.text
        assert password not in shown
    finally:
        for store in made:
            await store.aclose()
        server.stop()


async def test_malformed_invalidation_message_is_dropped(make, raw, redis_key_prefix, caplog) -> None:
    a = await make(enable_local_cache=True)

    async def subscribed() -> bool:
        return a.is_cache_active

    await eventually(subscribed, "the subscription")
    await a.claim_or_touch("s1", "w1")
    await raw.publish(f"{redis_key_prefix}changes", b"\xc1not msgpack")

    async def logged() -> bool:
        return "malformed invalidation" in caplog.text

    await eventually(logged, "the drop to be logged")
    assert (await a.claim_or_touch("s1", "w2")).worker_id == "w1"
    assert a.is_cache_active


async def test_bad_arguments_raise_value_error(make) -> None:
    a = await make()
    with pytest.raises(ValueError):
        await a.claim_or_touch("", "w1")
    with pytest.raises(ValueError):
        await a.move("s", "w1", "")
    with pytest.raises(ValueError):
        await a.list_sessions(-1)


async def test_hung_redis_times_out_to_fallback_and_replays_worker_drop(make, raw, redis_key_prefix) -> None:
    a = await make(command_timeout_s=0.1)
    b = await make()
    assert (await b.claim_or_touch("kept", "w2")).is_new
    assert (await b.claim_or_touch("gone", "w1")).is_new
    assert (await a.claim_or_touch("kept", "w9")).worker_id == "w2"
    await raw.execute_command("CLIENT", "PAUSE", 800, "ALL")  # Redis stops answering (data stays)

    entry = await a.claim_or_touch("kept", "w9")  # times out after 0.1 s; the fallback answers
    assert (entry.worker_id, a.is_degraded) == ("w2", True)
    assert await a.move("kept", "w2", "w3") is True  # a local move while apart
    assert await a.drop_worker("w1") == 0  # a never saw "gone": replayed on Redis later
    assert (await a.claim_or_touch("fresh", "w4")).is_new

    async def converged() -> bool:
        return not a.is_degraded

    await eventually(converged, "a to reconnect")
    stored = {k: await raw.hget(f"{redis_key_prefix}s:{k}", "w") for k in ("kept", "gone", "fresh")}
    # Redis's owner wins over a's local move; the worker drop was replayed; a's new session was written back.
    assert stored == {"kept": b"w2", "gone": None, "fresh": b"w4"}
    assert (await b.claim_or_touch("fresh", "w0")).worker_id == "w4"
    assert a.stats().num_fallbacks_total == 1


async def test_burst_beyond_the_pool_queues_for_a_connection(restartable_redis, make, redis_key_prefix) -> None:
    # A private server: every client named "kvgate" on it is this store's.
    raw = aioredis.Redis.from_url(restartable_redis.url)
    try:
        a = await make(url=restartable_redis.url, max_connections=4)
        keys = [f"burst-{i}" for i in range(100)]
        entries = await asyncio.gather(*(a.claim_or_touch(key, f"w{i % 7}") for i, key in enumerate(keys)))
        assert [(e.session_key, e.worker_id, e.is_new) for e in entries] == [
            (key, f"w{i % 7}", True) for i, key in enumerate(keys)]
        stats = a.stats()
        assert (stats.is_degraded, stats.num_fallbacks_total, stats.num_backend_errors_total) == (False, 0, 0)
        assert stats.num_created_total == 100
        stored = [await raw.hget(f"{redis_key_prefix}s:{key}", "w") for key in keys]
        assert stored == [f"w{i % 7}".encode() for i in range(100)]
        # No connection was closed (nothing failed), so the ones alive now are all the store ever opened.
        # All 100 calls reach the pool before any answer comes back: max_connections is reached, not exceeded.
        names = [client["name"] for client in await raw.client_list()]
        assert names.count("kvgate") == 4
        assert names.count("kvgate") + 1 == len(names)  # + raw's own
    finally:
        await raw.aclose()


async def test_pool_wait_past_command_timeout_falls_back(make, raw, redis_key_prefix) -> None:
    a = await make(max_connections=1, command_timeout_s=0.2)
    pool = a._client.connection_pool
    held = await pool.get_connection()  # the pool's only connection: the next command waits for it
    try:
        started_s = time.monotonic()
        entry = await a.claim_or_touch("s1", "w1")  # waits 0.2 s for a connection; the fallback answers
        assert time.monotonic() - started_s >= 0.19  # it queued (no "Too many connections" at once)
        assert (entry.worker_id, entry.is_new) == ("w1", True)
        stats = a.stats()
        assert (stats.is_degraded, stats.num_fallbacks_total, stats.num_backend_errors_total) == (True, 1, 1)
        assert (await a.claim_or_touch("s1", "w2")).worker_id == "w1"
        assert await raw.exists(f"{redis_key_prefix}s:s1") == 0
    finally:
        await pool.release(held)

    async def converged() -> bool:
        return not a.is_degraded

    await eventually(converged, "a to get a connection again")
    assert await raw.hget(f"{redis_key_prefix}s:s1", "w") == b"w1"  # written back
    assert (await a.claim_or_touch("s1", "w2")).worker_id == "w1"
    assert a.stats().num_fallbacks_total == 1
