"""The agentic levels' steady window (every slot busy) and turn-time split, on hand-made records."""

from __future__ import annotations

import pytest

from loadgen.agentic_steady import SteadyState, steady_state
from loadgen.client import RequestRecord
from loadgen.traces import TraceRequest

pytestmark = pytest.mark.unit


def trace(session: str, think_s: float) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, num_prompt_tokens=1000, num_output_tokens=8, hash_ids=(1,), block_size=64,
                        namespace=session, session_id=session, think_time_s=think_s)  # fmt: skip


def record(index: int, session: str, start_s: float, ttft_s: float, e2e_s: float, tokens: int = 1000,
           error: str | None = None) -> RequestRecord:  # fmt: skip
    return RequestRecord(index=index, session_id=session, start_s=start_s, num_prompt_tokens=tokens,
                         num_reported_prompt_tokens=tokens, num_output_tokens=10, ttft_s=ttft_s, e2e_s=e2e_s,
                         error_kind=error)  # fmt: skip


def test_the_window_ends_when_the_last_session_left_the_queue_and_counts_tokens_at_their_first_token():
    # one slot-pair: sessions a and b run first; c starts at 3.0 wall s (the queue is then empty); time scale 10
    requests = [trace("a", 0.0), trace("a", 5.0), trace("b", 0.0), trace("c", 0.0), trace("c", 20.0)]
    records = [
        record(0, "a", 0.0, 0.5, 1.0),
        record(1, "a", 1.5, 0.2, 0.4),  # first token at 1.7: inside
        record(2, "b", 0.0, 2.0, 3.5),  # first token at 2.0 inside; its last at 3.5 after the window
        record(3, "c", 3.0, 0.5, 0.6, tokens=4000),  # first token at 3.5: outside
        record(4, "c", 5.6, 0.1, 0.2),
    ]
    st = steady_state(records, requests, 10.0, 2)
    assert st.window_s == 30.0  # 3.0 wall s × 10
    assert st.num_requests == 3  # records 0, 1, 2
    assert st.prompt_tokens_per_s == 3000 / 30.0
    assert st.output_tokens_per_s == 20 / 30.0  # records 0 and 1 ended inside (1.0, 1.9)
    # think: first turns wait none; a's second turn 5.0, c's second turn 20.0 -> 25 / 5
    assert st.mean_think_s == 5.0
    assert st.mean_ttft_s == pytest.approx((5 + 2 + 20 + 5 + 1) / 5)
    assert st.mean_decode_s == pytest.approx((5 + 2 + 15 + 1 + 1) / 5)


def test_failed_requests_count_for_the_window_but_not_for_tokens_or_turn_times():
    requests = [trace("a", 0.0), trace("b", 0.0), trace("b", 10.0)]
    records = [record(0, "a", 0.0, 0.1, 0.2), record(1, "b", 1.0, 0.1, 0.2),
               record(2, "b", 2.0, 0.1, 9.0, error="timeout")]  # fmt: skip
    st = steady_state(records, requests, 2.0, 1)
    assert st == SteadyState(window_s=2.0, prompt_tokens_per_s=500.0, output_tokens_per_s=5.0, num_requests=1,
                             mean_think_s=0.0, mean_ttft_s=pytest.approx(0.2), mean_decode_s=pytest.approx(0.2))


def test_no_queue_means_no_window():
    requests = [trace("a", 0.0), trace("b", 0.0)]
    records = [record(0, "a", 0.0, 0.1, 0.2), record(1, "b", 0.01, 0.3, 0.5)]  # two slots, started 10 ms apart
    st = steady_state(records, requests, 4.0, 2)
    assert (st.window_s, st.prompt_tokens_per_s, st.num_requests) == (0.0, 0.0, 0)
    assert st.mean_ttft_s == pytest.approx(0.8) and st.mean_decode_s == pytest.approx(0.6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="time_scale"):
        steady_state([], [], 0.0, 1)
    with pytest.raises(ValueError, match="num_slots"):
        steady_state([], [], 1.0, 0)
    with pytest.raises(ValueError, match="record index 3 outside the 1"):
        steady_state([record(3, "a", 0.0, 0.1, 0.2)], [trace("a", 0.0)], 1.0, 1)
