"""Errors of the prefix index.

::

    PrefixIndexError              base of everything raised by ``router.index``
    ├── IndexConfigError          a bad ``IndexConfig`` value or pool / group setting (also a ``ValueError``)
    └── UnknownWorkerError        an operation named a worker the index has never seen (also a ``KeyError``)

Malformed or unresolvable events never raise: they are skipped and counted in ``PrefixIndex.stats().counters``,
so one bad block never costs the rest of its batch. Refused events (malformed, or of an undeclared cache group)
are logged at warning level the first time per worker, dp rank and counter, at debug level after.
"""

from __future__ import annotations


class PrefixIndexError(Exception):
    """Base of the prefix index's errors."""


class IndexConfigError(PrefixIndexError, ValueError):
    """A configuration value is out of range or inconsistent."""


class UnknownWorkerError(PrefixIndexError, KeyError):
    """The worker is not known to the index.

    Attributes:
        worker_id: the worker that was named.
    """

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id

    def __str__(self) -> str:
        return f"unknown worker {self.worker_id!r}"
