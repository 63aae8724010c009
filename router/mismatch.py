"""The honesty check's count: a cached-token mismatch counted under its cause, confirmed first where it may be.

``IndexTicket.mismatch_cause`` names the cause from the index's journals. A cause of ``"index"`` (a wrong index)
with a pool watcher is counted only once the watcher has asked the master about the blocks not served
(``PoolWatcher.confirm_gone``), in a task off the answer's path. Both the aggregated flight
(``router.lifecycle``) and the disaggregated one's prefill leg (``router.pd``) count through ``MismatchCounter``.
"""

from __future__ import annotations

import asyncio

from router.metrics import GatewayMetrics
from router.pool_watch import PoolWatcher
from router.routing import IndexTicket, Router

NUM_CAUSE_REREADS = 12
"""Times a mismatch still unexplained once the pool watcher answered is read again, ``CAUSE_REREAD_S`` apart (about
a quarter second in all, off the answer's path): a worker's answer can reach the gateway before the KV events it
published before it (another socket; the event path applies batches in slices), and those events (a pending entry
confirmed, a pool block put back: ``router.index.pool_restores``) are what explain the miss."""
CAUSE_REREAD_S = 0.02
"""Seconds between two readings of ``NUM_CAUSE_REREADS``."""


class MismatchCounter:
    """Counts the mismatches of one gateway's flights (module docstring); holds the confirmations in progress."""

    __slots__ = ("router", "metrics", "_confirming")

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        self.router = router
        self.metrics = metrics
        self._confirming: set[asyncio.Task[None]] = set()

    def count(self, worker_id: str, ticket: IndexTicket, predicted: int, reported: int) -> bool:
        """Count a cached-token mismatch under its cause (``IndexTicket.mismatch_cause``). A cause of ``"index"``
        with a pool watcher is counted once the watcher has asked the master about the blocks not served
        (``PoolWatcher.confirm_gone``, in a task, off the answer's path): when the master evicted some, they leave
        the index and the mismatch counts as ``"evicted"``; else the cause is read again then, and a few times more
        while it stays ``"index"`` (``NUM_CAUSE_REREADS``), from the events that came meanwhile (a worker's put of
        the missed blocks back to the pool: ``router.index.pool_restores``). Returns whether that task holds the
        ticket's journal stamp open (the caller then settles with ``keep_window=True``; the task closes it)."""
        cause = ticket.mismatch_cause(worker_id, predicted, reported)
        watcher = self.router.pool_watcher
        if cause != "index" or watcher is None:
            self.metrics.worker(worker_id).num_mismatches[cause] += 1
            return False
        task = asyncio.get_running_loop().create_task(self._confirm(watcher, worker_id, ticket, predicted, reported))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)
        return True

    async def _confirm(
        self, watcher: PoolWatcher, worker_id: str, ticket: IndexTicket, predicted: int, reported: int
    ) -> None:
        cause = "index"
        try:
            if await watcher.confirm_gone(*ticket.missed_blocks(predicted, reported)):
                cause = "evicted"
            else:
                cause = ticket.mismatch_cause(worker_id, predicted, reported)
                for _ in range(NUM_CAUSE_REREADS):
                    if cause != "index":
                        break
                    await asyncio.sleep(CAUSE_REREAD_S)
                    cause = ticket.mismatch_cause(worker_id, predicted, reported)
        finally:
            ticket.close_window()
            self.metrics.worker(worker_id).num_mismatches[cause] += 1
