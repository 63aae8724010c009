"""Run summaries from request records: hit ratio against the ceiling, latency percentiles, balance, errors.

Definitions (all times in simulated seconds: wall seconds multiplied by the replay's ``time_scale``; at time
scale 1 they are wall seconds):

* TTFT: where the worker reports its engine's part (``RequestRecord.engine_ttft_s``, a kvgate sim worker's usage
  chunk), only that part is scaled and the rest, which ran in real time (the client, the router in front, HTTP,
  the worker's tokenizer), is counted as measured: ``engine * time_scale + (ttft - engine)``
  (``simulated_ttft_s``). Scaling the whole would multiply a router's own wall time by ``time_scale`` as if it ran
  that many times slower than the workers; every router is measured the same way. ``ttft_outside_engine_p50_s``
  is the median of that real-time part (seconds).

* ``hit_ratio`` = Σ cached tokens (``usage.prompt_tokens_details.cached_tokens``) ÷ Σ prompt tokens, over
  successful requests (reported prompt tokens where the server sends them, else the trace's);
  ``ceiling_hit_ratio`` is the infinite-cache bound of the same requests (``loadgen.ceiling.served_ceiling``:
  failed and unsent requests neither read nor fill that cache), so ``hit_ratio ÷ ceiling_hit_ratio`` is the share
  of the reachable reuse a run achieved, and a failed request cannot lift it above 1.
* percentiles: numpy's default (linear interpolation between closest ranks); ITL pools every gap of every
  successful request.
* ``output_tokens_per_s`` = Σ output tokens ÷ run duration (first send to last completion).
* ``load_imbalance`` = max ÷ mean prompt tokens per worker (``request_imbalance``: the same over requests); the
  worker set is the fleet when known, else the workers named by the gateway's header.
* ``num_skipped``: requests of the slice never sent (``skip_reason`` says why: ``"max_duration_s"``, the replay's
  wall-clock limit came first); ``requests_ok + requests_failed + num_skipped`` is the slice's size. The table
  shows them as ``not sent``, and a caption line gives the reason.
* ``cached_tokens_mismatch_ratio``: share of successful requests with both a predicted and a reported cached
  token count whose two numbers differ (requests without a prediction are counted in
  ``num_unpredicted``). With the gateway's counts by cause (``mismatches_by_cause``, read from a kvgate gateway's
  ``/metrics`` before and after the run), the same share is split: ``cached_mismatch_index_ratio`` (the index
  predicted blocks the worker did not hold and no eviction explains: a bug), ``cached_mismatch_evicted_ratio``
  (the worker evicted predicted blocks after the decision: a forecast miss), ``cached_mismatch_pending_ratio``
  (the first block missed was pending at the decision, still being computed by a request in flight: a burst
  before the events) and ``cached_mismatch_late_ratio`` (the worker held more than the index knew).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

from loadgen.client import RequestRecord
from loadgen.replay import SkipReason

logger = logging.getLogger(__name__)


class RunSummary(msgspec.Struct):
    """The numbers of one replay. Times in simulated seconds (see module docstring); ``policy`` is the run's label
    (the routing policy in the demo); ``session_prefix`` is what the run put in front of every session id."""

    policy: str
    requests_ok: int
    requests_failed: int
    hit_ratio: float
    ceiling_hit_ratio: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    output_tokens_per_s: float
    requests_per_s: float
    load_imbalance: float | None
    request_imbalance: float | None
    cached_tokens_mismatch_ratio: float | None
    num_unpredicted: int
    errors_by_kind: dict[str, int]
    requests_by_worker: dict[str, int]
    prompt_tokens_by_worker: dict[str, int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    duration_s: float
    time_scale: float
    fraction_of_ceiling: float | None = None
    num_skipped: int = 0
    skip_reason: SkipReason | None = None
    session_prefix: str = ""
    cached_mismatch_index_ratio: float | None = None
    cached_mismatch_evicted_ratio: float | None = None
    cached_mismatch_pending_ratio: float | None = None
    cached_mismatch_late_ratio: float | None = None
    ttft_outside_engine_p50_s: float | None = None
    error_examples: dict[str, str] = msgspec.field(default_factory=dict)
    """The first failed request of each error kind: its request id (``x-request-id``, the gateway's log key) and
    the start of its error message, so a reader can look a failure up."""


def error_examples(failed: Sequence[RequestRecord]) -> dict[str, str]:
    """``RunSummary.error_examples`` of the failed records, in their order."""
    out: dict[str, str] = {}
    for r in failed:
        out.setdefault(r.error_kind or "", f"{r.request_id or '?'}: {r.error_message}"[:240])
    return out


def simulated_ttft_s(record: RequestRecord, time_scale: float) -> float | None:
    """The record's TTFT in simulated seconds (module docstring): the engine's part scaled, the rest as measured;
    the whole scaled when the worker reports no engine part (or an inconsistent one). ``None`` without a TTFT."""
    ttft = record.ttft_s
    if ttft is None:
        return None
    engine = record.engine_ttft_s
    if engine is None or not 0.0 <= engine <= ttft:
        return ttft * time_scale
    return engine * time_scale + (ttft - engine)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` (numpy linear interpolation), ``None`` when empty."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def imbalance(values: Sequence[float]) -> float | None:
    """max ÷ mean of ``values``; ``None`` for no values or a zero mean."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def summarize(
    records: Sequence[RequestRecord],
    *,
    policy: str,
    ceiling_hit_ratio: float,
    duration_s: float,
    time_scale: float = 1.0,
    workers: Sequence[str] = (),
    num_skipped: int = 0,
    skip_reason: SkipReason | None = None,
    session_prefix: str = "",
    mismatches_by_cause: dict[str, int] | None = None,
) -> RunSummary:
    """Summarize one replay.

    Args:
        records: the replay's request records.
        policy: label of the run (the routing policy, or any name).
        ceiling_hit_ratio: the infinite-cache ceiling of the successful requests (``served_ceiling``), 0..1.
        duration_s: wall-clock duration of the replay, seconds.
        time_scale: wall seconds are multiplied by this to give simulated seconds.
        workers: the fleet's worker ids (workers that served nothing count as 0); empty to use the ones seen.
        num_skipped: requests of the slice that were never sent.
        skip_reason: why (``None`` when every request was sent).
        session_prefix: the prefix of the run's session ids.
        mismatches_by_cause: the gateway's cached-token mismatches during the run by cause (``index``,
            ``evicted``, ``pending``, ``late``), or ``None`` when not known.

    Raises:
        ValueError: ``time_scale`` <= 0, ``duration_s`` < 0, ``num_skipped`` < 0, or ``num_skipped`` > 0 without
            a ``skip_reason``.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    if num_skipped < 0:
        raise ValueError(f"num_skipped must be >= 0, got {num_skipped}")
    if num_skipped and skip_reason is None:
        raise ValueError(f"{num_skipped} requests not sent need a skip_reason")
    ok = [r for r in records if r.is_ok]
    failed = [r for r in records if not r.is_ok]
    prompt_tokens = sum(r.num_reported_prompt_tokens or r.num_prompt_tokens for r in ok)
    cached_tokens = sum(r.num_cached_tokens or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    ttfts = [t for t in (simulated_ttft_s(r, time_scale) for r in ok) if t is not None]
    outside = [r.ttft_s - r.engine_ttft_s for r in ok
               if r.ttft_s is not None and r.engine_ttft_s is not None and 0.0 <= r.engine_ttft_s <= r.ttft_s]
    itls = [gap * time_scale for r in ok for gap in r.itl_s]
    e2es = [r.e2e_s * time_scale for r in ok]
    sim_duration_s = duration_s * time_scale
    requests_by_worker: Counter[str] = Counter({w: 0 for w in workers})
    prompt_by_worker: Counter[str] = Counter({w: 0 for w in workers})
    for r in ok:
        if r.worker is not None:
            requests_by_worker[r.worker] += 1
            prompt_by_worker[r.worker] += r.num_reported_prompt_tokens or r.num_prompt_tokens
    compared = [r for r in ok if r.num_predicted_cached_tokens is not None and r.num_cached_tokens is not None]
    mismatched = sum(1 for r in compared if r.num_predicted_cached_tokens != r.num_cached_tokens)
    hit_ratio = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    by_cause: dict[str, float | None] = dict.fromkeys(("index", "evicted", "pending", "late"))
    if mismatches_by_cause is not None and compared:
        by_cause = {c: mismatches_by_cause.get(c, 0) / len(compared) for c in by_cause}
    return RunSummary(
        policy=policy,
        requests_ok=len(ok),
        requests_failed=len(failed),
        hit_ratio=hit_ratio,
        ceiling_hit_ratio=ceiling_hit_ratio,
        fraction_of_ceiling=hit_ratio / ceiling_hit_ratio if ceiling_hit_ratio > 0 else None,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        e2e_p50_s=percentile(e2es, 50),
        output_tokens_per_s=output_tokens / sim_duration_s if sim_duration_s > 0 else 0.0,
        requests_per_s=len(ok) / sim_duration_s if sim_duration_s > 0 else 0.0,
        load_imbalance=imbalance(list(prompt_by_worker.values())),
        request_imbalance=imbalance(list(requests_by_worker.values())),
        cached_tokens_mismatch_ratio=mismatched / len(compared) if compared else None,
        num_unpredicted=len(ok) - len(compared),
        errors_by_kind=dict(Counter(r.error_kind or "" for r in failed)),
        error_examples=error_examples(failed),
        requests_by_worker=dict(sorted(requests_by_worker.items())),
        prompt_tokens_by_worker=dict(sorted(prompt_by_worker.items())),
        num_prompt_tokens=prompt_tokens,
        num_cached_tokens=cached_tokens,
        num_output_tokens=output_tokens,
        duration_s=sim_duration_s,
        time_scale=time_scale,
        num_skipped=num_skipped,
        skip_reason=skip_reason if num_skipped else None,
        session_prefix=session_prefix,
        cached_mismatch_index_ratio=by_cause["index"],
        cached_mismatch_evicted_ratio=by_cause["evicted"],
        cached_mismatch_pending_ratio=by_cause["pending"],
        cached_mismatch_late_ratio=by_cause["late"],
        ttft_outside_engine_p50_s=percentile(outside, 50),
    )


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _by_cause(s: RunSummary) -> str:
    """The mismatch split by cause (``–`` without the gateway's counts)."""
    if s.cached_mismatch_index_ratio is None:
        return "–"
    return " / ".join(_fmt(v, ".2%") for v in (s.cached_mismatch_index_ratio, s.cached_mismatch_evicted_ratio,
                                              s.cached_mismatch_pending_ratio, s.cached_mismatch_late_ratio))


MARKDOWN_COLUMNS: tuple[str, ...] = (
    "run",
    "ok",
    "failed",
    "not sent",
    "hit ratio",
    "of ceiling",
    "TTFT p50 (s)",
    "TTFT p90 (s)",
    "TTFT p99 (s)",
    "ITL p50 (ms)",
    "ITL p99 (ms)",
    "out tok/s",
    "imbalance (tokens)",
    "imbalance (requests)",
    "cached mismatch",
)


def table_rows(summaries: Sequence[RunSummary]) -> list[list[str]]:
    """One row of display strings per run, in ``MARKDOWN_COLUMNS`` order."""
    rows = []
    for s in summaries:
        rows.append(
            [
                s.policy,
                str(s.requests_ok),
                str(s.requests_failed),
                str(s.num_skipped),
                f"{s.hit_ratio:.3f}",
                _fmt(s.fraction_of_ceiling, ".2f"),
                _fmt(s.ttft_p50_s, ".3f"),
                _fmt(s.ttft_p90_s, ".3f"),
                _fmt(s.ttft_p99_s, ".3f"),
                _fmt(None if s.itl_p50_s is None else s.itl_p50_s * 1000, ".1f"),
                _fmt(None if s.itl_p99_s is None else s.itl_p99_s * 1000, ".1f"),
                f"{s.output_tokens_per_s:.0f}",
                _fmt(s.load_imbalance, ".2f"),
                _fmt(s.request_imbalance, ".2f"),
                _fmt(s.cached_tokens_mismatch_ratio, ".2%"),
            ]
        )
    return rows


def ceiling_caption(summaries: Sequence[RunSummary]) -> str:
    """The sentence naming the ceiling and its population: one value when every run has the same, else one per
    run (runs whose failures differ serve different requests)."""
    values = [f"{s.ceiling_hit_ratio:.3f}" for s in summaries]
    if len(set(values)) == 1:
        shown = values[0]
    else:
        shown = ", ".join(f"{s.policy} {v}" for s, v in zip(summaries, values, strict=True))
    return (
        f"Ceiling hit ratio (infinite cache) over the requests that succeeded, as `hit ratio`: {shown} (failed "
        "and unsent requests neither read nor fill that cache)."
    )


SKIP_REASON_TEXT: dict[SkipReason, str] = {"max_duration_s": "max-duration-s reached"}
"""How each ``skip_reason`` reads in the reports."""


def not_sent_line(summary: RunSummary) -> str:
    """What became of the run's requests: ``"300 requests, 136 ok, 5 failed, 159 not sent (max-duration-s
    reached)"`` (the reason only when some were not sent); the numbers are ``results.json``'s ``requests_ok``,
    ``requests_failed`` and ``num_skipped``."""
    s = summary
    total = s.requests_ok + s.requests_failed + s.num_skipped
    line = f"{total} requests, {s.requests_ok} ok, {s.requests_failed} failed, {s.num_skipped} not sent"
    if s.num_skipped and s.skip_reason is not None:
        line += f" ({SKIP_REASON_TEXT[s.skip_reason]})"
    return line


def times_caption(time_scale: float) -> str:
    """The sentence saying which seconds the times are in."""
    if time_scale == 1.0:
        return "Times in wall seconds (time scale 1)."
    return f"Times in simulated seconds (wall seconds × time scale {time_scale:g})."


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    """The comparison table in Markdown (one row per run, labelled by the run's name), with the ceiling and the
    time unit in a caption line, then a line per run that left requests unsent (``not_sent_line``), the cached
    mismatch by cause (runs whose gateway gave it) and the errors by kind."""
    lines = [
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "|".join("---" for _ in MARKDOWN_COLUMNS) + "|",
    ]
    lines.extend("| " + " | ".join(row) + " |" for row in table_rows(summaries))
    if summaries:
        lines.append("")
        lines.append(f"{ceiling_caption(summaries)} {times_caption(summaries[0].time_scale)}")
        lines.extend(f"{s.policy}: {not_sent_line(s)}." for s in summaries if s.num_skipped)
        split = [f"{s.policy} {_by_cause(s)}" for s in summaries if s.cached_mismatch_index_ratio is not None]
        if split:
            lines.append("Cached mismatch by cause (index wrong / evicted after the decision / still pending at the "
                         "decision / stored before the index knew), share of requests: " + "; ".join(split) + ".")
        errors = {s.policy: s.errors_by_kind for s in summaries if s.errors_by_kind}
        if errors:
            lines.append("Errors by kind: " + "; ".join(f"{p}: {e}" for p, e in errors.items()) + ".")
    return "\n".join(lines) + "\n"
