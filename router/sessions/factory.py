"""``build_session_store``: the configured session store (memory or Redis), built from ``SessionsConfig``.

Kept apart from ``router.sessions.config`` so that the config imports no store and the Redis store can import the
config without a cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from router.sessions.base import SessionStore
from router.sessions.config import SessionsConfig, resolve_redis_target
from router.sessions.memory import MemorySessionStore
from router.sessions.redis_store import RedisSessionStore


def build_session_store(
    config: SessionsConfig,
    clock: Callable[[], float] = time.monotonic,
    environ: Mapping[str, str] | None = None,
) -> SessionStore:
    """Build the configured store. Opens nothing: the gateway then awaits ``store.start()``.

    Args:
        config: the sessions config.
        clock: monotonic clock in seconds (injected in tests); drives idle expiry of local state.
        environ: environment for ``url_env``/``password_env`` (``os.environ`` when ``None``).

    Raises:
        SessionConfigError: the Redis secrets cannot be resolved.
    """
    if config.store == "memory":
        return MemorySessionStore(config.idle_timeout_s, clock=clock, max_num_sessions=config.max_num_sessions)
    return RedisSessionStore(config, resolve_redis_target(config, environ), clock=clock)
