"""The ``sessions:`` section of the gateway config, and the factory that builds a store from it.

YAML (every key optional; defaults shown)::

    sessions:
      store: memory              # memory | redis
      idle_timeout_s: 1800       # a session idle this long expires
      max_num_sessions: 1000000  # in-memory bound; past it the least recently used session is forgotten
      reap_interval_s: 5         # how often the gateway calls store.reap_expired()
      # redis only:
      url: redis://127.0.0.1:6379/0   # no password here: use url_env / url_file / password_env / password_file
      url_env: ""                # name of an env var holding the whole URL (may carry a password, rediss:// for TLS)
      url_file: ""               # or a file holding it (e.g. a mounted Kubernetes secret)
      password_env: ""           # name of an env var holding the password
      password_file: ""          # or a file holding it
      key_prefix: "kvgate:"
      refresh_fraction: 0.1      # refresh a key's TTL at most once per refresh_fraction * idle_timeout_s
      enable_local_cache: false  # per-replica cache of owners, invalidated by Redis pub/sub
      local_cache_ttl_s: 1.0
      connect_timeout_s: 0.5
      command_timeout_s: 0.5     # a slower answer counts as Redis unavailable (the request uses the fallback)
      reconnect_interval_s: 1.0
      max_connections: 64        # per replica; more concurrent commands queue for one, within command_timeout_s

Secrets (a password, or a URL that carries one) are read when the store is built, kept in a ``RedisTarget`` whose
``repr`` is redacted, and never logged; the config struct itself never holds them (``url`` with a password is
rejected).
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from router.sessions.errors import SessionConfigError

_REDIS_SCHEMES = ("redis", "rediss", "unix")


class SessionsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Session store settings (the ``sessions:`` key). Validated on construction and on decode; every duration
    must be a finite number of seconds (NaN and infinity are refused).

    Field names are snake_case, as in the gateway's documented YAML (``idle_timeout_s``, ``key_prefix``).
    """

    store: Literal["memory", "redis"] = "memory"
    """Where sessions live: this process only, or Redis shared by every gateway replica."""
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1800.0
    """A session not used for this long (seconds) expires and its next request is routed afresh."""
    max_num_sessions: Annotated[int, msgspec.Meta(ge=1)] = 1_000_000
    """Bound on the in-memory table (and the Redis store's fallback); the least recently used goes first."""
    reap_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Period (seconds) of the gateway's background ``reap_expired()`` calls."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL without credentials (``redis://``, ``rediss://`` for TLS, ``unix://``)."""
    url_env: str = ""
    """Name of an environment variable holding the full Redis URL; overrides ``url``. May carry a password."""
    url_file: str = ""
    """Path of a file holding the full Redis URL; overrides ``url``. May carry a password."""
    password_env: str = ""
    """Name of an environment variable holding the Redis password."""
    password_file: str = ""
    """Path of a file holding the Redis password (trailing newline stripped)."""
    key_prefix: str = "kvgate:"
    """Prefix of every Redis key and channel this store uses; replicas sharing sessions use the same one."""
    refresh_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.1
    """A key's TTL is refreshed on use at most once per ``refresh_fraction * idle_timeout_s``."""
    enable_local_cache: bool = False
    """Cache owners per replica for ``local_cache_ttl_s``, invalidated by Redis pub/sub on every change."""
    local_cache_ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Lifetime (seconds) of a local cache entry."""
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    """TCP connect timeout to Redis (seconds)."""
    command_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    """Per-command timeout (seconds); a slower Redis counts as unavailable and the local fallback answers."""
    reconnect_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Period (seconds) of the background reconnect probe while Redis is unavailable."""
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Size of the Redis connection pool per replica (connections). More concurrent commands queue for a free
    connection; the wait counts toward ``command_timeout_s`` (seconds), past which the local fallback answers."""

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "reap_interval_s", "local_cache_ttl_s", "connect_timeout_s",
                     "command_timeout_s", "reconnect_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value):  # msgspec's gt=0 lets infinity through
                raise SessionConfigError(name, f"must be a finite number of seconds, got {value!r}")
            if not value > 0:
                raise SessionConfigError(name, f"must be > 0 seconds, got {value!r}")
        if not 0 < self.refresh_fraction <= 1:
            raise SessionConfigError("refresh_fraction", f"must be in (0, 1], got {self.refresh_fraction!r}")
        if self.max_num_sessions < 1:
            raise SessionConfigError("max_num_sessions", f"must be >= 1, got {self.max_num_sessions!r}")
        if self.max_connections < 1:
            raise SessionConfigError("max_connections", f"must be >= 1, got {self.max_connections!r}")
        if not self.key_prefix:
            raise SessionConfigError("key_prefix", "must not be empty")
        if self.url_env and self.url_file:
            raise SessionConfigError("url_env", "set url_env or url_file, not both")
        if self.password_env and self.password_file:
            raise SessionConfigError("password_env", "set password_env or password_file, not both")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in _REDIS_SCHEMES:
            raise SessionConfigError("url", f"scheme must be one of {', '.join(_REDIS_SCHEMES)}")
        if parsed.password is not None:
            raise SessionConfigError(
                "url", "must not carry a password; put it in password_env / password_file (or the whole URL in "
                "url_env / url_file)")


class RedisTarget:
    """Where to connect, with its secrets. ``repr``/``str`` show only the redacted endpoint.

    Attributes:
        url: the full URL, possibly with credentials. Never log it.
        password: the password from ``password_env``/``password_file``, or ``None``. Never log it.
        endpoint: ``scheme://host:port/db`` without credentials, for logs and errors.
    """

    __slots__ = ("url", "password", "endpoint")

    def __init__(self, url: str, password: str | None) -> None:
        self.url = url
        self.password = password
        self.endpoint = redact_url(url)

    def __repr__(self) -> str:
        return f"RedisTarget(endpoint={self.endpoint!r})"

    __str__ = __repr__


def redact_url(url: str) -> str:
    """``url`` without user, password or query (``rediss://host:6380/0``); ``"<invalid url>"`` if unparsable."""
    try:
        parsed = urllib.parse.urlsplit(url)
        host = parsed.hostname or ""
        port = f":{parsed.port}" if parsed.port is not None else ""
    except ValueError:
        return "<invalid url>"
    return f"{parsed.scheme}://{host}{port}{parsed.path}"


def _read_secret(key: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        # The path is config, not a secret; the content is never put in the message.
        raise SessionConfigError(key, f"cannot read {path!r}: {exc.strerror or type(exc).__name__}") from None


def _read_env(key: str, name: str, environ: Mapping[str, str]) -> str:
    value = environ.get(name)
    if not value:
        raise SessionConfigError(key, f"environment variable {name!r} is not set or empty")
    return value


def resolve_redis_target(config: SessionsConfig, environ: Mapping[str, str] | None = None) -> RedisTarget:
    """Read the Redis URL and password from the config, the environment or files.

    Args:
        config: the sessions config.
        environ: environment to read (``os.environ`` when ``None``).

    Returns:
        The target; its ``repr`` is redacted.

    Raises:
        SessionConfigError: an env var is unset, a file unreadable, or the resolved URL has a bad scheme.
    """
    env = os.environ if environ is None else environ
    url = config.url
    if config.url_env:
        url = _read_env("url_env", config.url_env, env)
    elif config.url_file:
        url = _read_secret("url_file", config.url_file)
    if urllib.parse.urlsplit(url).scheme not in _REDIS_SCHEMES:
        # Do not echo the URL: it may carry a password.
        raise SessionConfigError("url", f"the resolved URL's scheme must be one of {', '.join(_REDIS_SCHEMES)}")
    password: str | None = None
    if config.password_env:
        password = _read_env("password_env", config.password_env, env)
    elif config.password_file:
        password = _read_secret("password_file", config.password_file)
    return RedisTarget(url, password)
