"""Errors of the reference worker.

::

    WorkerError
    ├── ConfigError              bad profile / CLI values (names the bad key)
    ├── ContextLengthError       prompt (+ max_tokens) over the context limit (HTTP 400); also a
    │                            ``common.errors.InvalidRequestError``
    └── KVCacheError             a broken KV manager invariant (a bug, never client input)

The worker also raises the shared errors of ``common.errors`` (the tokenizer's and the listen helpers'):
``InvalidRequestError`` (HTTP 400, OpenAI error JSON), ``TokenizerLoadError`` and ``ListenError`` (exit status 2).
"""

from __future__ import annotations

from common.errors import InvalidRequestError


class WorkerError(Exception):
    """Base of every error raised by ``workers``."""


class ConfigError(WorkerError, ValueError):
    """Invalid worker configuration."""


class ContextLengthError(WorkerError, InvalidRequestError):
    """Prompt tokens (plus ``max_tokens``) exceed ``max_model_len``."""


class KVCacheError(WorkerError, RuntimeError):
    """A KV manager invariant was broken (ref counts, pool sizes)."""
