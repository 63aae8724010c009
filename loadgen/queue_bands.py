"""How well a kvgate gateway predicted TTFT, by the queue it predicted on the worker it chose: observed ÷ predicted
TTFT per band of predicted queue.

Inputs: one run's request records (``loadgen.client.RequestRecord``, which carry the gateway's request id from the
response's ``x-request-id``) and the entries of the gateway's ``/admin/decisions`` (``router.admin``: per request its
``request_id``, the chosen ``worker_id``, every candidate's ``scores``, the estimated TTFT in the worker's seconds,
and ``cost_terms``, the same estimate term by term). A record is paired with its decision when it succeeded, has a
TTFT, and was served by the worker the decision chose (a retried request was predicted for another worker).

Per pair (seconds, simulated: the worker's clock)::

    predicted  = scores[w]                                 (overhead + queue + prefill + restore, speed-scaled)
    queue      = cost_terms[w]["queue_s"]                  (the queue term of that estimate, speed-scaled)
    observed   = loadgen.report.simulated_ttft_s(record)   (engine part scaled, the rest as measured)
    wait       = observed - (predicted - queue)            (the observed time not explained by the request's own
                                                            prefill, restore and overhead: its wait in the queue)

Per band of ``queue`` (``QUEUE_BAND_EDGES_S``, lower edge included): the number of pairs, the median and the 10th
/ 90th percentiles of ``observed / predicted``, and ``Σ wait / Σ queue``, the share of the predicted queue the
requests actually waited (1: the queue term is exact on average in that band).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from loadgen.client import RequestRecord
from loadgen.report import percentile, simulated_ttft_s

__all__ = ["QUEUE_BAND_EDGES_S", "PredictionPair", "QueueBand", "markdown_bands", "pair_predictions",
           "queue_bands"]

QUEUE_BAND_EDGES_S: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
"""Band edges of the predicted queue, seconds: ``[0, 0.5), [0.5, 1), ..., [16, inf)``."""


class PredictionPair(msgspec.Struct, frozen=True, gc=False):
    """One request's prediction and observation (seconds, the worker's clock; module docstring).

    Attributes:
        request_id: the gateway's id of the request.
        worker_id: the worker chosen and serving it.
        predicted_s: the estimated TTFT on that worker.
        queue_s: the queue term of that estimate.
        observed_s: the TTFT observed at the client, simulated.
    """

    request_id: str
    worker_id: str
    predicted_s: float
    queue_s: float
    observed_s: float


class QueueBand(msgspec.Struct, frozen=True):
    """The pairs whose predicted queue falls in ``[lower_s, upper_s)`` (module docstring).

    Attributes:
        lower_s: lower edge of the predicted queue, seconds (included).
        upper_s: upper edge, seconds (excluded; ``inf`` for the last band).
        num_requests: pairs in the band.
        ratio_p50: median of observed ÷ predicted TTFT.
        ratio_p10: 10th percentile of it.
        ratio_p90: 90th percentile of it.
        wait_share: Σ (observed - predicted + queue) ÷ Σ queue; ``None`` when the band's queue sums to 0.
        mean_queue_s: mean predicted queue, seconds.
    """

    lower_s: float
    upper_s: float
    num_requests: int
    ratio_p50: float | None
    ratio_p10: float | None
    ratio_p90: float | None
    wait_share: float | None
    mean_queue_s: float | None


def pair_predictions(
    records: Iterable[RequestRecord], decisions: Iterable[Mapping[str, Any]], time_scale: float,
) -> list[PredictionPair]:
    """The records paired with their decisions (module docstring), in record order.

    Args:
        records: one run's records.
        decisions: the ``decisions`` list of that run's ``/admin/decisions`` (entries without ``cost_terms`` for
            the chosen worker, such as forced ones, are left out).
        time_scale: the replay's time scale (simulated seconds per wall second; ``simulated_ttft_s``).
    """
    by_id: dict[str, Mapping[str, Any]] = {}
    for entry in decisions:
        request_id = entry.get("request_id")
        if isinstance(request_id, str):
            by_id[request_id] = entry
    out: list[PredictionPair] = []
    for r in records:
        if not r.is_ok or r.request_id is None or r.worker is None:
            continue
        d = by_id.get(r.request_id)
        observed = simulated_ttft_s(r, time_scale)
        if d is None or observed is None or d.get("worker_id") != r.worker:
            continue
        predicted = (d.get("scores") or {}).get(r.worker)
        terms = (d.get("cost_terms") or {}).get(r.worker)
        if predicted is None or not terms or "queue_s" not in terms:
            continue
        out.append(PredictionPair(r.request_id, r.worker, float(predicted), float(terms["queue_s"]), observed))
    return out


def queue_bands(pairs: Sequence[PredictionPair], edges_s: Sequence[float] = QUEUE_BAND_EDGES_S) -> list[QueueBand]:
    """One ``QueueBand`` per interval of ``edges_s`` (ascending), empty bands included.

    Raises:
        ValueError: fewer than two edges, or edges not strictly ascending.
    """
    if len(edges_s) < 2 or any(b <= a for a, b in zip(edges_s, edges_s[1:], strict=False)):
        raise ValueError(f"band edges must be at least two, strictly ascending; got {list(edges_s)}")
    bands: list[QueueBand] = []
    for lower, upper in zip(edges_s, edges_s[1:], strict=False):
        members = [p for p in pairs if lower <= p.queue_s < upper]
        ratios = [p.observed_s / p.predicted_s for p in members if p.predicted_s > 0.0]
        queue_sum = sum(p.queue_s for p in members)
        wait_sum = sum(p.observed_s - p.predicted_s + p.queue_s for p in members)
        bands.append(QueueBand(
            lower, upper, len(members), percentile(ratios, 50), percentile(ratios, 10), percentile(ratios, 90),
            wait_sum / queue_sum if queue_sum > 0.0 else None,
            queue_sum / len(members) if members else None,
        ))
    return bands


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_bands(title: str, bands: Sequence[QueueBand]) -> str:
    """A Markdown table of ``bands`` under ``title`` (bands without requests left out)."""
    lines = [title, "",
             "| predicted queue (s) | requests | observed ÷ predicted TTFT p50 (p10–p90) | waited ÷ predicted queue |"
             " mean predicted queue (s) |", "|---|---|---|---|---|"]
    for b in bands:
        if not b.num_requests:
            continue
        upper = "∞" if math.isinf(b.upper_s) else f"{b.upper_s:g}"
        lines.append(f"| {b.lower_s:g}–{upper} | {b.num_requests} | {_fmt(b.ratio_p50, '.2f')} "
                     f"({_fmt(b.ratio_p10, '.2f')}–{_fmt(b.ratio_p90, '.2f')}) | {_fmt(b.wait_share, '.2f')} | "
                     f"{_fmt(b.mean_queue_s, '.2f')} |")
    return "\n".join(lines) + "\n"
