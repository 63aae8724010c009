"""Admission control: global and per-worker limits on in-flight requests, a bounded wait queue, a timeout.

The gateway never accepts work the fleet cannot start: a request is admitted when the global in-flight count is
under ``max_inflight_requests`` and at least one of its candidate workers is under ``max_inflight_per_worker``.
Otherwise it waits (wake-ups on every release, and a re-check every ``RECHECK_S`` for room that appears without
one, such as a worker undrained) in a queue of at most ``queue_size`` requests for at most ``queue_timeout_s``; a
full queue or an expired wait raises ``OverloadedError`` (429 with ``Retry-After``). The caller's
``worker_has_room`` answers True when no candidate is usable at all, so such a request never waits: routing
answers it 503 at once.
With both limits 0 the check is a no-op on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from router.config import AdmissionConfig
from router.errors import OverloadedError

logger = logging.getLogger(__name__)

RECHECK_S = 0.25
"""A waiting request re-checks for room at least this often (seconds)."""


class Admission:
    """In-flight counter with a bounded, timed wait queue."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.num_inflight = 0
        self.num_waiting = 0
        self.num_rejected = 0
        self._cond = asyncio.Condition()
        self._notify_tasks: set[asyncio.Task[None]] = set()
        self.is_enabled = config.max_inflight_requests > 0 or config.max_inflight_per_worker > 0

    def _has_room(self, worker_has_room: Callable[[], bool]) -> bool:
        limit = self.config.max_inflight_requests
        return (limit == 0 or self.num_inflight < limit) and worker_has_room()

    def try_acquire(self) -> bool:
        """Take a slot at once when admission is off (no limits); ``False`` means call ``acquire``."""
        if self.is_enabled:
            return False
        self.num_inflight += 1
        return True

    async def acquire(self, worker_has_room: Callable[[], bool]) -> None:
        """Take a slot, waiting if needed.

        Args:
            worker_has_room: True when some candidate worker is under the per-worker limit.

        Raises:
            OverloadedError: the queue is full or the wait timed out.
        """
        if not self.is_enabled or self._has_room(worker_has_room):
            self.num_inflight += 1
            return
        cfg = self.config
        if self.num_waiting >= cfg.queue_size:
            self.num_rejected += 1
            raise OverloadedError("the gateway is at capacity and its queue is full", retry_after_s=cfg.retry_after_s)
        self.num_waiting += 1
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + cfg.queue_timeout_s
        try:
            async with self._cond:
                # Woken on every release; re-checked every RECHECK_S as well, for room that appears without one
                # (a worker undrained, added or healthy again).
                while not self._has_room(worker_has_room):
                    remaining_s = deadline_s - loop.time()
                    if remaining_s <= 0.0:
                        raise TimeoutError
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(remaining_s, RECHECK_S)):
                            await self._cond.wait()
        except TimeoutError as exc:
            self.num_rejected += 1
            raise OverloadedError(
                f"no capacity within {cfg.queue_timeout_s} s", retry_after_s=cfg.retry_after_s
            ) from exc
        finally:
            self.num_waiting -= 1
        self.num_inflight += 1

    def release(self) -> None:
        """Give a slot back and wake the waiters (call exactly once per successful ``acquire``)."""
        self.num_inflight -= 1
        if self.num_waiting:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notify_tasks.add(task)
            task.add_done_callback(self._notify_tasks.discard)

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
