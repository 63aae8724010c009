"""Errors of the load generator, one tree.

::

    LoadgenError                 base of everything loadgen raises on purpose
    ├── TraceError               a trace file is missing, unreadable or malformed (names the path and line)
    ├── PromptError              no prompt text of the exact token count can be built for a tokenizer
    ├── ReplayError              a replay cannot start (bad URL, nothing to replay)
    └── FleetError               the demo could not start or reach its workers and gateway

Per-request failures during a replay (connection refused, HTTP status, broken stream, timeout) are not raised:
they are recorded on the request's record by kind and counted in the report.
"""

from __future__ import annotations


class LoadgenError(Exception):
    """Base class of loadgen errors."""


class TraceError(LoadgenError):
    """A trace file is missing, unreadable or malformed.

    Attributes:
        path: the file.
        line_number: 1-based line (JSONL) where the problem is, or ``None``.
    """

    def __init__(self, message: str, *, path: str, line_number: int | None = None) -> None:
        where = f"{path}:{line_number}" if line_number is not None else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line_number = line_number


class PromptError(LoadgenError):
    """Prompt text with the exact token count cannot be built for the tokenizer."""


class ReplayError(LoadgenError):
    """A replay cannot start."""


class FleetError(LoadgenError):
    """The demo fleet (workers, gateway) could not be started or reached.

    Attributes:
        name: the process (``"worker-0"``, ``"gateway"``).
    """

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
