"""``loadgen.queue_bands``: records paired with their gateway decisions, and observed ÷ predicted TTFT by band of
the predicted queue, with the values worked out by hand (time scale 4: wall 0.25 s is 1 simulated second)."""

import math

import pytest

from loadgen.client import RequestRecord
from loadgen.queue_bands import PredictionPair, markdown_bands, pair_predictions, queue_bands

pytestmark = pytest.mark.unit

TIME_SCALE = 4.0


def record(index: int, worker: str, ttft_s: float | None, *, engine_s: float | None = None,
           error: str | None = None) -> RequestRecord:
    return RequestRecord(index=index, session_id="", start_s=0.0, num_prompt_tokens=100, worker=worker,
                         ttft_s=ttft_s, engine_ttft_s=engine_s, error_kind=error, request_id=f"r{index}")


def decision(index: int, worker: str, predicted_s: float, queue_s: float) -> dict:
    return {"request_id": f"r{index}", "worker_id": worker, "scores": {worker: predicted_s, "other": 99.0},
            "cost_terms": {worker: {"queue_s": queue_s, "prefill_s": 0.0}, "other": {"queue_s": 0.0}}}


RECORDS = [
    record(0, "w0", 0.25),  # observed 1.0
    record(1, "w1", 0.125),  # observed 0.5
    record(2, "w1", 0.25),  # retried: decided for w0, served by w1
    record(3, "w0", None, error="timeout"),
    record(4, "w0", 0.25),  # no decision (out of the ring)
    record(5, "w0", 0.75),  # observed 3.0
    record(6, "w0", 1.25, engine_s=1.0),  # observed 1.0 * 4 + 0.25 = 4.25 (the engine part scaled only)
]
DECISIONS = [
    decision(0, "w0", 2.0, 1.25),
    decision(1, "w1", 0.5, 0.25),
    decision(2, "w0", 1.0, 0.0),
    decision(3, "w0", 1.0, 0.0),
    decision(5, "w0", 4.0, 3.0),
    decision(6, "w0", 5.0, 2.0),
    {"request_id": "r9", "worker_id": "w0", "scores": {}, "cost_terms": {}},  # forced: no terms
]


def test_pairs_are_the_served_requests_with_a_decision_for_their_worker():
    assert pair_predictions(RECORDS, DECISIONS, TIME_SCALE) == [
        PredictionPair("r0", "w0", 2.0, 1.25, 1.0),
        PredictionPair("r1", "w1", 0.5, 0.25, 0.5),
        PredictionPair("r5", "w0", 4.0, 3.0, 3.0),
        PredictionPair("r6", "w0", 5.0, 2.0, 4.25),
    ]


def test_bands_give_the_ratio_percentiles_and_the_waited_share_of_the_queue():
    bands = queue_bands(pair_predictions(RECORDS, DECISIONS, TIME_SCALE), edges_s=(0.0, 1.0, 2.0, 4.0, math.inf))
    assert [(b.lower_s, b.upper_s, b.num_requests) for b in bands] == [
        (0.0, 1.0, 1), (1.0, 2.0, 1), (2.0, 4.0, 2), (4.0, math.inf, 0)]
    low, mid, high, empty = bands
    # r1: 0.5 / 0.5; waited 0.5 - 0.5 + 0.25 = 0.25 of 0.25
    assert (low.ratio_p50, low.ratio_p10, low.ratio_p90, low.wait_share, low.mean_queue_s) == (1.0, 1.0, 1.0, 1.0,
                                                                                                0.25)
    # r0: 1.0 / 2.0; waited 1.0 - 2.0 + 1.25 = 0.25 of 1.25
    assert (mid.ratio_p50, mid.wait_share) == (0.5, 0.2)
    # r5: 3 / 4 = 0.75, waited 3 - 4 + 3 = 2; r6: 4.25 / 5 = 0.85, waited 4.25 - 5 + 2 = 1.25; (2 + 1.25) / (3 + 2)
    assert high.ratio_p50 == pytest.approx(0.8)
    assert high.ratio_p10 == pytest.approx(0.76) and high.ratio_p90 == pytest.approx(0.84)
    assert high.wait_share == pytest.approx(0.65) and high.mean_queue_s == 2.5
    assert (empty.ratio_p50, empty.wait_share, empty.mean_queue_s) == (None, None, None)


def test_markdown_lists_the_bands_with_requests():
    bands = queue_bands(pair_predictions(RECORDS, DECISIONS, TIME_SCALE), edges_s=(0.0, 1.0, 2.0, 4.0, math.inf))
    assert markdown_bands("kvgate:cache_aware", bands).splitlines()[2:] == [
        "| predicted queue (s) | requests | observed ÷ predicted TTFT p50 (p10–p90) | waited ÷ predicted queue |"
        " mean predicted queue (s) |",
        "|---|---|---|---|---|",
        "| 0–1 | 1 | 1.00 (1.00–1.00) | 1.00 | 0.25 |",
        "| 1–2 | 1 | 0.50 (0.50–0.50) | 0.20 | 1.25 |",
        "| 2–4 | 2 | 0.80 (0.76–0.84) | 0.65 | 2.50 |",
    ]


@pytest.mark.parametrize("edges", [(0.0,), (0.0, 1.0, 1.0), (2.0, 1.0)])
def test_bad_edges_are_refused(edges):
    with pytest.raises(ValueError, match="ascending"):
        queue_bands([], edges_s=edges)
