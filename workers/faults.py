"""Faults the reference worker can inject on demand, for chaos and soak runs (``POST /debug/faults``).

The routes exist only with ``enable-fault-injection: true`` in the worker's profile (off by default)::

    GET  /debug/faults     the faults in force (``Faults`` as JSON)
    POST /debug/faults     replace them; the body is a ``Faults`` object (absent fields: no fault)

Faults:

* ``delay_s``: every new request waits this long (wall seconds) before it reaches the scheduler (a slow worker).
* ``fail_after_headers``: every new request is answered ``200`` with its headers (and, for a stream, one SSE
  comment line, so the headers surely leave), then the connection is aborted: the client sees a truncated body.
* ``drop_events``: KV event batches keep their seq and stay in the replay buffer but are not sent on the PUB
  socket, as when ZMQ's send queue is full (``events.publisher.KVEventPublisher.set_faults``): a subscriber sees
  a gap at the next batch sent.
* ``refuse_replay``: the replay endpoint reads requests and never answers them.
"""

from __future__ import annotations

import logging
from typing import Annotated

import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)


class Faults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The faults in force on one worker (module docstring); the defaults inject none."""

    delay_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0
    """Wall seconds each new request waits before it is scheduled."""
    fail_after_headers: bool = False
    """Abort each new request's connection after its response headers."""
    drop_events: bool = False
    """Number KV event batches and keep them for replay, but do not send them."""
    refuse_replay: bool = False
    """Leave replay requests unanswered."""


async def fail_after_headers(http_request: web.Request, is_stream: bool) -> web.StreamResponse:
    """Answer ``200`` with headers (and, for a stream, ``": fault\\n\\n"``), then abort the connection.

    Returns:
        The prepared response (aiohttp finds its transport closed and sends nothing more).
    """
    if is_stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(http_request)
        await resp.write(b": fault\n\n")
    else:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1024
        await resp.prepare(http_request)
        await resp.write(b"{")
    transport = http_request.transport
    if transport is not None:
        transport.abort()
    logger.info("fault injection: aborted %s after its headers", http_request.path)
    return resp
