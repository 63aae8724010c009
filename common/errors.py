"""Errors of the code the gateway and the worker share (``common``).

::

    CommonError
    ├── ListenError              an HTTP address that cannot be resolved or bound (names the address and the
    │                            setting to change); also a ``ValueError``
    ├── TokenizerLoadError       tokenizer or chat template files missing or invalid
    └── InvalidRequestError      a chat or prompt the tokenizer refuses (HTTP 400, OpenAI error JSON); also a
                                 ``ValueError``

Each process translates them at its own boundary: the gateway's ``router.errors.ConfigError`` and OpenAI-style
400s, the worker's exit status 2 and 400s (``workers.errors.ContextLengthError`` is an ``InvalidRequestError``).
"""

from __future__ import annotations


class CommonError(Exception):
    """Base of every error raised by ``common``."""


class ListenError(CommonError, ValueError):
    """A listening address that cannot be resolved or bound; the message names it and what to change."""


class TokenizerLoadError(CommonError):
    """The tokenizer or chat template could not be loaded."""


class InvalidRequestError(CommonError, ValueError):
    """A request refused; becomes an OpenAI-style 400.

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
