"""The session store interface shared by the in-memory and the Redis store.

A session maps a key (``x-session-id``, ``X-SMG-Routing-Key``, the body's ``user``, or a hash of the
conversation's first blocks) to the worker that owns its KV state, with an idle expiry. The gateway calls the
store around a pure policy decision:

1. ``claim_or_touch(key, proposed_worker_id)``: one round trip. Returns the current owner, refreshing its idle
   expiry; if there is none, atomically makes ``proposed_worker_id`` the owner and returns that. Two replicas
   claiming at once end with exactly one owner, and both see it.
2. The sticky policy (pure) decides whether the owner keeps the session.
3. Only when ownership must change: ``move(key, expected_worker_id, new_worker_id)``, a compare-and-set.
   If it returns False another replica moved (or dropped) the session first: call ``claim_or_touch`` again and
   route to the owner it returns.

Lifecycle (in the gateway's ``cleanup_ctx``): ``store = build_session_store(config.sessions, clock)`` (see
``router/sessions/config.py``), ``await store.start()``, a background task calling ``await store.reap_expired()``
every ``config.sessions.reap_interval_s``, and ``await store.aclose()`` on exit. Metrics read ``store.stats()``
(synchronous, no I/O): live and expired sessions, and whether the store is degraded (Redis unreachable, local
fallback in use). Admin ``sessions list``/``drop`` call ``find_sessions`` (``SessionFilter``) and ``drop`` or
``drop_sessions``; removing a worker calls ``drop_worker``.

Errors: no method raises because a backing service is down; the Redis store answers from its local fallback
instead. Bad arguments (an empty key or worker id) raise ``ValueError``.
"""

from __future__ import annotations

from typing import Protocol

import msgspec


class SessionEntry(msgspec.Struct, frozen=True, gc=False):
    """Ownership of one session.

    Attributes:
        session_key: the key as derived by the gateway.
        worker_id: the owning worker.
        last_used_s: store clock (seconds) of the last claim or touch.
        is_new: True when this call created the entry (first request of the session).
    """

    session_key: str
    worker_id: str
    last_used_s: float
    is_new: bool = False


class SessionFilter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which live sessions an admin listing or bulk drop takes: every condition given holds (none given: every live
    session). Times are in seconds.

    Attributes:
        worker_id: owned by this worker.
        key_prefix: the session key starts with this (keys are ``<source>:<value>``: ``sid:`` takes every
            ``x-session-id`` session, ``sid:tenant-a-`` one tenant's).
        min_idle_s: unused for at least this long.
        max_idle_s: used within this long.
        min_age_s: created at least this long ago.
    """

    worker_id: str | None = None
    key_prefix: str = ""
    min_idle_s: float = 0.0
    max_idle_s: float | None = None
    min_age_s: float = 0.0

    @property
    def is_everything(self) -> bool:
        """No condition is given: every live session matches."""
        return (self.worker_id is None and not self.key_prefix and self.min_idle_s <= 0 and self.max_idle_s is None
                and self.min_age_s <= 0)

    def takes(self, session_key: str, worker_id: str, idle_s: float, age_s: float) -> bool:
        """The session matches (``idle_s`` and ``age_s`` as of the same instant)."""
        return ((self.worker_id is None or worker_id == self.worker_id) and session_key.startswith(self.key_prefix)
                and idle_s >= self.min_idle_s and (self.max_idle_s is None or idle_s <= self.max_idle_s)
                and age_s >= self.min_age_s)


class SessionInfo(msgspec.Struct, frozen=True, gc=False):
    """One live session as ``/admin/sessions`` shows it.

    Attributes:
        session_key: the key as derived by the gateway.
        worker_id: the owning worker.
        last_used_s: store clock (seconds) of the last use (the Redis store: of the key's last TTL refresh, Unix
            seconds on Redis's clock).
        created_s: store clock (seconds) when the session was created (claimed with no owner).
        idle_s: seconds since ``last_used_s`` (the Redis store: since the last TTL refresh, so up to
            ``refresh_fraction * idle_timeout_s`` more than since the last use).
        age_s: seconds since ``created_s``.
    """

    session_key: str
    worker_id: str
    last_used_s: float
    created_s: float
    idle_s: float
    age_s: float


class SessionStore(Protocol):
    """Where session ownership lives. All methods are safe to call concurrently."""

    idle_timeout_s: float

    async def claim_or_touch(self, session_key: str, proposed_worker_id: str) -> SessionEntry:
        """Return the live owner (refreshing its expiry), or atomically claim for ``proposed_worker_id``."""
        ...

    async def move(self, session_key: str, expected_worker_id: str, new_worker_id: str) -> bool:
        """Compare-and-set the owner; False (nothing changed) if the owner is not ``expected_worker_id``."""
        ...

    async def drop(self, session_key: str) -> bool:
        """Forget a session; True if it existed."""
        ...

    async def drop_worker(self, worker_id: str) -> int:
        """Forget every session owned by ``worker_id`` (worker removed); returns how many."""
        ...

    async def list_sessions(self, limit: int) -> list[SessionEntry]:
        """Live sessions, most recently used first, at most ``limit``."""
        ...

    async def num_sessions(self) -> int:
        """Number of live (unexpired) sessions."""
        ...

    async def find_sessions(self, match: SessionFilter, limit: int) -> list[SessionInfo]:
        """Live sessions that ``match`` takes, most recently used first, at most ``limit`` (a scan in bounded
        slices: sessions used while it runs may be missed)."""
        ...

    async def drop_sessions(self, match: SessionFilter) -> int:
        """Forget every live session that ``match`` takes, on every replica; returns how many (a scan in bounded
        slices: a session created or used while it runs may stay)."""
        ...

    async def aclose(self) -> None:
        """Release connections and background tasks."""
        ...

    async def start(self) -> None:
        """Open connections and start background tasks (pub/sub listener, reconnect). Idempotent."""
        ...

    async def reap_expired(self) -> int:
        """Forget sessions idle past ``idle_timeout_s`` (local state only); returns how many were forgotten."""
        ...

    def stats(self) -> SessionStoreStats:
        """Counters for metrics; synchronous and without I/O."""
        ...


class SessionStoreStats(msgspec.Struct, frozen=True, gc=False):
    """What a store reports to ``/metrics``.

    Attributes:
        store: ``"memory"`` or ``"redis"``.
        num_live_sessions: sessions this store knows to be live (the Redis store: its local view, i.e. the sessions
            this replica used within ``idle_timeout_s``; ``num_sessions()`` asks Redis for the fleet-wide count).
        num_created_total: first claims made through this store.
        num_expired_total: sessions seen to expire (idle past ``idle_timeout_s``).
        num_moved_total: successful ``move`` calls.
        num_move_conflicts_total: ``move`` calls refused by compare-and-set.
        num_dropped_total: sessions removed by ``drop`` or ``drop_worker``.
        is_degraded: True while the shared store is unreachable and the local fallback answers.
        num_fallbacks_total: times the store switched to its local fallback.
        num_backend_errors_total: failed calls to the backing service.
        num_cache_hits_total: claims answered from the local cache without a round trip.
        num_evicted_total: live sessions forgotten because the in-memory table reached ``max_num_sessions``.
    """

    store: str
    num_live_sessions: int = 0
    num_created_total: int = 0
    num_expired_total: int = 0
    num_moved_total: int = 0
    num_move_conflicts_total: int = 0
    num_dropped_total: int = 0
    is_degraded: bool = False
    num_fallbacks_total: int = 0
    num_backend_errors_total: int = 0
    num_cache_hits_total: int = 0
    num_evicted_total: int = 0
