"""A graceful stop's drain: the requests in flight get a grace to finish; a stream still relayed after it ends with
an OpenAI error event and ``data: [DONE]`` (``router.sse.error_event``), never cut mid-body.

Why: aiohttp's graceful stop (``web.BaseRunner.cleanup``: the listener closes, idle keep-alive connections close,
``on_shutdown`` runs, then each connection's handler gets ``shutdown_timeout`` seconds) cancels a handler still
running after that time and closes its connection in the same step (``web_protocol.RequestHandler.shutdown``), so
nothing can be written once the cancellation arrives: a stream still relayed stops mid-body and its client sees a
chunked body without its last chunk (aiohttp's client: ``TransferEncodingError: Not enough data to satisfy
transfer length header``), which it cannot tell from a network failure part way through the answer (found by
``benchmarks.chaos``: a replica restarted while the stream of a long prompt was relayed).

The gateway's ``on_shutdown`` hook (``drain_on_shutdown``; aiohttp runs it once the listener and the idle
connections are closed, before its own wait) runs ``Drain.stop``::

    1. wait until no request is in flight or waiting for admission (``Admission``: a request holds its slot
       until its answer's last byte), at most ``grace_s``
    2. mark the drain ending and cancel each stream still relayed (``router.proxy`` registers the task
       relaying a stream, from its headers to its end: ``enter``/``leave``); the relay takes that cancellation
       back (``take_cancel``: ``Task.uncancel``), writes ``GatewayStoppingError`` (503, ``service_unavailable``)
       as the stream's last event after its last whole event (``end_stream``), and the request is settled as a
       failed one (not the worker's failure: its circuit breaker is not told)
    3. wait at most ``end_timeout_s`` for those streams to end

A stream whose relay starts while the drain is ending is ended at its first wait the same way. A request with no
answer byte sent when the grace is over (a non-streamed answer still read from its worker) is left to aiohttp's
own wait: its connection then closes before any response byte, which clients retry as a connection error (the
``openai`` client does).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from router.admission import Admission
from router.errors import GatewayError
from router.sse import SseFramer, error_event

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often ``Drain.stop`` looks for the in-flight requests to be over (seconds; only while stopping)."""


class GatewayStoppingError(GatewayError):
    """The gateway stopped before the answer's end: the stream's last event (503, ``code: gateway_stopping``)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="gateway_stopping")


class Drain:
    """The streams one gateway relays, and the graceful stop that ends them (module docstring).

    Attributes:
        is_ending: the grace is over: every stream relayed is being ended.
    """

    __slots__ = ("_streams", "_ended", "is_ending")

    def __init__(self) -> None:
        self._streams: set[asyncio.Task[object]] = set()
        self._ended: set[asyncio.Task[object]] = set()
        self.is_ending = False

    @property
    def num_streams(self) -> int:
        """Streams being relayed."""
        return len(self._streams)

    def enter(self, task: asyncio.Task[object]) -> None:
        """``task`` relays a stream from now on (its headers were sent); ended at once when the drain is ending."""
        self._streams.add(task)
        if self.is_ending:
            self._end(task)

    def leave(self, task: asyncio.Task[object]) -> None:
        """``task``'s stream is over (call once per ``enter``, on every path)."""
        self._streams.discard(task)
        self._ended.discard(task)

    def take_cancel(self, task: asyncio.Task[object]) -> bool:
        """Whether the cancellation ``task`` caught is the drain's: then it is taken back (``Task.uncancel``) and
        the stream must be ended (``end_stream``); otherwise (the client left, a deadline) it is to re-raise."""
        if task not in self._ended:
            return False
        self._ended.discard(task)
        task.uncancel()
        return True

    def _end(self, task: asyncio.Task[object]) -> None:
        if task not in self._ended:
            self._ended.add(task)
            task.cancel()

    async def stop(self, admission: Admission, grace_s: float, end_timeout_s: float) -> None:
        """The graceful stop (module docstring): wait at most ``grace_s`` seconds for ``admission``'s requests (in
        flight or waiting), then end the streams still relayed and wait at most ``end_timeout_s`` seconds for
        them."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + grace_s
        while admission.num_inflight + admission.num_waiting > 0 and loop.time() < deadline_s:
            await asyncio.sleep(POLL_S)
        self.is_ending = True
        if not self._streams:
            return
        logger.warning("stopping: %d stream(s) still relayed after the %.1f s grace; ending each with an error "
                       "event", len(self._streams), grace_s)
        for task in list(self._streams):
            self._end(task)
        deadline_s = loop.time() + end_timeout_s
        while self._streams and loop.time() < deadline_s:
            await asyncio.sleep(POLL_S)


async def end_stream(request: web.Request, out: web.StreamResponse, framer: SseFramer | None,
                     error: GatewayError, log: logging.Logger, why: str) -> None:
    """End a relayed stream that cannot go on, and say ``why`` and how on ``log`` (a warning): an event stream
    gets ``error`` as its last event, after its last whole event (an event longer than the framer holds went out
    unfinished: it is ended first), then ``data: [DONE]``; another kind of stream has no event to end it with: its
    client connection is aborted, so it never looks complete.

    Raises:
        ConnectionResetError: the client left meanwhile.
    """
    if framer is None:
        log.warning("%s; not an event stream: aborting the client connection", why)
        out.force_close()
        if request.transport is not None:
            request.transport.abort()
        return
    num_dropped = framer.num_partial_bytes
    log.warning("%s; ended with an error event%s", why,
                f" ({num_dropped} bytes of an unfinished event dropped)" if num_dropped else "")
    await out.write((b"" if framer.is_at_event_end else b"\n\n") + error_event(error))
    await out.write_eof()
