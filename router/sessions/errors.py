"""Errors of the session stores.

::

    SessionError
    ├── SessionConfigError (also ValueError)   bad ``sessions:`` config, or an unreadable secret file / env var
    └── SessionBackendError                    the shared store (Redis) failed a call; ``endpoint`` is redacted

``SessionBackendError`` never reaches the gateway: the Redis store catches it and answers from its local fallback.
It exists so that redis-py's exceptions are translated once, at the boundary (``redis_store.py``).
"""

from __future__ import annotations


class SessionError(Exception):
    """Base of every session store error."""


class SessionConfigError(SessionError, ValueError):
    """The ``sessions:`` config is invalid, or its secret cannot be read.

    Attributes:
        key: the config key at fault (``"url"``, ``"password_file"``...).
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"sessions.{key}: {reason}")
        self.key = key
        self.reason = reason


class SessionBackendError(SessionError):
    """A call to the shared store failed (connection refused, timeout, reset, script error).

    Attributes:
        endpoint: ``host:port/db`` of the store, without credentials.
    """

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"session store at {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason
