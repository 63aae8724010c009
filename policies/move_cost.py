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

``tail_s`` is the ``tail_quantile`` (1.0 by default: the maximum) of the chosen workers' estimated TTFT over the
last ``tail_window`` (1,024) decisions: an owner that would serve the request no later than the fleet has recently
served some request is merely busy (a long prompt ahead drains at the owner's rate), and moving the session for it
trades a lost prefix for latency the fleet already lives with; an owner past everything the fleet has recently
served (overloaded, slowed down, a queue that does not drain) loses the session. Why the maximum and not a p99:
with the queue priced with its attention (``policies/cost_model.py``), the owners draining one long prompt were
estimated past the fleet's p99 as they really are, and the three moves that allowed on the demo's Mooncake slice
recomputed 67K cached tokens, 6.4% of the slice's reusable prefix, for no change in the TTFT p99 (8.59 s against
8.58 s): a p99 is set by hundreds of requests, one moved request does not move it, while every recomputed token is a
hit lost for good. A move that loses no hit (the
alternative holds at least as much of the prompt) needs only ``gain_s > 0``. No constant is fitted: ``lost_s``
comes from the prefill rates of the timing profile (the inner policy's cost model, corrected by the online speed
factors), ``tail_s`` from the fleet's measured state. Until ``MIN_TAIL_DECISIONS`` decisions are seen the tail is
the largest estimate seen (none: 0, the cost rule alone).

Only a session's owner is held this way: a new session is placed by the inner ``cache_aware`` alone, whose decode
load term spreads sessions that share a head (one system prompt for all) instead of piling them onto its holder.

Session statistics are kept beside it for the admin and the report: sessions placed new and returning turns, whose
ratio is the mean number of turns a session returns for (``expected_future_turns``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from policies.base import WorkerState
from policies.cost_model import TTFTCostModel

__all__ = ["MIN_TAIL_DECISIONS", "SessionMoveCost"]

MIN_TAIL_DECISIONS = 100
"""Below this many decisions in the window the tail is the window's maximum (a p99 of fewer is the maximum anyway)."""


class SessionMoveCost:
    """The move rule of the module docstring, with its window of recent estimated TTFTs.

    Args:
        cost_model: the inner ``cache_aware`` policy's cost model (prefill rates of the timing profile).
        speed_factor: the inner policy's per-worker speed factor (1.0: as profiled).
        tail_quantile: the quantile of the window that is the fleet's tail, 0 < q <= 1.
        tail_window: decisions in the window.

    Attributes:
        num_new_sessions: sessions placed for the first time (``sticky_new``).
        num_returning_turns: requests of a session that already had an owner.
        num_moves_priced: moves the rule allowed that recomputed part of a prefix.
        num_stays_priced: moves the rule refused (the owner kept the session although another worker was cheaper).
    """

    def __init__(
        self, cost_model: TTFTCostModel, speed_factor: Callable[[str], float], *, tail_quantile: float = 1.0,
        tail_window: int = 1024,
    ) -> None:
        if not 0.0 < tail_quantile <= 1.0:
            raise ValueError(f"tail_quantile must be in (0, 1], got {tail_quantile}")
        if tail_window < 1:
            raise ValueError(f"tail_window must be >= 1, got {tail_window}")
        self._model = cost_model
        self._speed_factor = speed_factor
        self._quantile = tail_quantile
        self._window: deque[float] = deque(maxlen=tail_window)
        self.num_new_sessions = 0
        self.num_returning_turns = 0
        self.num_moves_priced = 0
        self.num_stays_priced = 0

    def observe(self, chosen_ttft_s: float | None, *, is_new: bool | None = None) -> None:
        """Record one decision: the chosen worker's estimated TTFT (``None``: not in seconds) and whether it placed a
        new session (``None``: a request without a session)."""
        if chosen_ttft_s is not None and math.isfinite(chosen_ttft_s):
            self._window.append(chosen_ttft_s)
        if is_new is True:
            self.num_new_sessions += 1
        elif is_new is False:
            self.num_returning_turns += 1

    @property
    def expected_future_turns(self) -> float:
        """Mean number of further turns a session returns for (returning turns ÷ new sessions; 0 before any)."""
        return self.num_returning_turns / self.num_new_sessions if self.num_new_sessions else 0.0

    def tail_s(self) -> float:
        """The fleet's recent tail of estimated TTFT, seconds (module docstring); 0.0 with an empty window."""
        window = self._window
        if not window:
            return 0.0
        if len(window) < MIN_TAIL_DECISIONS:
            return max(window)
        ordered = sorted(window)
        return ordered[min(len(ordered) - 1, math.ceil(self._quantile * len(ordered)) - 1)]

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
        if gain > lost and owner_ttft_s > self.tail_s():
            self.num_moves_priced += 1
            return True
        self.num_stays_priced += 1
        return False
