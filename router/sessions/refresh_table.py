"""The Redis session store's local table of the sessions this replica refreshed (``RefreshTable``)."""

from __future__ import annotations

from collections import OrderedDict


class RefreshTable:
    """Per key: the owner this replica last saw and when (local clock, s) it last refreshed the key's TTL.

    An ``OrderedDict`` in refresh order (a refresh moves the key to the end), so expired entries are at the front
    and reaping is O(expired). Bounded by ``max_num_entries``: the least recently refreshed goes first. Not a plain
    dict: deleting from a dict's front leaves slots that every later ``next(iter(...))`` walks again, which made
    each eviction O(entries) and a reap of many keys quadratic (minutes for a million).
    """

    def __init__(self, max_num_entries: int) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_num_entries = max_num_entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_key: str) -> tuple[str, float] | None:
        return self._entries.get(session_key)

    def refreshed(self, session_key: str, worker_id: str, now_s: float) -> None:
        self._entries[session_key] = (worker_id, now_s)
        self._entries.move_to_end(session_key)
        if len(self._entries) > self._max_num_entries:
            self._entries.popitem(last=False)

    def set_owner(self, session_key: str, worker_id: str) -> None:
        entry = self._entries.get(session_key)
        if entry is not None:
            self._entries[session_key] = (worker_id, entry[1])

    def pop(self, session_key: str) -> None:
        self._entries.pop(session_key, None)

    def drop_worker(self, worker_id: str) -> None:
        for session_key in [k for k, (w, _) in self._entries.items() if w == worker_id]:
            del self._entries[session_key]

    def reap(self, cutoff_s: float, max_num_reaped: int | None = None) -> int:
        """Forget entries refreshed at or before ``cutoff_s`` (at most ``max_num_reaped``); returns how many."""
        entries = self._entries
        num_reaped = 0
        while entries and num_reaped != max_num_reaped:
            _, (_, refreshed_s) = next(iter(entries.items()))  # the oldest: O(1) in an OrderedDict
            if refreshed_s > cutoff_s:
                break
            entries.popitem(last=False)
            num_reaped += 1
        return num_reaped

    def num_live(self, cutoff_s: float) -> int:
        """Entries refreshed after ``cutoff_s``: O(expired ones not yet reaped), as entries are in refresh order."""
        num_expired = 0
        for _, refreshed_s in self._entries.values():
            if refreshed_s > cutoff_s:
                break
            num_expired += 1
        return len(self._entries) - num_expired

    def live_owner(self, session_key: str, cutoff_s: float) -> str | None:
        entry = self._entries.get(session_key)
        return entry[0] if entry is not None and entry[1] > cutoff_s else None
