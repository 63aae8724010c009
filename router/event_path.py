"""The event path: a KV event from a worker's publisher to the gateway's prefix index, in one place.

Module by module, a live batch::

    worker PUB ──ZMQ [topic, seq, msgpack]──► events.subscriber.KVEventSubscriber   (one per gateway)
        decodes (events.decode), sequences per (worker, dp rank), replays gaps, emits EventBatch | Resync
    ──sink──► EventPath.on_event                                                    (this module)
        one dict lookup: worker id -> (runtime, its model's PrefixIndex, its SnapshotSplice)
    ──► router.index.recovery.SnapshotSplice.admit                                  (pure)
        held while the worker's snapshot is fetched, dropped when the snapshot has it, else passed on
    ──► router.index.PrefixIndex.apply                                              (router.index.ingest)

a ``Resync`` (publisher restart, unclosable gap, new start id)::

    subscriber ──► EventPath.on_event ──► PrefixIndex.apply_resync (the worker's own tiers cleared)
        ──► the worker turns cold (routed on approximate entries) ──► warm-up begins again (below)

a warm-up (worker added, resync, admin ``POST /admin/index/clear``)::

    EventPath._begin_warmup ──► SnapshotSplice.begin (live batches held) ──► task: GET <url><snapshot_path>
        (router.transport, the worker's pool) ──► events.decode.EventDecoder (a vLLM wire batch)
        ──► PrefixIndex.apply ──► SnapshotSplice.on_snapshot(x-kvgate-last-seq): held batches after it applied
        ──► the worker turns warm; a hole after the snapshot fetches it again; no snapshot (vLLM and SGLang
        serve none, 404): the held batches are applied and the first batch makes the worker warm

and a restart seen on the load endpoint (``router.fleet.Fleet.poll_load_once``, a new ``start_id``) goes to
``EventPath.on_start_id_changed`` ──► ``KVEventSubscriber.notify_start_id``, which resyncs the worker unless replay
shows the stream is the same.

Subscriptions: a worker with events gets one ``WorkerSpec`` per dp rank; rank ``r`` publishes on the configured
endpoint offset by ``r`` (``events.publisher.offset_endpoint``, vLLM's rule). The subscriber is created and
started by the app's start-up (``router.gateway``), so the workers of the config are added after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextlib import suppress

from events.counters import DropKind, EventCounters
from events.decode import EventDecoder
from events.publisher import offset_endpoint
from events.subscriber import KVEventSubscriber, WorkerSpec
from events.types import EventBatch, Medium, Resync, normalize_medium
from router.config import GatewayConfig
from router.errors import GatewayError
from router.fleet import WorkerRuntime
from router.index import PrefixIndex, UnknownWorkerError
from router.index.recovery import SnapshotSplice
from router.pool_media import to_pool_medium
from router.transport import Transport

logger = logging.getLogger(__name__)

SNAPSHOT_FETCH_ATTEMPTS = 50
"""Tries to reach a worker's snapshot endpoint (``SNAPSHOT_RETRY_S`` apart) before warming from events only."""
SNAPSHOT_RETRY_S = 0.2


def pool_media_of(worker: WorkerRuntime) -> frozenset[Medium]:
    """The media the worker's engine publishes its pool stores under (``WorkerConfig.pool_event_media``)."""
    media = (normalize_medium(name) for name in worker.config.pool_event_media)
    return frozenset(m for m in media if m is not None)


class _Tracked:
    """What the event path keeps per worker."""

    __slots__ = ("worker", "index", "splice", "warmup", "event_lag_s", "pool_media")

    def __init__(self, worker: WorkerRuntime, index: PrefixIndex, splice: SnapshotSplice) -> None:
        self.worker = worker
        self.index = index
        self.splice = splice
        self.warmup: asyncio.Task[None] | None = None
        self.event_lag_s: float | None = None
        """Receipt wall time minus the publisher's time of the worker's last batch, seconds (None before one)."""
        self.pool_media = pool_media_of(worker)


