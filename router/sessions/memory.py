"""In-memory session store: one process's table of session owners with idle expiry.

Used on its own (``sessions.store: memory``, one gateway replica) and as the Redis store's local fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable

from sortedcontainers import SortedList

from router.sessions.base import SessionEntry, SessionFilter, SessionInfo, SessionStoreStats

logger = logging.getLogger(__name__)

REAP_SLICE = 4096
"""Expired sessions forgotten between two yields to the event loop by ``reap_expired``."""


class _Slot:
    """Mutable owner record of one session (kept out of the public API)."""

    __slots__ = ("worker_id", "last_used_s", "created_s")

    def __init__(self, worker_id: str, last_used_s: float) -> None:
        self.worker_id = worker_id
        self.last_used_s = last_used_s
        self.created_s = last_used_s


def _check_key(session_key: str) -> None:
    if not session_key:
        raise ValueError("session_key must be a non-empty string")


def _check_worker(worker_id: str, name: str) -> None:
    if not worker_id:
        raise ValueError(f"{name} must be a non-empty string")


class MemorySessionStore:
    """Session owners with idle expiry, ordered by last use.

    Invariants:
        - ``_owners[key]`` and ``(last_used_s, key)`` in ``_by_last_use`` exist together, with equal
          ``last_used_s``; ``key in _by_worker[worker_id]`` iff ``_owners[key].worker_id == worker_id``
          (empty sets are removed).
        - A session is expired iff ``last_used_s <= now_s - idle_timeout_s`` (one predicate everywhere). An expired
          entry may linger until ``reap_expired`` or its next ``claim_or_touch``, but no method returns or counts it.

    Expiry and eviction order: least recently used first. ``reap_expired`` pops from the front of
    ``_by_last_use`` (O(k log n) for k expired); past ``max_num_sessions`` a new claim evicts the least recently
    used live session. Every operation is O(log n) except ``drop_worker`` (O(sessions of that worker)),
    ``list_sessions`` (O(limit)) and the admin scans ``find_sessions``/``drop_sessions`` (O(sessions in the idle
    range asked, or of the worker asked)).

    All methods run on the event loop without awaiting, so each one is atomic with respect to other coroutines,
    except ``reap_expired`` and the admin scans, which yield to the loop every ``REAP_SLICE`` sessions. The
    ``*_sync`` methods are the same operations for callers that are not coroutines.
    """

    def __init__(
        self,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_num_sessions: int = 1_000_000,
        store_name: str = "memory",
    ) -> None:
        """Create an empty store.

        Args:
            idle_timeout_s: a session unused this long (seconds) expires.
            clock: monotonic clock in seconds; ``last_used_s`` of entries is on this clock.
            max_num_sessions: bound on the table; past it the least recently used session is evicted.
            store_name: name reported in ``stats().store``.

        Raises:
            ValueError: ``idle_timeout_s <= 0`` or ``max_num_sessions < 1``.
        """
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s!r}")
        if max_num_sessions < 1:
            raise ValueError(f"max_num_sessions must be >= 1, got {max_num_sessions!r}")
        self.idle_timeout_s = idle_timeout_s
        self.max_num_sessions = max_num_sessions
        self._clock = clock
        self._store_name = store_name
        self._owners: dict[str, _Slot] = {}
        self._by_last_use: SortedList = SortedList()  # (last_used_s, session_key), oldest first
        self._by_worker: dict[str, set[str]] = {}
        self._num_created_total = 0
        self._num_expired_total = 0
        self._num_evicted_total = 0
        self._num_moved_total = 0
        self._num_move_conflicts_total = 0
        self._num_dropped_total = 0

    def __repr__(self) -> str:
        return f"MemorySessionStore(num_entries={len(self._owners)}, idle_timeout_s={self.idle_timeout_s})"

    # -- internal table operations -----------------------------------------------------------------------------

    def _is_expired(self, slot: _Slot, now_s: float) -> bool:
        return slot.last_used_s <= now_s - self.idle_timeout_s

    def _insert(self, session_key: str, worker_id: str, now_s: float) -> None:
        self._owners[session_key] = _Slot(worker_id, now_s)
        self._by_last_use.add((now_s, session_key))
        self._by_worker.setdefault(worker_id, set()).add(session_key)

    def _remove(self, session_key: str, slot: _Slot) -> None:
        del self._owners[session_key]
        self._by_last_use.remove((slot.last_used_s, session_key))
        keys = self._by_worker[slot.worker_id]
        keys.discard(session_key)
        if not keys:
            del self._by_worker[slot.worker_id]

    def _touch(self, session_key: str, slot: _Slot, now_s: float) -> None:
        if slot.last_used_s != now_s:
            self._by_last_use.remove((slot.last_used_s, session_key))
            slot.last_used_s = now_s
            self._by_last_use.add((now_s, session_key))

    def _set_worker(self, session_key: str, slot: _Slot, worker_id: str) -> None:
        keys = self._by_worker[slot.worker_id]
        keys.discard(session_key)
        if not keys:
            del self._by_worker[slot.worker_id]
        slot.worker_id = worker_id
        self._by_worker.setdefault(worker_id, set()).add(session_key)

    def _evict_over_bound(self) -> None:
        while len(self._owners) > self.max_num_sessions:
            _, oldest_key = self._by_last_use[0]
            self._remove(oldest_key, self._owners[oldest_key])
            self._num_evicted_total += 1

    # -- synchronous API ------------------------------------------------------------------------------------------

    def claim_or_touch_sync(self, session_key: str, proposed_worker_id: str) -> SessionEntry:
        """See ``SessionStore.claim_or_touch``. ``last_used_s`` is on this store's clock.

        Raises:
            ValueError: an empty key or worker id.
        """
        _check_key(session_key)
        _check_worker(proposed_worker_id, "proposed_worker_id")
        now_s = self._clock()
        slot = self._owners.get(session_key)
        if slot is not None:
            if not self._is_expired(slot, now_s):
                self._touch(session_key, slot, now_s)
                return SessionEntry(session_key, slot.worker_id, now_s, False)
            self._remove(session_key, slot)
            self._num_expired_total += 1
        self._insert(session_key, proposed_worker_id, now_s)
        self._num_created_total += 1
        self._evict_over_bound()
        return SessionEntry(session_key, proposed_worker_id, now_s, True)

    def peek_sync(self, session_key: str) -> SessionEntry | None:
        """The live owner of ``session_key`` without touching it, or ``None``."""
        slot = self._owners.get(session_key)
        if slot is None or self._is_expired(slot, self._clock()):
            return None
        return SessionEntry(session_key, slot.worker_id, slot.last_used_s, False)

    def move_sync(self, session_key: str, expected_worker_id: str, new_worker_id: str) -> bool:
        """See ``SessionStore.move``. A successful move also counts as a use (refreshes the idle expiry).

        Raises:
            ValueError: an empty key or worker id.
        """
        _check_key(session_key)
        _check_worker(expected_worker_id, "expected_worker_id")
        _check_worker(new_worker_id, "new_worker_id")
        now_s = self._clock()
        slot = self._owners.get(session_key)
        if slot is None or self._is_expired(slot, now_s) or slot.worker_id != expected_worker_id:
            self._num_move_conflicts_total += 1
            return False
        if new_worker_id != expected_worker_id:
            self._set_worker(session_key, slot, new_worker_id)
            self._num_moved_total += 1
        self._touch(session_key, slot, now_s)
        return True

    def put_sync(self, session_key: str, worker_id: str) -> None:
        """Set the owner unconditionally and mark it used now (fallback seeding; not part of the protocol)."""
        _check_key(session_key)
        _check_worker(worker_id, "worker_id")
        slot = self._owners.get(session_key)
        if slot is not None:
            self._remove(session_key, slot)
        self._insert(session_key, worker_id, self._clock())
        self._evict_over_bound()

    def drop_sync(self, session_key: str) -> bool:
        """See ``SessionStore.drop``: True if a live session was forgotten."""
        slot = self._owners.get(session_key)
        if slot is None:
            return False
        is_live = not self._is_expired(slot, self._clock())
        self._remove(session_key, slot)
        if is_live:
            self._num_dropped_total += 1
        else:
            self._num_expired_total += 1
        return is_live

    def drop_worker_sync(self, worker_id: str) -> int:
        """See ``SessionStore.drop_worker``: how many live sessions of ``worker_id`` were forgotten."""
        now_s = self._clock()
        num_live = 0
        for session_key in list(self._by_worker.get(worker_id, ())):
            slot = self._owners[session_key]
            if self._is_expired(slot, now_s):
                self._num_expired_total += 1
            else:
                num_live += 1
            self._remove(session_key, slot)
        self._num_dropped_total += num_live
        return num_live

    def reap_expired_sync(self, max_num_reaped: int | None = None) -> int:
        """Forget expired sessions, oldest first: every one, or at most ``max_num_reaped``; returns how many.

        One slice deletion from ``_by_last_use`` (not one ``remove`` per session), then O(1) per session.
        """
        cutoff_s = self._clock() - self.idle_timeout_s
        # Entries with last_used_s <= cutoff_s sort before (nextafter(cutoff_s, inf), "").
        num_reaped = int(self._by_last_use.bisect_left((math.nextafter(cutoff_s, math.inf), "")))
        if max_num_reaped is not None:
            num_reaped = min(num_reaped, max_num_reaped)
        if not num_reaped:
            return 0
        expired = self._by_last_use[:num_reaped]
        del self._by_last_use[:num_reaped]
        owners = self._owners
        by_worker = self._by_worker
        for _, session_key in expired:
            worker_id = owners.pop(session_key).worker_id
            keys = by_worker[worker_id]
            keys.discard(session_key)
            if not keys:
                del by_worker[worker_id]
        self._num_expired_total += num_reaped
        if num_reaped:
            logger.debug("reaped %d expired sessions", num_reaped)
        return num_reaped

    def list_sessions_sync(self, limit: int) -> list[SessionEntry]:
        """Live sessions, most recently used first, at most ``limit``."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit!r}")
        cutoff_s = self._clock() - self.idle_timeout_s
        result: list[SessionEntry] = []
        for last_used_s, session_key in reversed(self._by_last_use):
            if len(result) >= limit or last_used_s <= cutoff_s:
                break
            result.append(SessionEntry(session_key, self._owners[session_key].worker_id, last_used_s, False))
        return result

    def num_sessions_sync(self) -> int:
        """Live sessions (expired entries not yet reaped are not counted)."""
        cutoff_s = self._clock() - self.idle_timeout_s
        # Entries with last_used_s <= cutoff_s sort before (nextafter(cutoff_s, inf), "").
        num_expired = int(self._by_last_use.bisect_left((math.nextafter(cutoff_s, math.inf), "")))
        return len(self._by_last_use) - num_expired

    def clear_sync(self) -> int:
        """Forget everything (no counter changes); returns how many entries there were."""
        num_entries = len(self._owners)
        self._owners.clear()
        self._by_last_use.clear()
        self._by_worker.clear()
        return num_entries

    async def _scan(self, match: SessionFilter, now_s: float) -> AsyncGenerator[list[tuple[float, str]], None]:
        """The live sessions ``match`` takes as ``(last_used_s, session_key)`` batches, yielding to the event loop
        between batches of ``REAP_SLICE`` sessions looked at. Without ``worker_id``: most recently used first,
        only the range of ``_by_last_use`` the idle bounds allow; with it: that worker's sessions, in no order.
        A batch is checked against the table as it is when given out."""
        by_last_use = self._by_last_use
        newest_s = now_s - match.min_idle_s
        oldest_s = now_s - self.idle_timeout_s  # exclusive: at or before it, expired
        if match.max_idle_s is not None:
            oldest_s = max(oldest_s, math.nextafter(now_s - match.max_idle_s, -math.inf))
        if match.worker_id is not None:
            keys = list(self._by_worker.get(match.worker_id, ()))
            for start in range(0, len(keys), REAP_SLICE):
                batch = []
                for session_key in keys[start:start + REAP_SLICE]:
                    slot = self._owners.get(session_key)
                    if (slot is not None and oldest_s < slot.last_used_s <= newest_s
                            and match.takes(session_key, slot.worker_id, now_s - slot.last_used_s,
                                            now_s - slot.created_s)):
                        batch.append((slot.last_used_s, session_key))
                yield batch
                await asyncio.sleep(0)
            return
        # Entries with last_used_s <= t sort before (nextafter(t, inf), "").
        end: tuple[float, str] = (math.nextafter(newest_s, math.inf), "")
        floor = (math.nextafter(oldest_s, math.inf), "")
        while True:
            hi = by_last_use.bisect_left(end)  # the table may have changed at the yield: found again by value
            lo = max(by_last_use.bisect_left(floor), hi - REAP_SLICE)
            if hi <= lo:
                return
            entries = by_last_use[lo:hi]
            batch = []
            for last_used_s, session_key in reversed(entries):
                slot = self._owners[session_key]
                if match.takes(session_key, slot.worker_id, now_s - last_used_s, now_s - slot.created_s):
                    batch.append((last_used_s, session_key))
            yield batch
            end = entries[0]
            await asyncio.sleep(0)

    async def find_sessions(self, match: SessionFilter, limit: int) -> list[SessionInfo]:
        """Live sessions ``match`` takes, most recently used first, at most ``limit`` (see ``SessionStore``).

        Raises:
            ValueError: ``limit < 0``.
        """
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit!r}")
        now_s = self._clock()
        found: list[tuple[float, str]] = []
        async with contextlib.aclosing(self._scan(match, now_s)) as batches:
            async for batch in batches:
                found.extend(batch)
                if match.worker_id is None and len(found) >= limit:  # newest first: the rest is older
                    break
                if len(found) > 2 * limit + REAP_SLICE:
                    found = heapq.nlargest(limit, found)
        out = []
        for last_used_s, session_key in heapq.nlargest(limit, found):
            slot = self._owners.get(session_key)
            if slot is not None and slot.last_used_s == last_used_s:
                out.append(SessionInfo(session_key, slot.worker_id, last_used_s, slot.created_s,
                                       now_s - last_used_s, now_s - slot.created_s))
        return out

    async def drop_sessions(self, match: SessionFilter) -> int:
        """Forget every live session ``match`` takes; returns how many (see ``SessionStore``)."""
        now_s = self._clock()
        num_dropped = 0
        async with contextlib.aclosing(self._scan(match, now_s)) as batches:
            async for batch in batches:
                for last_used_s, session_key in batch:
                    slot = self._owners.get(session_key)
                    if slot is not None and slot.last_used_s == last_used_s:  # not used since it was matched
                        self._remove(session_key, slot)
                        num_dropped += 1
        self._num_dropped_total += num_dropped
        return num_dropped

    def dump(self) -> list[tuple[str, str, float]]:
        """Test introspection: ``(session_key, worker_id, last_used_s)`` for every entry, oldest first, expired
        ones included."""
        return [(key, self._owners[key].worker_id, last_used_s) for last_used_s, key in self._by_last_use]

    # -- SessionStore protocol ------------------------------------------------------------------------------------

    async def claim_or_touch(self, session_key: str, proposed_worker_id: str) -> SessionEntry:
        """Return the live owner (refreshing its expiry), or claim for ``proposed_worker_id``."""
        return self.claim_or_touch_sync(session_key, proposed_worker_id)

    async def move(self, session_key: str, expected_worker_id: str, new_worker_id: str) -> bool:
        """Compare-and-set the owner; False if the live owner is not ``expected_worker_id``."""
        return self.move_sync(session_key, expected_worker_id, new_worker_id)

    async def drop(self, session_key: str) -> bool:
        """Forget a session; True if it was live."""
        return self.drop_sync(session_key)

    async def drop_worker(self, worker_id: str) -> int:
        """Forget every session owned by ``worker_id``; returns how many were live."""
        return self.drop_worker_sync(worker_id)

    async def list_sessions(self, limit: int) -> list[SessionEntry]:
        """Live sessions, most recently used first, at most ``limit``."""
        return self.list_sessions_sync(limit)

    async def num_sessions(self) -> int:
        """Number of live sessions."""
        return self.num_sessions_sync()

    async def aclose(self) -> None:
        """Nothing to release."""

    async def start(self) -> None:
        """Nothing to start."""

    async def reap_expired(self) -> int:
        """Forget expired sessions, ``REAP_SLICE`` at a time with a yield to the event loop between slices (many
        sessions expiring at once never hold the request path for long); returns how many."""
        num_reaped = 0
        while True:
            num = self.reap_expired_sync(REAP_SLICE)
            num_reaped += num
            if num < REAP_SLICE:
                return num_reaped
            await asyncio.sleep(0)

    def stats(self) -> SessionStoreStats:
        """Counters for metrics."""
        return SessionStoreStats(
            store=self._store_name,
            num_live_sessions=self.num_sessions_sync(),
            num_created_total=self._num_created_total,
            num_expired_total=self._num_expired_total,
            num_moved_total=self._num_moved_total,
            num_move_conflicts_total=self._num_move_conflicts_total,
            num_dropped_total=self._num_dropped_total,
            num_evicted_total=self._num_evicted_total,
        )
