"""Which of a worker's live sessions will return soon, and what a prefill placed there makes them wait.

A session's turns reach its owner one after another, each some time after the last (its own TTFT, its decode and
the client's think time). A long prefill placed on a worker holds up every request that reaches the worker while it
runs; the requests that will reach it are above all the returning turns of the sessions it owns, whose prefixes it
holds, and which the session-sticky rule will not move (a move recomputes the prefix, ``policies/move_cost.py``).
So placing a new session's long, uncached first turn is cheaper, for the fleet, on a worker whose own sessions are
not about to return.

``ReturningSessions`` records each session's latest placement (owner, time on the owner's clock) and measures the
time between a session's consecutive turns (``place``): per session its mean gap, and over the fleet a window of the
latest ``gap_window`` gaps. A session expected back ``gap`` seconds after its latest placement, ``age`` seconds ago,
returns in ``max(0, gap - age)`` seconds (``returning_in_s``), where ``gap`` is its own mean once it has one and the
fleet's mean before. A session older than the longest gap in the window is left out (its conversation ended, or
paused for longer than any turn was seen to take); so is every session until one gap is measured.

The charge (``returning_delay_s``): a request with estimated TTFT ``t`` on the worker (the queue ahead and its own
prefill ``p``) holds a turn arriving ``r`` seconds from now for ``min(p, max(0, t - r))``: all of its prefill when
the turn arrives before that prefill starts, the rest of it when during, nothing after. Summed over the worker's
returning sessions and weighted by the probability that a live session returns at all (``return_probability``:
with ``F`` returning turns per session placed, ``F / (1 + F)``, a memoryless session's chance of one more turn), it
is the delay the placement imposes on others, in seconds, added to the request's ranking cost by ``cache_aware``.
No constant is fitted: ``p`` and ``t`` come from the timing profile's cost model, the gaps and ``F`` from the turns
observed.

The cap (``returning_charge_s``): the charge trades this request's wait for the returning turns'; it is worth that
only while the request still starts within the latency the fleet delivers. So a worker's charge is at most
``max(0, tail - t)``, ``tail`` the fleet's served tail (the p99 of the estimated TTFT of the recent requests already
served, the state ``session_sticky``'s move rule keeps, ``policies/move_cost.py``): the charge raises a worker's
ranking cost to the tail at most, so it never sends a request to a worker whose estimate exceeds the tail when a
worker of lower estimate was cheaper without it. A long cold turn (its own prefill near the tail) is then charged
little and goes where it starts first; a short one is charged in full and still goes where fewer sessions return.
Among workers of equal ranking cost (a burst of cold turns on an idle fleet, every estimate past the tail: every
charge capped to 0), ``cache_aware`` still prefers the smaller charge before the cap, which costs the request
nothing.
Measured on the agentic coding sessions (``benchmarks/routing.py --workload agentic``, concurrency 8) before the
cap: the run's p99 was a 106K-token cold first turn that the charge sent to a worker with 2.0–4.7 s of queue (p99
15.29 s against 13.89 s without the charge).

Every operation is O(1) amortized but ``returning_in_s``, O(sessions kept).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping

from policies.base import WorkerState

__all__ = ["ReturningSessions", "capped_charge_s", "return_probability", "returning_charge_s", "returning_delay_s"]


def return_probability(num_new_sessions: int, num_returning_turns: int) -> float:
    """The chance that a live session returns once more, ``F / (1 + F)`` with ``F = num_returning_turns /
    num_new_sessions`` (module docstring); 0.0 before any session."""
    if num_new_sessions <= 0:
        return 0.0
    future = num_returning_turns / num_new_sessions
    return future / (1.0 + future)


def returning_delay_s(returning_in_s: Iterable[float], ttft_s: float, prefill_s: float) -> float:
    """Seconds of waiting a request of estimated TTFT ``ttft_s`` and own prefill ``prefill_s`` imposes on turns
    arriving ``returning_in_s`` seconds from now (module docstring), unweighted."""
    total = 0.0
    for r in returning_in_s:
        if r < ttft_s:
            wait = ttft_s - r
            total += prefill_s if wait > prefill_s else wait
    return total


def returning_charge_s(
    probability: float, returning_in_s: Iterable[float], ttft_s: float, prefill_s: float, tail_s: float = math.inf,
) -> float:
    """The charge ``cache_aware`` adds to a worker's ranking cost, seconds: ``probability`` times
    ``returning_delay_s(returning_in_s, ttft_s, prefill_s)``, capped at ``max(0, tail_s - ttft_s)`` (the module
    docstring's cap; ``tail_s`` the fleet's served tail, ``math.inf``: no cap)."""
    room = tail_s - ttft_s
    if room <= 0.0:
        return 0.0
    return capped_charge_s(probability * returning_delay_s(returning_in_s, ttft_s, prefill_s), ttft_s, tail_s)


def capped_charge_s(delay_s: float, ttft_s: float, tail_s: float) -> float:
    """``delay_s`` (the weighted delay, seconds) capped at ``max(0, tail_s - ttft_s)`` (the module docstring's cap)."""
    room = tail_s - ttft_s
    if room <= 0.0:
        return 0.0
    return room if delay_s > room else delay_s


class ReturningSessions:
    """Per session: owner, latest placement (owner's clock and the gateway's clock) and its gaps; over the fleet: the
    latest gaps.

    Args:
        idle_s: a session unplaced this long on the gateway's clock is forgotten (seconds, > 0).
        gap_window: how many recent gaps the fleet's mean and longest gap are taken over (>= 1).
        max_sessions: bound on the sessions kept (the oldest go first).
    """

    def __init__(self, idle_s: float, gap_window: int = 256, max_sessions: int = 1_000_000) -> None:
        if not (idle_s > 0 and math.isfinite(idle_s)):
            raise ValueError(f"idle_s must be a positive number of seconds, got {idle_s}")
        if gap_window < 1:
            raise ValueError(f"gap_window must be >= 1, got {gap_window}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[str, float, float, float, int]] = OrderedDict()
        """``(owner, placed at on its clock s, placed at on the gateway's clock s, sum of gaps s, gaps)``."""
        self._gaps: deque[float] = deque(maxlen=gap_window)

    def place(self, session_key: str, worker_id: str, clock_s: float, now_s: float) -> None:
        """The session's latest request went to ``worker_id`` at ``clock_s`` on that worker's clock (``now_s`` on the
        gateway's); the time since its previous placement is one gap."""
        sessions = self._sessions
        old = sessions.pop(session_key, None)
        gap_sum, num_gaps = 0.0, 0
        if old is not None:
            gap = clock_s - old[1]
            if gap >= 0.0:
                self._gaps.append(gap)
                gap_sum, num_gaps = old[3] + gap, old[4] + 1
        sessions[session_key] = (worker_id, clock_s, now_s, gap_sum, num_gaps)
        if len(sessions) > self.max_sessions:
            sessions.popitem(last=False)
        horizon = now_s - self.idle_s
        while sessions:
            entry = next(iter(sessions.values()))
            if entry[2] >= horizon:
                break
            sessions.popitem(last=False)

    def forget_worker(self, worker_id: str) -> int:
        """Forget the sessions placed on ``worker_id``; returns how many went. O(sessions kept)."""
        gone = [key for key, entry in self._sessions.items() if entry[0] == worker_id]
        for key in gone:
            del self._sessions[key]
        return len(gone)

    @property
    def mean_gap_s(self) -> float:
        """The fleet's mean gap between a session's turns over the window (0.0 before one)."""
        gaps = self._gaps
        return sum(gaps) / len(gaps) if gaps else 0.0

    def returning_in_s(
        self, workers: Iterable[WorkerState], without: str | None = None,
    ) -> dict[str, tuple[float, ...]]:
        """Per worker of ``workers``, in seconds from now on its clock (``WorkerState.clock_s``), when each live
        session it owns is expected back (module docstring), session ``without`` left out; workers without one are
        absent, and so is every worker before the first gap."""
        gaps = self._gaps
        if not gaps:
            return {}
        fleet_gap = sum(gaps) / len(gaps)
        longest = max(gaps)
        clocks: Mapping[str, float] = {w.worker_id: w.clock_s for w in workers}
        out: dict[str, list[float]] = {}
        for key, (owner, placed_s, _, gap_sum, num_gaps) in self._sessions.items():
            clock = clocks.get(owner)
            if clock is None or key == without:
                continue
            age = clock - placed_s
            if age > longest:
                continue
            gap = gap_sum / num_gaps if num_gaps else fleet_gap
            out.setdefault(owner, []).append(gap - age if gap > age else 0.0)
        return {w: tuple(rs) for w, rs in out.items()}

    def __contains__(self, session_key: object) -> bool:
        return session_key in self._sessions