class EventPath:
    """Subscriber -> splice -> index for every worker of the fleet (module docstring).

    Only the event loop thread touches it. ``add_worker``/``remove_worker`` keep the worker id -> index dict.
    """

    def __init__(self, config: GatewayConfig, indexes: Mapping[str, PrefixIndex], transport: Transport) -> None:
        """Args:
            config: the gateway config (``events``, with ``snapshot_timeout_s`` for snapshot fetches; the models).
            indexes: one prefix index per ``models[].name``.
            transport: the upstream transport (snapshot fetches).
        """
        self._config = config
        self._indexes = indexes
        self._transport = transport
        self._tracked: dict[str, _Tracked] = {}
        self.subscriber: KVEventSubscriber | None = None

    # -- the subscriber ----------------------------------------------------------------------------------------

    async def start_subscriber(self) -> None:
        """Create and start the KV event subscriber (binds ``events.bind_endpoint`` when set).

        Raises:
            EventsConfigError: the bind endpoint cannot be bound (the subscriber is closed again).
        """
        subscriber = KVEventSubscriber(self._config.events.subscriber_config(), self.on_event)
        try:
            await subscriber.start()
        except BaseException:
            await subscriber.aclose()
            raise
        self.subscriber = subscriber

    async def close_subscriber(self) -> None:
        """Close the subscriber's sockets (idempotent)."""
        if self.subscriber is not None:
            await self.subscriber.aclose()

    def on_event(self, item: EventBatch | Resync) -> None:
        """The subscriber's sink: a batch through the worker's splice into its index; a resync clears and
        re-warms the worker. Items of a worker not (or no longer) in the fleet are ignored."""
        tracked = self._tracked.get(item.worker_id)
        if tracked is None:
            return
        if isinstance(item, Resync):
            logger.warning("worker %s resync (%s): index cleared, rebuilding", item.worker_id, item.reason)
            tracked.index.apply_resync(item)
            self._rewarm(tracked)
            return
        tracked.event_lag_s = time.time() - item.ts_s
        if tracked.pool_media:
            item = to_pool_medium(item, tracked.pool_media)
        step = tracked.splice.admit(item)
        if step.fetch == "cancel":
            self._cancel_warmup(tracked)
        elif step.fetch == "restart":
            self._start_warmup_task(tracked)
        for batch in step.batches:
            tracked.index.apply(batch)
        if step.makes_warm:
            tracked.worker.mark_warm()

    def on_start_id_changed(self, worker: WorkerRuntime, start_id: str | int) -> None:
        """A new start id on the worker's load endpoint: the subscriber checks whether its publisher restarted."""
        if self.subscriber is not None and worker.config.has_events:
            self.subscriber.notify_start_id(worker.worker_id, start_id)

    # -- workers -----------------------------------------------------------------------------------------------

    def event_lag_s(self, worker_id: str) -> float | None:
        """Receipt wall time minus the publisher's time (``ts``) of the worker's last event batch, seconds;
        ``None`` before its first batch or for a worker not in the fleet. Includes any clock offset between the
        two hosts."""
        tracked = self._tracked.get(worker_id)
        return tracked.event_lag_s if tracked is not None else None

    def index_of(self, worker_id: str) -> PrefixIndex | None:
        """The prefix index of the worker's model, or ``None`` for a worker not in the fleet."""
        tracked = self._tracked.get(worker_id)
        return tracked.index if tracked is not None else None

    def add_worker(self, worker: WorkerRuntime) -> None:
        """Track a registered worker: subscribe each of its dp ranks, then begin its warm-up (events workers).

        Raises:
            EventsConfigError: an events endpoint ZMQ refuses (e.g. ``tcp://host:x``).
            Exception: anything else the subscription raises (ZMQ out of sockets); the caller undoes the add
                with ``remove_worker``.
        """
        cfg = worker.config
        model = self._config.model(cfg.model)
        if model is None:
            raise RuntimeError(f"worker {cfg.id!r} of unknown model {cfg.model!r} reached the event path")
        splices = (self._config.events.warmup_from_snapshot and cfg.snapshot_path is not None and cfg.dp_ranks == 1)
        tracked = _Tracked(worker, self._indexes[model.name], SnapshotSplice(cfg.id, splices=splices))
        self._tracked[cfg.id] = tracked
        if self.subscriber is not None and cfg.has_events:
            for i, rank in enumerate(cfg.dp_rank_range):
                endpoint = cfg.events_endpoint if cfg.topology == "connect" else None
                self.subscriber.add_worker(WorkerSpec(
                    worker_id=cfg.id, endpoint=offset_endpoint(endpoint, i),
                    replay_endpoint=offset_endpoint(cfg.replay_endpoint, i), dp_rank=rank,
                    block_size=worker.block_size,
                ))
        if cfg.has_events:
            self._begin_warmup(tracked)

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its warm-up stops, its subscription closes, its index entries go (idempotent)."""
        tracked = self._tracked.pop(worker_id, None)
        if tracked is not None and tracked.warmup is not None:
            task, tracked.warmup = tracked.warmup, None
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        if self.subscriber is not None:
            self.subscriber.remove_worker(worker_id)
        if tracked is not None:
            tracked.index.remove_worker(worker_id)

    def clear_worker(self, worker_id: str) -> bool:
        """Drop every index entry of the worker (every tier, pools included), then re-warm it as after a resync
        when it publishes events. Returns False for a worker not in the fleet."""
        tracked = self._tracked.get(worker_id)
        if tracked is None:
            return False
        with suppress(UnknownWorkerError):  # nothing indexed for it yet: nothing to clear
            tracked.index.clear_worker(worker_id)
        if tracked.worker.config.has_events:
            self._rewarm(tracked)
        return True

    async def cancel_warmups(self) -> None:
        """Cancel every warm-up task and wait for them (app shutdown)."""
        tasks = [t.warmup for t in self._tracked.values() if t.warmup is not None]
        for tracked in self._tracked.values():
            tracked.warmup = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task

    # -- warm-up -----------------------------------------------------------------------------------------------

    def _rewarm(self, tracked: _Tracked) -> None:
        """The worker's index was cleared: route it on approximate entries and rebuild from its snapshot."""
        tracked.worker.mark_cold()
        self._begin_warmup(tracked)

    def _begin_warmup(self, tracked: _Tracked) -> None:
        tracked.splice.begin()
        self._start_warmup_task(tracked)

    def _start_warmup_task(self, tracked: _Tracked) -> None:
        """(Re)start the fetch task; the splice already holds (``begin``)."""
        self._cancel_warmup(tracked)
        worker_id = tracked.worker.worker_id
        tracked.warmup = asyncio.get_running_loop().create_task(self._warm_up(tracked), name=f"warmup-{worker_id}")

    @staticmethod
    def _cancel_warmup(tracked: _Tracked) -> None:
        task, tracked.warmup = tracked.warmup, None
        if task is not None and not task.done():
            task.cancel()

    async def _warm_up(self, tracked: _Tracked) -> None:
        worker = tracked.worker
        try:
            while True:
                last_seq = await self.warm_from_snapshot(worker, tracked.index)
                if last_seq is None:
                    break
                num_stale_before = tracked.splice.num_stale_dropped
                spliced = tracked.splice.on_snapshot(last_seq)
                num_stale = tracked.splice.num_stale_dropped - num_stale_before
                if num_stale and self.subscriber is not None:
                    self.subscriber.counters.drop(worker.worker_id, DropKind.STALE_BATCH,
                                                  f"{num_stale} batches past snapshot seq {last_seq}", num_stale)
                for batch in spliced.batches:
                    tracked.index.apply(batch)
                if spliced.is_complete:
                    worker.mark_warm()
                    return
                logger.info("worker %s: its snapshot misses live batches; fetching it again", worker.worker_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("warm-up of worker %s failed; waiting for its events", worker.worker_id)
        step = tracked.splice.on_no_snapshot()  # no usable snapshot: apply what was held, warm on events
        for batch in step.batches:
            tracked.index.apply(batch)
        if step.makes_warm:
            worker.mark_warm()
        logger.info("worker %s: no snapshot; its index warms from its events", worker.worker_id)

    async def warm_from_snapshot(self, worker: WorkerRuntime, index: PrefixIndex) -> int | None:
        """Fetch the worker's snapshot (a vLLM wire batch, msgpack) and apply it to ``index``.

        Returns:
            The snapshot's ``x-kvgate-last-seq`` (-1 when absent: nothing published before it), or ``None`` when
            snapshots are off, the worker has none (non-200), it stays unreachable, it does not decode, or it is
            of a dp rank the worker was not configured with (as the subscriber drops such live batches).
        """
        path = worker.config.snapshot_path
        if not self._config.events.warmup_from_snapshot or path is None:
            return None
        for _ in range(SNAPSHOT_FETCH_ATTEMPTS):
            try:
                status, headers, body = await self._transport.get_with_headers(
                    worker.worker_id, worker.config.url + path, self._config.events.snapshot_timeout_s)
            except GatewayError:
                await asyncio.sleep(SNAPSHOT_RETRY_S)
                continue
            if status != 200:
                logger.info("worker %s: snapshot endpoint answered %d", worker.worker_id, status)
                return None
            try:
                last_seq = int(headers.get("x-kvgate-last-seq", "-1"))
            except ValueError:
                logger.warning("worker %s: bad x-kvgate-last-seq %r", worker.worker_id,
                               headers.get("x-kvgate-last-seq"))
                return None
            counters = self.subscriber.counters if self.subscriber is not None else EventCounters()
            batch = EventDecoder(counters).decode(body, worker_id=worker.worker_id, seq=max(last_seq, 0),
                                                  block_size=worker.block_size,
                                                  default_dp_rank=worker.config.dp_rank_offset)
            if batch is None:
                logger.warning("worker %s: snapshot not decodable", worker.worker_id)
                return None
            ranks = worker.config.dp_rank_range
            if batch.dp_rank not in ranks:
                logger.warning("worker %s: snapshot of dp rank %d refused (the worker has %d%s)", worker.worker_id,
                               batch.dp_rank, len(ranks), f" from dp rank {ranks.start}" if ranks.start else "")
                return None
            index.apply(to_pool_medium(batch, pool_media_of(worker)))
            logger.info("worker %s warmed from its snapshot (%d events, last seq %d)", worker.worker_id,
                        len(batch.events), last_seq)
            return last_seq
        return None
