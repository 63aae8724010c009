"""The server-sent events of an OpenAI stream as the gateway relays them: the usage in the stream's tail, the cut
of a byte stream at event ends, and the error event that ends a stream its worker broke after its headers.

A stream is relayed byte for byte, but at event ends (``SseFramer``): a chunk that ends inside an event is written
up to its last complete event and the rest waits for the next chunk. vLLM, SGLang and the reference worker write
one whole event per chunk, so the common chunk is written at once, untouched; only a chunk the network cut inside
an event waits. The client therefore never holds half an event, and a stream that breaks can still end with a
well-formed event.

A broken stream ends as vLLM's OpenAI server ends a stream that fails while generating (vllm-project/vllm,
``vllm/entrypoints/openai/chat_completion/serving.py`` ``chat_completion_stream_generator`` and
``completion/serving.py`` ``completion_stream_generator``: on an exception, ``data: <create_streaming_error_response
(e)>`` then ``data: [DONE]``; ``vllm/entrypoints/openai/engine/serving.py`` ``create_streaming_error_response``
dumps ``ErrorResponse(error=ErrorInfo(message, type, param, code))``)::

    data: {"error": {"message": "...", "type": "upstream_error", "param": null, "code": "upstream_error"}}

    data: [DONE]

The official ``openai`` client raises ``openai.APIError`` (its message the event's ``message``) on such an event
(``openai/_streaming.py``: a ``data`` object with an ``error`` key), so a client never takes a cut stream for a
finished one. The shape is the gateway's usual error body (``router.errors``), written as one SSE event.
"""

from __future__ import annotations

import msgspec

from router.errors import GatewayError

SSE_TAIL_BYTES = 16384
"""How much of a stream's end is kept to find the final usage event."""

MAX_PARTIAL_EVENT_BYTES = 1 << 20
"""An event longer than this (1 MiB) is relayed as it comes, not held until its end (``SseFramer``)."""

DONE_EVENT = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""

_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
"""A blank line after a line (the SSE spec's three line ends: LF, CRLF, CR)."""


class _PromptTokensDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class Usage(msgspec.Struct, gc=False):
    """The ``usage`` object of an OpenAI answer (the fields the gateway reads)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptTokensDetails | None = None


class _WithUsage(msgspec.Struct, gc=False):
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def usage_from_body(body: bytes) -> Usage | None:
    """The ``usage`` of a non-streamed completion body, or ``None``."""
    try:
        return _usage_decoder.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def usage_from_sse_tail(tail: bytes) -> Usage | None:
    """The ``usage`` of the last SSE ``data:`` event in ``tail`` that has one, or ``None``.

    Found from the end by the ``"usage"`` key: each line holding it is decoded if it is a ``data:`` line (an SSE
    event's JSON has no raw newline, so the line is the event); a line cut by the start of ``tail``, one whose
    ``usage`` is null, or one that does not decode is passed over for the one before.
    """
    pos = tail.rfind(b'"usage"')
    while pos >= 0:
        line_start = tail.rfind(b"\n", 0, pos) + 1
        if tail.startswith(b"data:", line_start):
            line_end = tail.find(b"\n", pos)
            usage = usage_from_body(tail[line_start + 5 : line_end if line_end >= 0 else len(tail)])
            if usage is not None:
                return usage
        pos = tail.rfind(b'"usage"', 0, line_start)
    return None


def cached_tokens_of(usage: Usage | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (0 when usage has no details), ``None`` without usage."""
    if usage is None:
        return None
    details = usage.prompt_tokens_details
    return details.cached_tokens or 0 if details is not None else 0


def is_event_stream(content_type: str | None) -> bool:
    """The ``Content-Type`` is ``text/event-stream`` (parameters and case aside)."""
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "text/event-stream"


def _last_event_end(data: bytes) -> int:
    """The offset just past the last blank line in ``data`` (an event's end), or -1."""
    return max((i + len(end) if (i := data.rfind(end)) >= 0 else -1) for end in _EVENT_ENDS)


class SseFramer:
    """Cuts a byte stream at SSE event ends: ``feed`` gives what may be written now (whole events), ``rest`` what
    is left of an unfinished event.

    Invariants: the bytes given out, then ``rest()``, are the bytes fed, in order; a piece given out ends at an
    event end, unless the unfinished event grew past ``MAX_PARTIAL_EVENT_BYTES`` (then it is given out as it
    comes and ``is_at_event_end`` is False until an event ends again). Each chunk is scanned once (plus up to 3
    bytes before it, for an event end split across chunks).

    Attributes:
        is_at_event_end: everything given out so far ends at an event end (another event may follow it).
    """

    __slots__ = ("_parts", "_num_partial_bytes", "is_at_event_end")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._num_partial_bytes = 0
        self.is_at_event_end = True

    @property
    def num_partial_bytes(self) -> int:
        """Bytes of the unfinished event held back."""
        return self._num_partial_bytes

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` (after those held back) that end at its last event end; ``b""`` when no event
        ends in it."""
        parts = self._parts
        if not parts:
            if chunk.endswith(b"\n\n") or chunk.endswith(b"\r\n\r\n"):  # one or more whole events: the usual chunk
                self.is_at_event_end = True
                return chunk
            offset = 0
            probe = chunk
        else:
            before = parts[-1][-3:]
            offset = len(before)
            probe = before + chunk
        end = _last_event_end(probe) - offset
        if end > 0:
            head = chunk[:end]
            out = b"".join((*parts, head)) if parts else head
            self._parts = [chunk[end:]] if end < len(chunk) else []
            self._num_partial_bytes = len(chunk) - end
            self.is_at_event_end = True
            return out
        parts.append(chunk)
        self._num_partial_bytes += len(chunk)
        if self._num_partial_bytes > MAX_PARTIAL_EVENT_BYTES:  # not an event stream we can frame: pass it on
            self.is_at_event_end = False
            return self._take()
        return b""

    def rest(self) -> bytes:
        """What is held back (an unfinished event), handed over and forgotten (at the stream's end)."""
        return self._take()

    def _take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts = []
        self._num_partial_bytes = 0
        return out


def error_event(error: GatewayError) -> bytes:
    """The SSE bytes that end a broken stream: ``error`` as an OpenAI error event, then ``data: [DONE]``."""
    body = msgspec.json.encode({"error": {"message": error.message, "type": error.error_type, "param": error.param,
                                          "code": error.code}})
    return b"data: " + body + b"\n\n" + DONE_EVENT
