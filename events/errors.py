"""Exceptions raised by the KV event pipeline.

One tree for the package; third-party errors (pyzmq, msgspec) are translated at the boundary with
``raise X(...) from exc``::

    EventsError
    ├── EventsConfigError          bad configuration value (also a ValueError)
    ├── EventDecodeError           a payload or frame that cannot be turned into events
    │                              (carries ``kind``, a ``DropKind``; the subscriber counts it, never raises it)
    └── PublisherError             a publisher call that cannot be served
        └── PublisherClosedError   ``publish()`` after ``close()``

Malformed input from the network is never raised past the subscriber: it is counted by kind in
``events.counters.EventCounters`` and logged once per worker and kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from events.counters import DropKind


class EventsError(Exception):
    """Base class of every error raised by ``events/``.

    Attributes:
        worker_id: the worker concerned, when known.
        endpoint: the ZMQ endpoint concerned, when known.
    """

    def __init__(self, message: str, *, worker_id: str | None = None, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.endpoint = endpoint


class EventsConfigError(EventsError, ValueError):
    """A configuration value the pipeline cannot use (bad endpoint, bad rank, duplicate worker)."""


class EventDecodeError(EventsError):
    """A frame or payload that cannot be decoded into normalized events.

    Attributes:
        kind: the drop kind the subscriber counts it under.
    """

    def __init__(
        self, message: str, kind: DropKind, *, worker_id: str | None = None, endpoint: str | None = None
    ) -> None:
        super().__init__(message, worker_id=worker_id, endpoint=endpoint)
        self.kind = kind


class PublisherError(EventsError):
    """A publisher operation that cannot be served."""


class PublisherClosedError(PublisherError):
    """``publish()`` was called after ``close()``."""
