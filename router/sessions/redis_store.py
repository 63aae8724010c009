"""Redis session store: session ownership shared by every gateway replica, with a local fallback.

Request path: one round trip per request with a session key (``claim_or_touch``, a Lua script), none without
one; with ``enable_local_cache`` a cache hit costs none, except when the key's TTL is due for a refresh.

TTL refresh: a key's TTL (``idle_timeout_s``) is refreshed at most once per
``refresh_fraction * idle_timeout_s`` per replica; the replica keeps the time of its last refresh of each key
(``RefreshTable``). A session therefore expires between ``(1 - refresh_fraction) * idle_timeout_s`` and
``idle_timeout_s`` after its last use.

Local cache (optional): ``session_key -> owner`` for ``local_cache_ttl_s``, used only while this replica is
subscribed to ``<prefix>changes``; every move, drop and worker drop is published there (``redis_scripts``) and
evicts the entry on every replica. A result fetched while an invalidation arrived is not cached. Losing the
subscription clears the cache and turns it off until resubscribed.

Connections: at most ``max_connections`` per replica (redis-py's ``BlockingConnectionPool``; with
``enable_local_cache`` the invalidation subscription holds one of them). A burst of more concurrent commands
queues for a free connection instead of failing; the wait counts toward the command's ``command_timeout_s``, so a
command that cannot get a connection in time is answered like one Redis is too slow for (below).

Redis unavailable (connection refused or reset, a command slower than ``command_timeout_s``, any Redis error):
the call is answered by a local ``MemorySessionStore`` (the fallback), seeded with the owners this replica last
saw for the sessions it served, so those stay sticky. One warning line is logged per outage,
``stats().is_degraded`` turns on and ``num_fallbacks_total`` counts outages. A background task pings Redis every
``reconnect_interval_s``; no client request waits for it.

Convergence when Redis returns: the sessions the fallback holds are **written back as claims-if-absent** (the same
atomic claim as a first request), then the fallback is emptied and Redis answers again. A session Redis still
knows keeps Redis's owner; one it lost (a restart without persistence, or an expiry) gets the owner this
replica chose, and if two replicas both chose one, the first write-back wins and the other replica routes to it
from its next request on. Writing back (instead of discarding) keeps sessions created during the outage on the
worker that holds their KV; never overwriting keeps a decision other replicas may already have acted on. A move
made locally during the outage is thus not forced onto Redis: if Redis's owner is unhealthy the sticky policy
moves the session again (compare-and-set) on its next request. ``drop_worker`` calls made during the outage are
replayed on Redis first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from router.sessions import redis_scripts as scripts
from router.sessions.base import SessionEntry, SessionFilter, SessionInfo, SessionStoreStats
from router.sessions.config import RedisTarget, SessionsConfig
from router.sessions.errors import SessionBackendError
from router.sessions.memory import REAP_SLICE, MemorySessionStore
from router.sessions.refresh_table import RefreshTable

logger = logging.getLogger(__name__)

_WRITE_BACK_BATCH = 256


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisSessionStore:
    """Sessions in Redis, shared by every replica using the same ``key_prefix``. See the module docstring.

    All methods are safe to call concurrently from one event loop; none raises because Redis is down.
    """

    def __init__(self, config: SessionsConfig, target: RedisTarget,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Create the store; nothing connects until the first call or ``start()``.

        Args:
            config: the sessions config (``store: redis``).
            target: URL and password, resolved by ``config.resolve_redis_target``.
            clock: monotonic clock in seconds for local state (refresh throttle, cache, fallback).
        """
        self.idle_timeout_s = config.idle_timeout_s
        self._config = config
        self._target = target
        self._clock = clock
        self._idle_ms = str(max(1, round(config.idle_timeout_s * 1000)))
        self._refresh_interval_s = config.refresh_fraction * config.idle_timeout_s
        self._prefix = config.key_prefix
        self._index_key = scripts.index_key_name(config.key_prefix)
        self._channel = scripts.channel_name(config.key_prefix)
        kwargs: dict[str, Any] = {
            # Timeouts are applied per call with asyncio.timeout (below): redis-py's own socket_timeout wraps every
            # write in asyncio.wait_for, a task per command, which costs more than the round trip itself.
            "socket_timeout": None,
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": config.max_connections,
            # A command finding every connection busy waits for one (not "Too many connections", which would be
            # taken for an outage). The wait is inside the caller's asyncio.timeout; this bound is for the waits
            # outside one (the invalidation subscription).
            "timeout": config.command_timeout_s,
            "client_name": "kvgate",
        }
        if target.password is not None:
            kwargs["password"] = target.password
        pool = aioredis.BlockingConnectionPool.from_url(target.url, **kwargs)
        self._client: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._claim_script = self._client.register_script(scripts.CLAIM_OR_TOUCH)
        self._move_script = self._client.register_script(scripts.MOVE)
        self._drop_script = self._client.register_script(scripts.DROP)
        self._drop_worker_script = self._client.register_script(scripts.DROP_WORKER)
        self._list_script = self._client.register_script(scripts.LIST)
        self._count_script = self._client.register_script(scripts.COUNT)
        self._sweep_script = self._client.register_script(scripts.SWEEP)
        self._fallback = MemorySessionStore(config.idle_timeout_s, clock=clock,
                                            max_num_sessions=config.max_num_sessions, store_name="redis-fallback")
        self._refresh = RefreshTable(config.max_num_sessions)
        self._cache: dict[str, tuple[str, float, float]] = {}  # key -> (owner, last_used_s, expires_at_s)
        self._invalidation_seq = 0
        self._is_subscribed = False
        self._is_degraded = False
        self._pending_worker_drops: set[str] = set()
        self._reconnect_task: asyncio.Task[None] | None = None
        self._listener_task: asyncio.Task[None] | None = None
        self._is_closed = False
        self._num_created_total = 0
        self._num_expired_total = 0
        self._num_moved_total = 0
        self._num_move_conflicts_total = 0
        self._num_dropped_total = 0
        self._num_fallbacks_total = 0
        self._num_backend_errors_total = 0
        self._num_cache_hits_total = 0

    def __repr__(self) -> str:
        return (f"RedisSessionStore(endpoint={self._target.endpoint!r}, key_prefix={self._prefix!r}, "
                f"is_degraded={self._is_degraded})")

    @property
    def is_degraded(self) -> bool:
        """True while Redis is unreachable and the local fallback answers."""
        return self._is_degraded

    @property
    def is_cache_active(self) -> bool:
        """True when the local cache is configured and its invalidation subscription is live."""
        return self._config.enable_local_cache and self._is_subscribed

    async def _call(self, script: AsyncScript, keys: list[str], args: list[str | int]) -> Any:
        """Run one script, bounded by ``command_timeout_s`` (the wait for a pool connection included). Raises
        RedisError or OSError (TimeoutError)."""
        async with asyncio.timeout(self._config.command_timeout_s):
            return await script(keys=keys, args=args)

    async def _ping(self) -> None:
        async with asyncio.timeout(self._config.command_timeout_s):
            await self._client.ping()

    # -- failure handling ---------------------------------------------------------------------------------------

    def _translate(self, exc: BaseException) -> SessionBackendError:
        reason = f"{type(exc).__name__}: {exc}"
        for secret in (self._target.password, self._target.url):
            if secret:
                reason = reason.replace(secret, "***")
        return SessionBackendError(self._target.endpoint, reason)

    def _on_backend_error(self, exc: BaseException) -> None:
        """Count the error; on the first one of an outage switch to the fallback, log once, start reconnecting."""
        self._num_backend_errors_total += 1
        error = self._translate(exc)
        if self._is_degraded:
            logger.debug("%s", error)
            return
        self._is_degraded = True
        self._num_fallbacks_total += 1
        self._cache.clear()
        logger.warning("sessions: Redis unavailable (%s); routing on this replica's local sessions until it "
                       "returns", error)
        if not self._is_closed and (self._reconnect_task is None or self._reconnect_task.done()):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_loop())

    def _seed_fallback(self, session_key: str) -> None:
        """Put the owner this replica last saw for ``session_key`` into the fallback if it has none."""
        if self._fallback.peek_sync(session_key) is None:
            owner = self._refresh.live_owner(session_key, self._clock() - self.idle_timeout_s)
            if owner is not None:
                self._fallback.put_sync(session_key, owner)

    async def _reconnect_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reconnect_interval_s)
            try:
                await self._ping()
                num_written = await self._converge()
            except (RedisError, OSError) as exc:
                self._num_backend_errors_total += 1
                logger.debug("sessions: Redis still unavailable: %s", self._translate(exc))
                continue
            logger.warning("sessions: Redis at %s is back; %d local sessions written back (Redis's owner kept "
                           "where it had one)", self._target.endpoint, num_written)
            return

    async def _converge(self) -> int:
        """Replay worker drops, write the fallback's sessions back (claim-if-absent), leave degraded mode.

        Returns:
            Sessions written back. Raises the Redis error if Redis fails meanwhile (still degraded).
        """
        for worker_id in sorted(self._pending_worker_drops):
            await self._run_drop_worker(worker_id)
            self._pending_worker_drops.discard(worker_id)
        written: dict[str, str] = {}
        while True:
            pending = [(k, w) for k, w in self._fallback_live_owners() if written.get(k) != w]
            if not pending:
                break
            for start in range(0, len(pending), _WRITE_BACK_BATCH):
                batch = pending[start:start + _WRITE_BACK_BATCH]
                async with (asyncio.timeout(self._config.command_timeout_s * 4),
                            self._client.pipeline(transaction=False) as pipe):
                    for session_key, worker_id in batch:
                        await self._claim_script(
                            keys=[scripts.session_key_name(self._prefix, session_key), self._index_key],
                            args=[worker_id, self._idle_ms, "1", session_key, self._prefix], client=pipe)
                    results = await pipe.execute()
                now_s = self._clock()
                for (session_key, worker_id), result in zip(batch, results, strict=True):
                    written[session_key] = worker_id
                    self._refresh.refreshed(session_key, _text(result[0]), now_s)
        # No await between the emptiness check above and here: nothing can slip into the fallback unwritten.
        self._fallback.clear_sync()
        self._cache.clear()
        self._is_degraded = False
        return len(written)

    def _fallback_live_owners(self) -> list[tuple[str, str]]:
        cutoff_s = self._clock() - self.idle_timeout_s
        return [(k, w) for k, w, t in self._fallback.dump() if t > cutoff_s]

    # -- pub/sub invalidation -------------------------------------------------------------------------------------

    def _invalidate(self, payload: bytes) -> None:
        self._invalidation_seq += 1
        try:
            message = msgspec.msgpack.decode(payload)
            kind = _text(message[0])
        except (msgspec.DecodeError, IndexError, TypeError, UnicodeDecodeError):
            logger.warning("sessions: dropped a malformed invalidation message (%d bytes); cache cleared",
                           len(payload))
            self._cache.clear()
            return
        if kind == "w":
            worker_id = _text(message[1])
            for session_key in [k for k, v in self._cache.items() if v[0] == worker_id]:
                del self._cache[session_key]
            self._refresh.drop_worker(worker_id)
            return
        session_key = _text(message[1])
        self._cache.pop(session_key, None)
        if kind == "m":
            self._refresh.set_owner(session_key, _text(message[2]))
        else:
            self._refresh.pop(session_key)

    async def _listen_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self._cache.clear()
                        self._is_subscribed = True
                        logger.debug("sessions: subscribed to %s", self._channel)
                    elif message["type"] == "message":
                        self._invalidate(message["data"])
            except (RedisError, OSError) as exc:
                logger.debug("sessions: invalidation subscription lost: %s", self._translate(exc))
            finally:
                self._is_subscribed = False
                self._cache.clear()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
            await asyncio.sleep(self._config.reconnect_interval_s)

    # -- SessionStore protocol ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check Redis (degraded from the start if unreachable) and start the invalidation listener. Idempotent."""
        if self._listener_task is None and self._config.enable_local_cache:
            self._listener_task = asyncio.get_running_loop().create_task(self._listen_loop())
        if not self._is_degraded:
            try:
                await self._ping()
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)

    async def claim_or_touch(self, session_key: str, proposed_worker_id: str) -> SessionEntry:
        """Return the live owner, refreshing its TTL if due, or atomically claim for ``proposed_worker_id``.

        ``last_used_s`` is Redis's clock (Unix seconds) of the key's last refresh; from the fallback it is this
        store's clock.

        Raises:
            ValueError: an empty key or worker id.
        """
        if not session_key or not proposed_worker_id:
            raise ValueError("session_key and proposed_worker_id must be non-empty strings")
        if self._is_degraded:
            return self._fallback_claim(session_key, proposed_worker_id)
        now_s = self._clock()
        refreshed = self._refresh.get(session_key)
        needs_refresh = refreshed is None or now_s - refreshed[1] >= self._refresh_interval_s
        if not needs_refresh and self._is_subscribed and self._config.enable_local_cache:
            cached = self._cache.get(session_key)
            if cached is not None and cached[2] > now_s:
                self._num_cache_hits_total += 1
                return SessionEntry(session_key, cached[0], cached[1], False)
        seq = self._invalidation_seq
        try:
            owner_raw, last_ms, is_new = await self._call(
                self._claim_script, [scripts.session_key_name(self._prefix, session_key), self._index_key],
                [proposed_worker_id, self._idle_ms, "1" if needs_refresh else "0", session_key, self._prefix])
        except (RedisError, OSError) as exc:
            self._on_backend_error(exc)
            return self._fallback_claim(session_key, proposed_worker_id)
        owner = _text(owner_raw)
        last_used_s = int(last_ms) / 1000.0
        if needs_refresh or is_new:
            self._refresh.refreshed(session_key, owner, now_s)
        else:
            self._refresh.set_owner(session_key, owner)
        if is_new:
            self._num_created_total += 1
        if self._config.enable_local_cache and self._is_subscribed and seq == self._invalidation_seq:
            self._cache[session_key] = (owner, last_used_s, now_s + self._config.local_cache_ttl_s)
        return SessionEntry(session_key, owner, last_used_s, bool(is_new))

    def _fallback_claim(self, session_key: str, proposed_worker_id: str) -> SessionEntry:
        self._seed_fallback(session_key)
        entry = self._fallback.claim_or_touch_sync(session_key, proposed_worker_id)
        if entry.is_new:
            self._num_created_total += 1
        return entry

    async def move(self, session_key: str, expected_worker_id: str, new_worker_id: str) -> bool:
        """Compare-and-set the owner in Redis (published to every replica); False if the owner is not
        ``expected_worker_id``.

        Raises:
            ValueError: an empty key or worker id.
        """
        if not session_key or not expected_worker_id or not new_worker_id:
            raise ValueError("session_key, expected_worker_id and new_worker_id must be non-empty strings")
        if not self._is_degraded:
            try:
                is_moved = bool(await self._call(
                    self._move_script, [scripts.session_key_name(self._prefix, session_key), self._index_key],
                    [expected_worker_id, new_worker_id, self._idle_ms, session_key, self._prefix, self._channel]))
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
            else:
                self._cache.pop(session_key, None)
                if is_moved:
                    self._refresh.refreshed(session_key, new_worker_id, self._clock())
                return self._count_move(is_moved and expected_worker_id != new_worker_id, is_moved)
        self._seed_fallback(session_key)
        is_moved = self._fallback.move_sync(session_key, expected_worker_id, new_worker_id)
        return self._count_move(is_moved and expected_worker_id != new_worker_id, is_moved)

    def _count_move(self, is_change: bool, is_moved: bool) -> bool:
        if is_change:
            self._num_moved_total += 1
        elif not is_moved:
            self._num_move_conflicts_total += 1
        return is_moved

    async def drop(self, session_key: str) -> bool:
        """Forget a session on every replica; True if it existed (in Redis, or locally while degraded)."""
        self._cache.pop(session_key, None)
        self._refresh.pop(session_key)
        is_local = self._fallback.drop_sync(session_key)
        if self._is_degraded:
            self._num_dropped_total += int(is_local)
            return is_local
        try:
            existed = bool(await self._call(
                self._drop_script, [scripts.session_key_name(self._prefix, session_key), self._index_key],
                [session_key, self._prefix, self._channel]))
        except (RedisError, OSError) as exc:
            self._on_backend_error(exc)
            existed = False
        existed = existed or is_local
        self._num_dropped_total += int(existed)
        return existed

    async def _run_drop_worker(self, worker_id: str) -> int:
        return int(await self._call(
            self._drop_worker_script, [scripts.worker_key_name(self._prefix, worker_id), self._index_key],
            [worker_id, self._prefix, self._channel]))

    async def drop_worker(self, worker_id: str) -> int:
        """Forget every session of ``worker_id`` on every replica (replayed on Redis if it is down now)."""
        for session_key in [k for k, v in self._cache.items() if v[0] == worker_id]:
            del self._cache[session_key]
        self._refresh.drop_worker(worker_id)
        num_dropped = self._fallback.drop_worker_sync(worker_id)
        if not self._is_degraded:
            try:
                num_dropped = max(num_dropped, await self._run_drop_worker(worker_id))
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
                self._pending_worker_drops.add(worker_id)
        else:
            self._pending_worker_drops.add(worker_id)
        self._num_dropped_total += num_dropped
        return num_dropped

    async def list_sessions(self, limit: int) -> list[SessionEntry]:
        """Live sessions of every replica, most recently refreshed first (this replica's own while degraded)."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit!r}")
        if not self._is_degraded:
            try:
                flat: Sequence[Any] = await self._call(self._list_script, [self._index_key],
                                                       [limit, self._idle_ms, self._prefix])
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
            else:
                return [SessionEntry(_text(flat[i]), _text(flat[i + 1]), float(_text(flat[i + 2])) / 1000.0)
                        for i in range(0, len(flat), 3)]
        return self._fallback.list_sessions_sync(limit)

    async def num_sessions(self) -> int:
        """Live sessions of every replica (this replica's own while degraded)."""
        if not self._is_degraded:
            try:
                return int(await self._call(self._count_script, [self._index_key], [self._idle_ms]))
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
        return self._fallback.num_sessions_sync()

    async def _sweep(self, match: SessionFilter, limit: int | None, *, is_drop: bool) -> list[SessionInfo]:
        """Walk the sessions ``match`` takes in Redis, ``SWEEP_PAGE`` per round trip, most recently refreshed
        first: at most ``limit`` of them (``None``: all), dropped when ``is_drop``. Raises RedisError or OSError."""
        zset = (scripts.worker_key_name(self._prefix, match.worker_id) if match.worker_id is not None
                else self._index_key)
        ms = [str(max(0, round(x * 1000))) for x in (match.min_idle_s, match.min_age_s)]
        max_idle = str(max(0, round(match.max_idle_s * 1000))) if match.max_idle_s is not None else ""
        args_head: list[str | int] = [self._prefix, self._idle_ms, ms[0], max_idle, ms[1], match.worker_id or "",
                                      match.key_prefix]
        out: list[SessionInfo] = []
        offset = 0
        while limit is None or len(out) < limit:
            page: Sequence[Any] = await self._call(
                self._sweep_script, [zset],
                [*args_head, offset, scripts.SWEEP_PAGE, "1" if is_drop else "0", self._channel])
            now_ms = int(page[0])
            num_looked_at = int(page[1])
            num_matched = 0
            for i in range(2, len(page), 4):
                session_key, worker_id = _text(page[i]), _text(page[i + 1])
                t_ms, c_ms = int(page[i + 2]), int(page[i + 3])
                out.append(SessionInfo(session_key, worker_id, t_ms / 1000.0, c_ms / 1000.0,
                                       max(0, now_ms - t_ms) / 1000.0, max(0, now_ms - c_ms) / 1000.0))
                num_matched += 1
            if is_drop:
                for info in out[-num_matched:] if num_matched else ():
                    self._forget_locally(info.session_key)
            offset += num_looked_at - (num_matched if is_drop else 0)  # dropped members left the zset
            if num_looked_at < scripts.SWEEP_PAGE:
                break
        return out if limit is None else out[:limit]

    def _forget_locally(self, session_key: str) -> None:
        self._cache.pop(session_key, None)
        self._refresh.pop(session_key)
        self._fallback.drop_sync(session_key)

    async def find_sessions(self, match: SessionFilter, limit: int) -> list[SessionInfo]:
        """Live sessions of every replica that ``match`` takes, most recently refreshed first, at most ``limit``
        (this replica's own while degraded). ``last_used_s`` and ``created_s`` are Redis's clock (Unix seconds);
        idle time is counted from the last TTL refresh (``refresh_fraction``).

        Raises:
            ValueError: ``limit < 0``.
        """
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit!r}")
        if not self._is_degraded:
            try:
                return await self._sweep(match, limit, is_drop=False)
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
        return await self._fallback.find_sessions(match, limit)

    async def drop_sessions(self, match: SessionFilter) -> int:
        """Forget every session ``match`` takes, on every replica (each drop is published); returns how many. While
        degraded, this replica's own sessions only (Redis keeps its copies)."""
        num_dropped = 0
        if not self._is_degraded:
            try:
                num_dropped = len(await self._sweep(match, None, is_drop=True))
            except (RedisError, OSError) as exc:
                self._on_backend_error(exc)
        num_dropped += await self._fallback.drop_sessions(match)
        self._num_dropped_total += num_dropped
        return num_dropped

    async def reap_expired(self) -> int:
        """Forget local state (refresh times, cache, fallback) idle past ``idle_timeout_s``; Redis expires its
        keys itself. Returns how many sessions this replica saw expire."""
        now_s = self._clock()
        for session_key in [k for k, v in self._cache.items() if v[2] <= now_s]:
            del self._cache[session_key]
        num_expired = 0
        while True:  # REAP_SLICE at a time, yielding between slices: many keys expiring at once stall nothing
            num = self._refresh.reap(now_s - self.idle_timeout_s, REAP_SLICE)
            num_expired += num
            if num < REAP_SLICE:
                break
            await asyncio.sleep(0)
        num_expired += await self._fallback.reap_expired()
        self._num_expired_total += num_expired
        return num_expired

    def stats(self) -> SessionStoreStats:
        """Counters for metrics. ``num_live_sessions`` is this replica's view (see ``SessionStoreStats``)."""
        cutoff_s = self._clock() - self.idle_timeout_s
        num_live = self._fallback.num_sessions_sync() if self._is_degraded else self._refresh.num_live(cutoff_s)
        return SessionStoreStats(
            store="redis",
            num_live_sessions=num_live,
            num_created_total=self._num_created_total,
            num_expired_total=self._num_expired_total,
            num_moved_total=self._num_moved_total,
            num_move_conflicts_total=self._num_move_conflicts_total,
            num_dropped_total=self._num_dropped_total,
            is_degraded=self._is_degraded,
            num_fallbacks_total=self._num_fallbacks_total,
            num_backend_errors_total=self._num_backend_errors_total,
            num_cache_hits_total=self._num_cache_hits_total,
        )

    async def aclose(self) -> None:
        """Stop background tasks and close connections."""
        self._is_closed = True
        for task in (self._listener_task, self._reconnect_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._listener_task = self._reconnect_task = None
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
