"""Session ownership: the one place that writes which worker owns a session (``SessionStore`` claims and moves).

Two moments change an owner:

* routing (``Router.route`` under ``session_sticky``): the inner policy's best worker claims a new session or
  touches an existing one (``claim_or_touch``); the pure ``SessionStickyPolicy.resolve`` keeps the owner or moves
  the session; a move is a compare-and-set from the owner read, and on a lost race the owner the store returns
  then wins (``claim``);
* after the answer (``RequestFlight.finish``): a session whose request another worker served after a retry (its
  owner failed before the first byte) moves there, since that worker now holds the conversation's KV
  (``follow_retry``).
"""

from __future__ import annotations

import logging

from policies import SessionStickyPolicy
from policies.base import Decision, RequestView, Snapshot
from router.sessions.base import SessionStore
from router.sessions.errors import SessionBackendError

logger = logging.getLogger(__name__)


class SessionOwnership:
    """Claims and moves of session owners in one ``SessionStore``."""

    __slots__ = ("_store",)

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    async def claim(
        self, sticky: SessionStickyPolicy, session_key: str, req: RequestView, snapshot: Snapshot,
        inner_inputs: tuple[RequestView, Snapshot] | None = None,
    ) -> Decision:
        """The sticky decision for ``session_key``: the inner best claims or touches the session, ``resolve`` keeps
        or moves it (compare-and-set; a lost race resolves again from the owner the store returns).
        ``inner_inputs``: ``sticky.inner_inputs(req, snapshot)`` when the caller has them already.

        Raises:
            SessionBackendError: the store failed (a store with a local fallback answers instead).
        """
        inner = sticky.inner.select(*(inner_inputs or sticky.inner_inputs(req, snapshot)))
        if inner.worker_id is None:
            return inner
        store = self._store
        entry = await store.claim_or_touch(session_key, inner.worker_id)
        decision = sticky.resolve(entry.worker_id, inner, snapshot, is_new=entry.is_new, view=req)
        if decision.reason == "sticky_moved" and decision.worker_id is not None:
            if not await store.move(session_key, entry.worker_id, decision.worker_id):
                entry = await store.claim_or_touch(session_key, decision.worker_id)
                decision = sticky.resolve(entry.worker_id, inner, snapshot, is_new=entry.is_new, view=req)
        return decision

    async def follow_retry(self, session_key: str, planned_worker_id: str, served_worker_id: str) -> None:
        """Move the session from the planned owner to the worker that served its request after a retry
        (compare-and-set from the planned owner). A store error only logs: the answer was already sent."""
        try:
            if await self._store.move(session_key, planned_worker_id, served_worker_id):
                logger.info("session %s moved from %s to %s, which served it after a retry", session_key,
                            planned_worker_id, served_worker_id)
        except SessionBackendError as exc:
            logger.warning("session %s: could not move it to %s after a retry: %s", session_key,
                           served_worker_id, exc)
