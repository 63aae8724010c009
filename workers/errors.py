"""Errors of the reference worker.

::

    WorkerError
    ├── ConfigError              bad profile / CLI values (names the bad key)
    ├── TokenizerLoadError       tokenizer or chat template files missing or invalid
    ├── InvalidRequestError      a client request the worker refuses (HTTP 400, OpenAI error JSON)
    │   └── ContextLengthError   prompt (+ max_tokens) over the context limit
    └── KVCacheError             a broken KV manager invariant (a bug, never client input)
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error raised by ``workers``."""


class ConfigError(WorkerError, ValueError):
    """Invalid worker configuration."""


class TokenizerLoadError(WorkerError):
    """The tokenizer or chat template could not be loaded."""


class InvalidRequestError(WorkerError, ValueError):
    """A request the worker refuses; becomes an OpenAI-style 400.

    Attributes:
        param: the offending request field, or ``None``.
        code: OpenAI error code, or ``None``.
        request_id: the worker's request id when one was assigned.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.request_id: str | None = None


class ContextLengthError(InvalidRequestError):
    """Prompt tokens (plus ``max_tokens``) exceed ``max_model_len``."""


class KVCacheError(WorkerError, RuntimeError):
    """A KV manager invariant was broken (ref counts, pool sizes)."""
