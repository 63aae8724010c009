"""``benchmarks.routing.cut_to_context``: the turns over the workers' context are left out before the replay."""

import pytest

from benchmarks.routing import cut_to_context
from loadgen.traces import TraceRequest

pytestmark = pytest.mark.unit


def _turn(session: str, num_prompt_tokens: int, num_output_tokens: int = 100) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                        hash_ids=(1,), block_size=16, session_id=session)


def test_turns_over_the_context_are_left_out_and_counted():
    a0, a1, a2, a3 = _turn("a", 100), _turn("a", 1008), _turn("a", 1009), _turn("a", 200)
    b0 = _turn("b", 5000)
    c0, c1 = _turn("c", 1023, num_output_tokens=0), _turn("c", 1024, num_output_tokens=0)
    cut = cut_to_context([a0, b0, a1, c0, a2, c1, a3], max_model_len=1024, max_output_tokens=16)
    # a1: 1008 + 16 = 1024 fits exactly; a2 one over; c0: no output recorded, max_tokens 1; a3 fits after a2
    assert cut.kept == [a0, a1, c0, a3]
    assert (cut.num_turns_left_out, cut.num_sessions_cut, cut.num_sessions_left_out) == (3, 3, 1)


def test_without_a_cap_the_recorded_output_counts():
    short, long = _turn("a", 900, num_output_tokens=124), _turn("a", 900, num_output_tokens=125)
    cut = cut_to_context([short, long], max_model_len=1024, max_output_tokens=None)
    assert cut.kept == [short]
    assert (cut.num_turns_left_out, cut.num_sessions_cut, cut.num_sessions_left_out) == (1, 1, 0)
