"""Where the live sessions' prompts live: each worker's resident tokens, for the memory term of ``cache_aware``.

A session's prompt stays cached on its owner between turns only while the owner's GPU cache can hold it beside the
prompts of the other live sessions it owns. ``session_sticky`` records, per session, the owner and the prompt
tokens of its latest request (``place``); a session unseen for ``idle_s`` no longer counts (its turns stopped, and
its blocks age out of the worker's LRU order). ``resident_tokens`` gives every worker's sum with one session left
out (the request's own, whose new prompt the cost model adds wherever it goes).

A conversation grows every turn, so what a worker must hold is each session's prompt as it will be, not as it is.
Both rates are measured from the sessions seen: ``growth_tokens_per_turn``, the mean growth of a session's prompt
from one turn to the next (an EWMA, weight ``GROWTH_ALPHA``), and ``expected_future_turns``, returning turns per
session placed (a memoryless session returns that many more times on average). A session's projected footprint is
``prompt + expected_future_turns * growth_tokens_per_turn`` (``projected_growth_tokens``), and ``resident_tokens``
sums projections.

Every operation is O(1) amortized: entries are kept in last-use order and expired from the oldest.
"""

from __future__ import annotations

import math
from collections import OrderedDict

__all__ = ["GROWTH_ALPHA", "SessionResidents"]

GROWTH_ALPHA = 0.05
"""EWMA weight of one turn's growth in ``growth_tokens_per_turn`` (about the last 20 turns)."""


class SessionResidents:
    """Per session: (owner, prompt tokens, last use); per worker: the sum of its sessions' prompt tokens.

    Args:
        idle_s: a session unseen this long no longer counts (seconds, > 0).
        max_sessions: bound on the sessions kept (the oldest go first).
    """

    def __init__(self, idle_s: float, max_sessions: int = 1_000_000) -> None:
        if not (idle_s > 0 and math.isfinite(idle_s)):
            raise ValueError(f"idle_s must be a positive number of seconds, got {idle_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._tokens: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self.growth_tokens_per_turn = 0.0
        self.num_new_sessions = 0
        self.num_returning_turns = 0

    def _drop(self, entry: tuple[str, int, float]) -> None:
        worker_id, num_tokens, _ = entry
        count = self._counts[worker_id] - 1
        if count:
            self._counts[worker_id] = count
            self._tokens[worker_id] -= num_tokens
        else:
            del self._counts[worker_id]
            del self._tokens[worker_id]

    def forget_worker(self, worker_id: str) -> int:
        """Forget the sessions placed on ``worker_id`` (removed from the fleet: nothing of theirs resides there any
        more, and a session returning is placed afresh); returns how many went. O(sessions kept)."""
        if worker_id not in self._counts:
            return 0
        sessions = self._sessions
        gone = [key for key, entry in sessions.items() if entry[0] == worker_id]
        for key in gone:
            self._drop(sessions.pop(key))
        return len(gone)

    def expire(self, now_s: float) -> None:
        """Forget the sessions last used before ``now_s - idle_s``."""
        sessions = self._sessions
        horizon = now_s - self.idle_s
        while sessions:
            key, entry = next(iter(sessions.items()))
            if entry[2] >= horizon:
                break
            del sessions[key]
            self._drop(entry)

    def place(self, session_key: str, worker_id: str, num_prompt_tokens: int, now_s: float) -> None:
        """The session's latest request (``num_prompt_tokens``) went to ``worker_id`` at ``now_s``."""
        sessions = self._sessions
        old = sessions.pop(session_key, None)
        if old is not None:
            self._drop(old)
            self.num_returning_turns += 1
            growth = max(0, num_prompt_tokens - old[1])
            self.growth_tokens_per_turn += GROWTH_ALPHA * (growth - self.growth_tokens_per_turn)
        else:
            self.num_new_sessions += 1
        sessions[session_key] = (worker_id, num_prompt_tokens, now_s)
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + num_prompt_tokens
        self._counts[worker_id] = self._counts.get(worker_id, 0) + 1
        if len(sessions) > self.max_sessions:
            self._drop(sessions.popitem(last=False)[1])
        self.expire(now_s)

    @property
    def expected_future_turns(self) -> float:
        """Returning turns per session placed (0 before any)."""
        return self.num_returning_turns / self.num_new_sessions if self.num_new_sessions else 0.0

    @property
    def projected_growth_tokens(self) -> int:
        """Tokens a live session's prompt is expected to grow by over its remaining turns."""
        return round(self.expected_future_turns * self.growth_tokens_per_turn)

    def resident_tokens(self, now_s: float, without: str | None = None) -> dict[str, int]:
        """Every worker's projected resident tokens at ``now_s`` (module docstring), session ``without`` left out
        (a copy)."""
        self.expire(now_s)
        growth = self.projected_growth_tokens
        counts = self._counts
        out = {w: tokens + counts[w] * growth for w, tokens in self._tokens.items()}
        entry = self._sessions.get(without) if without is not None else None
        if entry is not None:
            out[entry[0]] -= entry[1] + growth
        return out

    def __contains__(self, session_key: object) -> bool:
        return session_key in self._sessions

    @property
    def num_sessions(self) -> int:
        """Sessions counted now (expired ones go at the next call with a time)."""
        return len(self._sessions)
