"""Steady-state throughput of a closed-loop agentic level, and where a turn's time goes.

A level keeps ``level`` sessions in flight: each slot replays a session's turns (think time, then the request),
then takes the next session from the queue, as kv-cache-tester's ``trace_replay_tester.py --recycle`` replaces a
completed user with a fresh trace (its ``docs/trace_replay_tester.md``). Once the queue is empty the slots retire
one by one, and the run ends with the longest remaining session's chain of think times alone: a whole-run figure
(tokens ÷ duration) then measures that tail, which is mostly think time and the same in every configuration.

The steady window is from the replay's start until the last session was taken from the queue (the first turn of
the last session to start): every slot is busy over it. Tokens are counted as kv-cache-tester's attribution does
("input tokens at TTFT"): a request's prompt tokens when its first token arrived inside the window; its output
tokens when its last one did (``e2e``). Times are simulated seconds (wall × ``time_scale``; TTFT through
``loadgen.report.simulated_ttft_s``).

Turn time (the closed loop's cycle, simulated s, means over the level's successful requests): think time (the
trace's, capped; 0 before a session's first turn), TTFT, and the rest of the answer (``e2e - TTFT``: decode and
streaming). A slot's throughput is one turn's prompt tokens per cycle, so two configurations of the same sessions
compare as the inverse ratio of their cycles while every slot is busy.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from loadgen.client import RequestRecord
from loadgen.report import simulated_ttft_s
from loadgen.traces import TraceRequest


class SteadyState(msgspec.Struct, frozen=True):
    """A level's steady window (module docstring); all times in simulated seconds."""

    window_s: float
    """Length of the steady window (0 when no session waited in the queue: then every figure below is 0)."""
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    num_requests: int
    """Successful requests whose first token arrived inside the window."""
    mean_think_s: float
    mean_ttft_s: float
    mean_decode_s: float
    """Mean ``e2e - TTFT`` over the level's successful requests."""


def steady_state(
    records: Sequence[RequestRecord], requests: Sequence[TraceRequest], time_scale: float, num_slots: int
) -> SteadyState:
    """The steady window and turn times of one level (module docstring).

    Args:
        records: the replay's records; ``record.index`` indexes ``requests``.
        requests: the replayed requests (their ``think_time_s``, simulated s).
        time_scale: simulated seconds per wall second (> 0).
        num_slots: sessions in flight (the level); with no more sessions than slots nothing waited in the queue,
            and the window is empty.

    Raises:
        ValueError: ``time_scale`` <= 0, ``num_slots`` < 1, or a record whose index is outside ``requests``.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    first_start: dict[str, float] = {}
    first_index: dict[str, int] = {}
    for r in records:
        if not 0 <= r.index < len(requests):
            raise ValueError(f"record index {r.index} outside the {len(requests)} replayed requests")
        key = r.session_id or f"#{r.index}"
        first_start[key] = min(first_start.get(key, r.start_s), r.start_s)
        first_index[key] = min(first_index.get(key, r.index), r.index)
    ok = [r for r in records if r.error_kind is None and r.ttft_s is not None]
    ttfts = [simulated_ttft_s(r, time_scale) or 0.0 for r in ok]
    thinks = [0.0 if first_index[r.session_id or f"#{r.index}"] == r.index else requests[r.index].think_time_s
              for r in ok]  # fmt: skip
    decodes = [max(0.0, (r.e2e_s - (r.ttft_s or 0.0)) * time_scale) for r in ok]
    n = len(ok) or 1
    end_wall_s = max(first_start.values(), default=0.0) if len(first_start) > num_slots else 0.0
    window_s = end_wall_s * time_scale
    if window_s <= 0:
        return SteadyState(0.0, 0.0, 0.0, 0, sum(thinks) / n, sum(ttfts) / n, sum(decodes) / n)
    inside = [r for r in ok if r.start_s + (r.ttft_s or 0.0) <= end_wall_s]
    num_prompt = sum(r.num_reported_prompt_tokens or r.num_prompt_tokens for r in inside)
    num_output = sum(r.num_output_tokens for r in ok if r.start_s + r.e2e_s <= end_wall_s)
    return SteadyState(
        window_s=window_s,
        prompt_tokens_per_s=num_prompt / window_s,
        output_tokens_per_s=num_output / window_s,
        num_requests=len(inside),
        mean_think_s=sum(thinks) / n,
        mean_ttft_s=sum(ttfts) / n,
        mean_decode_s=sum(decodes) / n,
    )

