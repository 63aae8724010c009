"""What moving a session off its owner costs, and when the move pays for it (``session_sticky``'s cost rule).

A session's owner holds its prefix. Moving the session's request to another worker ``b`` trades two things:

* it saves this request the owner's extra wait, ``gain_s = ttft(owner) - ttft(b)`` (the inner ``cache_aware``
  estimates, seconds);
* it recomputes on ``b`` the part of the prefix the owner holds and ``b`` lacks: ``lost_s`` = ``b``'s prefill time
  of positions ``k_b..k_owner`` (the cost model's ``(k_o - k_b) / r_lin + (k_o**2 - k_b**2) / r_quad``, times
  ``b``'s speed factor). That is GPU work the fleet did once already; every token of it is a hit lost for good,
  and the requests that reach ``b`` while it runs wait for it too.

Waiting burns no GPU time: the owner's queue is other requests' useful work, and it drains at the owner's rate. A
transient queue on the owner (a burst, one long prompt ahead) therefore costs this one request some latency and
nothing else, while the recompute is lost work. The gateway cannot see the future of the queue, but it sees what
the fleet delivers: the estimated TTFT of its recent decisions. So the rule is:

    move  iff  gain_s > lost_s                                      the move saves more than it recomputes
          and (lost_s == 0 or ttft(owner) > tail_s)                 and, if it loses hits, staying would put this
                                                                    request beyond the fleet's recent tail

``tail_s`` is the ``tail_quantile`` (0.99 by default: the p99 the benchmarks report, interpolated between order
statistics as ``numpy.percentile`` does) of the estimated TTFT of the requests the fleet has **served** among its last
``tail_window`` (1,024) decisions: those whose estimated first token (the chosen worker's clock at the decision
plus its estimate) is already past at this decision. An owner that would serve the request no later than the fleet
has recently served its slowest requests is merely busy (a long prompt ahead drains at the owner's rate), and
moving the session for it trades a lost prefix for latency the fleet already lives with; an owner past that
(overloaded, slowed down, a queue that does not drain, a short turn held behind another request's long prefill)
loses the session.

Why served requests only: a request still waiting is no latency the fleet has delivered, and the longest pending
prefill on the owner is exactly what this request would wait behind; counting its estimate let the queue justify
itself. Measured on the agentic coding sessions (``benchmarks/routing.py --workload agentic``, concurrency 8): a
16,842-token turn, all but 330 tokens cached, was held 13.6 s behind a 123K-token cold prefill placed on its owner
0.07 s before, because that prefill's own 13.9 s estimate (and a 128K cold prefill's 16.6 s) were in the window;
the turn became the run's third slowest request, and so set its p99 (15.07 s against 13.87 s for plain
``cache_aware``), while the move would have recomputed 0.8 s of prefix on an idle worker. Why the p99 and not the
maximum: the maximum is one request's cold prefill of the longest prompt (its own work, which no placement
shortens), and a queue up to that long then never moves a session however short its turn. With this rule the
agentic replay moved 2 sessions per run (hit ratio 0.990 of the ceiling, p99 13.84-13.91 s); the demo's Mooncake
slice moved none (hit ratio 0.998 of the ceiling as before, p99 8.69 s against 8.85 s).

A move that loses no hit (the alternative holds at least as much of the prompt) needs only ``gain_s > 0``. No
constant is fitted: ``lost_s`` comes from the prefill rates of the timing profile (the inner policy's cost model,
corrected by the online speed factors), ``tail_s`` from the fleet's measured state. With nothing served yet the tail
is 0 (the cost rule alone).

Only a session's owner is held this way: a new session is placed by the inner ``cache_aware`` alone, whose decode
load term spreads sessions that share a head (one system prompt for all) instead of piling them onto its holder.

Session statistics are kept beside it for the admin and the report: sessions placed new and returning turns, whose
ratio is the mean number of turns a session returns for (``expected_future_turns``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from policies.base import WorkerState
from policies.cost_model import TTFTCostModel

__all__ = ["SessionMoveCost", "interpolated_quantile"]


def interpolated_quantile(ordered: Sequence[float], quantile: float) -> float:
    """The ``quantile`` (0..1) of ascending ``ordered`` values, linear between order statistics (``numpy.percentile``'s
    default, Hyndman and Fan's type 7: position ``q * (n - 1)``), as ``loadgen.report.percentile`` computes the
    reported p99. 0.0 for no values."""
    if not ordered:
        return 0.0
    position = quantile * (len(ordered) - 1)
    low = math.floor(position)
    if low >= len(ordered) - 1:
        return ordered[-1]
    return ordered[low] + (position - low) * (ordered[low + 1] - ordered[low])


class SessionMoveCost:
    """The move rule of the module docstring, with its window of recent estimated TTFTs.

    Args:
        cost_model: the inner ``cache_aware`` policy's cost model (prefill rates of the timing profile).
        speed_factor: the inner policy's per-worker speed factor (1.0: as profiled).
        tail_quantile: the quantile of the served requests' estimates that is the fleet's tail, 0 < q <= 1.
        tail_window: decisions in the window.

    Attributes:
        num_new_sessions: sessions placed for the first time (``sticky_new``).
        num_returning_turns: requests of a session that already had an owner.
        num_moves_priced: moves the rule allowed that recomputed part of a prefix.
        num_stays_priced: moves the rule refused (the owner kept the session although another worker was cheaper).
    """

    def __init__(
        self, cost_model: TTFTCostModel, speed_factor: Callable[[str], float], *, tail_quantile: float = 0.99,
        tail_window: int = 1024,
    ) -> None:
        if not 0.0 < tail_quantile <= 1.0:
            raise ValueError(f"tail_quantile must be in (0, 1], got {tail_quantile}")
        if tail_window < 1:
            raise ValueError(f"tail_window must be >= 1, got {tail_window}")
        self._model = cost_model
        self._speed_factor = speed_factor
        self._quantile = tail_quantile
        self._window: deque[tuple[float, float]] = deque(maxlen=tail_window)
        """``(estimated TTFT s, estimated first token on the chosen worker's clock s)`` per decision."""
        self.num_new_sessions = 0
        self.num_returning_turns = 0
        self.num_moves_priced = 0
        self.num_stays_priced = 0

    def observe(self, chosen_ttft_s: float | None, *, is_new: bool | None = None, clock_s: float = 0.0) -> None:
        """Record one decision: the chosen worker's estimated TTFT (``None``: not in seconds), whether it placed a
        new session (``None``: a request without a session) and the decision time on the chosen worker's clock
        (``WorkerState.clock_s``, seconds): the request counts as served from ``clock_s + chosen_ttft_s`` on."""
        if chosen_ttft_s is not None and math.isfinite(chosen_ttft_s):
            self._window.append((chosen_ttft_s, clock_s + chosen_ttft_s))
        if is_new is True:
            self.num_new_sessions += 1
        elif is_new is False:
            self.num_returning_turns += 1

    @property
    def expected_future_turns(self) -> float:
        """Mean number of further turns a session returns for (returning turns ÷ new sessions; 0 before any)."""
        return self.num_returning_turns / self.num_new_sessions if self.num_new_sessions else 0.0

    def tail_s(self, clock_s: float = math.inf) -> float:
        """The fleet's recent tail of estimated TTFT, seconds (module docstring): the ``tail_quantile`` of the
        estimates of the window's requests served by ``clock_s`` (the decision time on the owner's clock, seconds;
        the default counts every request). 0.0 when none is. O(window log window)."""
        return interpolated_quantile(sorted(e for e, served_at_s in self._window if served_at_s <= clock_s),
                                     self._quantile)

    def lost_s(self, num_prompt_tokens: int, owner: WorkerState, best: WorkerState) -> float:
        """Seconds ``best`` spends recomputing what ``owner`` holds of the prompt and ``best`` lacks (0 when
        ``best`` holds as much): positions ``k_best..k_owner`` at the profile's rates, times ``best``'s speed
        factor. Cached tokens are counted on every tier and capped at the prompt."""
        n = num_prompt_tokens
        k_owner = min(owner.num_cached_tokens, n)
        k_best = min(best.num_cached_tokens, n)
        if k_owner <= k_best:
            return 0.0
        model = self._model
        work = (k_owner - k_best) * model.s_per_token + (k_owner * k_owner - k_best * k_best) * model.s_per_token_sq
        return work * self._speed_factor(best.worker_id)

    def moves(self, num_prompt_tokens: int, owner: WorkerState, best: WorkerState, owner_ttft_s: float,
              best_ttft_s: float) -> bool:
        """Whether the session moves from ``owner`` to ``best`` (the rule of the module docstring); counted."""
        lost = self.lost_s(num_prompt_tokens, owner, best)
        gain = owner_ttft_s - best_ttft_s
        if lost <= 0.0:
            return gain > 0.0
        if gain > lost and owner_ttft_s > self.tail_s(owner.clock_s):
            self.num_moves_priced += 1
            return True
        self.num_stays_priced += 1
        return False
