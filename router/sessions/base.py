"""The session store interface shared by the in-memory and the Redis store.

A session maps a key (``x-session-id``, ``X-SMG-Routing-Key``, the body's ``user``, or a hash of the
conversation's first blocks) to the worker that owns its KV state, with an idle expiry. The gateway calls the
store around a pure policy decision:

1. ``claim_or_touch(key, proposed_worker_id)``: one round trip. Returns the current owner, refreshing its idle
   expiry; if there is none, atomically makes ``proposed_worker_id`` the owner and returns that. Two replicas
   claiming at once end with exactly one owner, and both see it.
2. The sticky policy (pure) decides whether the owner keeps the session.
3. Only when ownership must change: ``move(key, expected_worker_id, new_worker_id)``, a compare-and-set.
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

    async def aclose(self) -> None:
        """Release connections and background tasks."""
        ...
