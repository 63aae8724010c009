"""``router.sse``: the event framer and the error event, byte for byte."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from router.errors import UpstreamError
from router.sse import MAX_PARTIAL_EVENT_BYTES, SseFramer, error_event, is_event_stream

EVENTS = (b'data: {"choices":[{"text":"a"}]}\n\n', b": comment\r\n\r\n", b'data: {"choices":[{"text":"b"}]}\r\r',
          b"data: [DONE]\n\n")
"""Events ending with each of the SSE spec's line ends (LF, CRLF, CR)."""
STREAM = b"".join(EVENTS)
EVENT_ENDS = set(itertools.accumulate(len(e) for e in EVENTS))
"""Offsets just past each event's blank line in ``STREAM``."""


def test_every_cut_of_a_stream_is_given_out_whole_events_first() -> None:
    for cuts in itertools.chain(itertools.combinations(range(1, len(STREAM)), 1),
                                itertools.combinations(range(1, len(STREAM), 7), 3)):
        bounds = (0, *cuts, len(STREAM))
        framer = SseFramer()
        given = b""
        for start, end in itertools.pairwise(bounds):
            out = framer.feed(STREAM[start:end])
            given += out
            if out:
                assert len(given) in EVENT_ENDS, (cuts, given)
            # Everything that has ended is given out; only an unfinished event waits.
            assert len(given) == max(e for e in (0, *EVENT_ENDS) if e <= end)
            assert framer.num_partial_bytes == end - len(given)
            assert framer.is_at_event_end
        assert given + framer.rest() == STREAM and framer.num_partial_bytes == 0


def test_a_whole_event_chunk_is_passed_through_untouched() -> None:
    framer = SseFramer()
    chunk = b'data: {"x":1}\n\n'
    assert framer.feed(chunk) is chunk


def test_an_event_longer_than_the_cap_is_given_out_as_it_comes() -> None:
    framer = SseFramer()
    piece = b"data: " + b"x" * (MAX_PARTIAL_EVENT_BYTES // 2 - 6)  # two of them: exactly the cap
    assert framer.feed(piece) == b""
    assert framer.feed(piece) == b""
    assert framer.feed(b"xx") == piece + piece + b"xx"
    assert not framer.is_at_event_end and framer.num_partial_bytes == 0
    assert framer.feed(b"\n\n") == b"\n\n" and framer.is_at_event_end


def test_the_error_event_is_an_openai_error_then_done() -> None:
    raw = error_event(UpstreamError("the worker's answer broke", worker_id="w0"))
    assert raw == (b'data: {"error":{"message":"the worker\'s answer broke","type":"upstream_error","param":null,'
                   b'"code":"upstream_error"}}\n\ndata: [DONE]\n\n')
    first = raw.split(b"\n\n")[0]
    assert msgspec.json.decode(first[6:])["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(("content_type", "expected"), [
    ("text/event-stream", True), ("text/event-stream; charset=utf-8", True), ("Text/Event-Stream", True),
    ("application/json", False), (None, False), ("text/event-streams", False),
])
def test_is_event_stream(content_type: str | None, expected: bool) -> None:
    assert is_event_stream(content_type) is expected
