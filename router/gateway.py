"""The composition root: every component of one gateway, wired once, and the app's start-up and shutdown.

``Gateway(config)`` builds the components and joins them directly (no callbacks back into it)::

    transport ─────────────┬──► Fleet (health, load, breakers)  ──new start id──► EventPath
                           ├──► Proxy (requests)
                           └──► EventPath (snapshot fetches) ──► PrefixIndex per model ◄── Router (match, insert)
    SessionStore ──────────────► Router;  PolicyHolder ──► Router;  GatewayMetrics ◄── scrape-time samples
    Router, Proxy, Fleet, Admission, GatewayMetrics ──► RequestLifecycle (route, forward, finish)

Adding and removing a worker (``add_worker``/``remove_worker``: admin API, discovery, the config's workers) is
the one place that touches every component a worker has a part in: fleet registry, pool membership, event
subscription and warm-up (``router.event_path``), sessions, pooled connections, metrics, calibrator.

Start-up is one aiohttp cleanup context per resource, entered in this order and left in reverse, so a start-up
that fails half-way leaves only what it entered and that is closed again by the runner's cleanup::

    transport          closed last
    subscriber         started (binds ``events.bind_endpoint``); closed
    session store      started (Redis: connects); closed
    workers            the config's workers added (subscribed, warm-up begun); warm-ups cancelled
    background loops   health checks, load polling, session reaping, approximate expiry, pool watch, discovery;
                       cancelled and awaited

A graceful stop first drains (``drain_on_shutdown``, the app's ``on_shutdown`` hook, which aiohttp runs once the
listener is closed and before the contexts are left): the requests in flight get ``listen.shutdown_grace_s``, then
each stream still relayed ends with an error event (``router.drain``).

The app keys: ``GATEWAY`` (this object; ``router.api`` and ``router.admin`` read everything through it).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from aiohttp import web

from common.process_stats import HeapTrimmer
from events.capacity import open_files_limit, rank_stream_capacity
from events.counters import EventCounters
from events.errors import EventsConfigError
from events.subscriber import KVEventSubscriber
from events.types import Medium, normalize_medium
from policies import build_policy
from router.admission import Admission
from router.config import GatewayConfig, WorkerConfig, index_config
from router.drain import Drain
from router.errors import ConfigError, GatewayError
from router.event_path import EventPath
from router.fleet import Fleet, WorkerRuntime
from router.index import PrefixIndex
from router.lifecycle import RequestLifecycle
from router.metrics import GatewayMetrics, MetricSample, gateway_samples
from router.pd import PDLifecycle
from router.pd_ledger import ledger_samples
from router.pool_watch import PoolWatcher
from router.proxy import ClientHeaderReader, Proxy
from router.request_view import PARSE_THREADS, ModelTokenizer
from router.routing import PolicyHolder, Router
from router.sessions.base import SessionStore
from router.sessions.factory import build_session_store
from router.transport import AiohttpTransport, Transport

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from router.tracing import RequestTracer

logger = logging.getLogger(__name__)

APPROXIMATE_EXPIRY_INTERVAL_S = 1.0
"""How often approximate index entries past their TTL are dropped."""
APPROXIMATE_EXPIRY_SLICE_BLOCKS = 512
"""Positions one slice of that expiry looks at before it yields to the event loop (a long conversation's record
is dropped over several slices, so no request waits behind all of it): 3-5 ms of the loop on a busy 2-core host
at 6-9 us a dropped block (2,048 held it 12-18 ms there)."""


class Gateway:
    """Every component of one gateway app (reachable as ``app[GATEWAY]``).

    Attributes:
        config: the decoded configuration.
        clock: monotonic clock in seconds.
        metrics: the per-app Prometheus metrics.
        tokenizers: one incremental tokenizer per ``models[].name``.
        parse_executor: decodes long request bodies (``router.api.parse_request_async``), ``PARSE_THREADS``
            threads, started on first use.
        indexes: one prefix index per ``models[].name``.
        sessions: the session store (memory or Redis).
        holder: the routing policy in force (replaceable through the admin API).
        transport: the upstream transport (connection pools per worker).
        events: the event path (subscriber, splice, warm-up) feeding ``indexes``.
        fleet: the workers with their health, load and accounting.
        router: picks a worker per request.
        proxy: forwards a request and relays the answer.
        admission: the global in-flight limit.
        lifecycle: runs one request from routing to its settlement (``router.lifecycle``).
        pd: runs one request of a disaggregated model: both legs, the decode reservations (``router.pd``).
        tracer: the request tracer when ``tracing.enabled`` (``router.tracing``; then ``router`` is its
            ``TracedRouter`` and ``router.api`` starts traced flights), else ``None``.
        pool_watcher: keeps the pool entries to what the Mooncake master holds (``router.pool_watch``), when
            ``pool_watch`` is configured, else ``None``.
    """

    def __init__(
        self, config: GatewayConfig, *, transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic, span_exporter: SpanExporter | None = None,
    ) -> None:
        """Build every component (nothing starts: see the cleanup contexts).

        ``span_exporter`` replaces the OTLP exporter when tracing is enabled (tests: the SDK's in-memory one).

        Raises:
            ConfigError: a section that does not validate, or a tokenizer that does not load.
        """
        self.config = config
        self.clock = clock
        self.metrics = GatewayMetrics()
        self.tokenizers: dict[str, ModelTokenizer] = {m.name: ModelTokenizer(m) for m in config.models}
        self.parse_executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
        self.indexes: dict[str, PrefixIndex] = {m.name: PrefixIndex(index_config(config, m)) for m in config.models}
        self.sessions: SessionStore = build_session_store(config.sessions, clock)
        self.holder = PolicyHolder(config.policy, build_policy(config.policy))
        self.transport: Transport = transport if transport is not None else AiohttpTransport(config.timeouts)
        self.events = EventPath(config, self.indexes, self.transport)
        self.fleet = Fleet(config, self.transport, clock=clock, on_start_id_changed=self.events.on_start_id_changed)
        self.tracer: RequestTracer | None = None
        self.pool_watcher = PoolWatcher(config.pool_watch, self.indexes, clock) if config.pool_watch else None
        router_type: type[Router] = Router
        router_kwargs: dict[str, Any] = {}
        if config.tracing.enabled:  # OpenTelemetry (the otel extra) only when tracing is on
            from router.tracing import RequestTracer, TracedRouter

            self.tracer = RequestTracer(config.tracing, exporter=span_exporter)
            router_type, router_kwargs = TracedRouter, {"tracer": self.tracer}
        self.router = router_type(
            self.fleet, self.indexes, self.sessions, self.holder,
            num_recent_decisions=config.admin.num_recent_decisions, clock=clock, pool_watcher=self.pool_watcher,
            **router_kwargs,
        )
        self.drain = Drain()
        """The streams relayed, which a graceful stop ends cleanly (``drain_on_shutdown``)."""
        self.proxy = Proxy(self.transport, config.retry, self.metrics, clock=clock,
                           max_response_bytes=config.max_response_bytes, drain=self.drain)
        self.heap = HeapTrimmer(config.memory.trim_interval_s, config.memory.trim_min_free_bytes)
        """Returns freed heap pages to the kernel (``config.memory``; its loop runs when ``enable_trim``)."""
        self.admission = Admission(config.admission)
        self.lifecycle = RequestLifecycle(
            self.router, self.proxy, self.fleet, self.admission, self.metrics,
            max_inflight_per_worker=config.admission.max_inflight_per_worker, clock=clock,
        )
        self.pd = PDLifecycle(self.router, self.proxy, self.transport, self.metrics, self.admission, clock=clock)
        self.client_headers = ClientHeaderReader()
        self._removals: dict[str, asyncio.Future[None]] = {}
        """Removals still tearing a worker down (its index entries, subscription, sessions in Redis, connection
        pool, all keyed by its id): an ``add_worker`` of the same id waits for it, so the old teardown never reaches
        the new worker's subscription, entries, sessions or pool."""
        self._request_ids = itertools.count(1)
        self._id_prefix = f"kvg-{os.getpid():x}-{int(time.time()):x}-"
        self.metrics.add_callback(functools.partial(
            gateway_samples, fleet=self.fleet, indexes=self.indexes, event_counters=self._event_counters,
            event_lag_s=self.events.event_lag_s, sessions=self.sessions, admission=self.admission, clock=clock,
            pool_watcher=self.pool_watcher))
        if any(m.pd is not None for m in config.models):
            self.metrics.add_callback(self._pd_samples)

    @property
    def subscriber(self) -> KVEventSubscriber | None:
        """The KV event subscriber, once started."""
        return self.events.subscriber

    def _pd_samples(self) -> list[MetricSample]:
        decode_ids = [w.worker_id for w in self.fleet.workers.values() if w.config.role != "prefill"]
        return ledger_samples(self.pd.ledger, decode_ids, num_waiting=self.pd.num_waiting,
                              num_rejected=self.pd.num_rejected)

    def _event_counters(self) -> EventCounters | None:
        sub = self.events.subscriber
        return sub.counters if sub is not None else None

    def next_request_id(self) -> str:
        """A fresh ``x-request-id`` (process id, start time, counter)."""
        return self._id_prefix + str(next(self._request_ids))

    # -- workers -----------------------------------------------------------------------------------------------

    async def add_worker(self, config: WorkerConfig) -> WorkerRuntime:
        """Register a worker, subscribe to its events and begin its warm-up.

        A removal of the same id still under way (awaiting Redis, a warm-up's end) is waited for first.
        All or nothing: when its event subscription fails (for any reason: an endpoint ZMQ refuses, ZMQ out of
        sockets after some of its dp ranks were subscribed...), what was started is undone and the worker is not
        registered.

        Raises:
            ConfigError: duplicate id, unknown model, a block size that is not a multiple of its model's, or an
                events endpoint that cannot be connected.
            GatewayError: the event subscription failed otherwise (an internal failure, status 500).
        """
        removal = self._removals.get(config.id)
        if removal is not None:  # the same id's removal still awaits (Redis, warm-up): let it finish first
            await asyncio.wait([removal])  # its failure is its caller's; a cancelled add leaves it running
        worker = self.fleet.add(config)
        try:
            if config.pools:
                self._update_pools()
            self.events.add_worker(worker)
            self.metrics.worker(worker.worker_id)  # its counters are exported from 0 on, before its first request
        except Exception as exc:  # undo, leave nothing behind
            self.fleet.remove(config.id)
            try:
                await self._forget(worker)
            except Exception:
                logger.exception("worker %s: undoing its partial start failed", config.id)
            if isinstance(exc, EventsConfigError):  # e.g. an events endpoint ZMQ refuses
                raise ConfigError(f"worker {config.id!r}: events_endpoint: {exc}", param="events_endpoint") from exc
            logger.error("worker %s: its event subscription could not start (%s: %s); not added", config.id,
                         type(exc).__name__, exc)
            raise GatewayError(
                f"worker {config.id!r} was not added: its event subscription (events_endpoint "
                f"{config.events_endpoint!r}, dp_ranks {config.dp_ranks}) could not start "
                f"({type(exc).__name__}: {exc})") from exc
        logger.info("worker %s added (%s, model %s)", config.id, config.url, config.model)
        return worker

    async def remove_worker(self, worker_id: str) -> WorkerRuntime:
        """Forget a worker: its index entries, sessions, subscription and connections go at once.

        Raises:
            NotFoundError: no such worker.
        """
        worker = self.fleet.remove(worker_id)
        removal = self._removals[worker_id] = asyncio.ensure_future(self._forget(worker))
        removal.add_done_callback(lambda _: self._drop_removal(worker_id, removal))
        await asyncio.shield(removal)  # a cancelled admin call does not stop the removal half-way
        logger.info("worker %s removed", worker_id)
        return worker

    def _drop_removal(self, worker_id: str, removal: asyncio.Future[None]) -> None:
        if self._removals.get(worker_id) is removal:
            del self._removals[worker_id]

    async def _forget(self, worker: WorkerRuntime) -> None:
        """Everything but the fleet's registry entry: warm-up, subscription, index, pools, sessions, pool."""
        await self.events.remove_worker(worker.worker_id)
        if worker.config.pools:
            self._update_pools()
        num = await self.sessions.drop_worker(worker.worker_id)
        if num:
            logger.info("worker %s removed: %d sessions will be routed afresh", worker.worker_id, num)
        # Its requests in flight are relayed to their end (as after a drain); then its connections close.
        await self.transport.remove_worker(worker.worker_id, is_idle=lambda: worker.num_inflight_requests == 0)
        self.metrics.forget_worker(worker.worker_id)
        self.router.forget_worker(worker.worker_id)
        calibrator = self.holder.calibrator
        if calibrator is not None:
            calibrator.forget(worker.worker_id)
        model = worker.config.model
        base = model if model in self.tokenizers else next(
            (m.name for m in self.config.models if model in m.lora_adapters), None)
        if base is not None and not self.fleet.candidates(base):  # its last worker: its prompt caches serve nobody
            self.tokenizers[base].clear_caches()
        if not self.fleet.workers:  # the last worker of all: the header memo's blocks were every request's
            self.client_headers.clear()
        self.heap.request()

    def _update_pools(self) -> None:
        """Pool membership from the workers' ``pools`` (tier names, e.g. ``MOONCAKE``), per model index."""
        for name, index in self.indexes.items():
            members: dict[Medium, list[str]] = {}
            for worker in self.fleet.candidates(name):
                for pool in worker.config.pools:
                    medium = normalize_medium(pool)
                    if medium is not None:
                        members.setdefault(medium, []).append(worker.worker_id)
            for medium in (Medium.MOONCAKE, Medium.DISK, Medium.CPU):
                if medium in members or medium == Medium.MOONCAKE:
                    index.set_pool_members(medium, members.get(medium, ()))


GATEWAY = web.AppKey("gateway", Gateway)
"""The app's ``Gateway`` (stored by ``router.app.build_app``)."""


DRAIN_END_TIMEOUT_S = 2.0
"""How long a graceful stop waits for the streams it ended to write their last event (seconds); aiohttp's own wait
for the handlers left after the drain (``router.serve``'s runner) is as long."""


async def drain_on_shutdown(app: web.Application) -> None:
    """The app's ``on_shutdown`` hook: the drain (``router.drain.Drain.stop``) with ``listen.shutdown_grace_s``."""
    gw = app[GATEWAY]
    await gw.drain.stop(gw.admission, gw.config.listen.shutdown_grace_s, DRAIN_END_TIMEOUT_S)


# -- cleanup contexts: one per resource, in start-up order ---------------------------------------------------------


async def transport_context(app: web.Application) -> AsyncIterator[None]:
    """The upstream transport: nothing to open; its pooled connections close last (after the tracer's last spans
    are flushed, when tracing is on); the parse thread goes with it."""
    try:
        yield
    finally:
        gw = app[GATEWAY]
        gw.parse_executor.shutdown(wait=False, cancel_futures=True)
        try:
            await gw.transport.aclose()
        finally:
            if gw.tracer is not None:
                await asyncio.to_thread(gw.tracer.shutdown)


async def subscriber_context(app: web.Application) -> AsyncIterator[None]:
    """The KV event subscriber: started (a bind endpoint that cannot be bound fails the start-up); closed."""
    events = app[GATEWAY].events
    await events.start_subscriber()
    try:
        yield
    finally:
        await events.close_subscriber()


async def sessions_context(app: web.Application) -> AsyncIterator[None]:
    """The session store: started; closed."""
    sessions = app[GATEWAY].sessions
    try:
        await sessions.start()
        yield
    finally:
        await sessions.aclose()


async def workers_context(app: web.Application) -> AsyncIterator[None]:
    """The config's workers: added in order (the ready timeout counts from here); their warm-ups cancelled."""
    gw = app[GATEWAY]
    try:
        check_rank_stream_capacity(gw)
        gw.fleet.started_at_s = gw.clock()
        for worker_config in gw.config.workers:
            await gw.add_worker(worker_config)
        yield
    finally:
        await gw.events.cancel_warmups()


def check_rank_stream_capacity(gw: Gateway) -> None:
    """Refuse a start whose configured workers need more KV event rank streams than this process can follow.

    Raises:
        ConfigError: the total of the workers' ``dp_ranks`` (those that publish events in the connect topology)
            is over ``events.capacity.rank_stream_capacity``; the message names the limit and how to raise it.
    """
    subscriber = gw.events.subscriber
    if subscriber is None:
        return
    num_streams = sum(w.dp_ranks for w in gw.config.workers if w.has_events and w.topology == "connect")
    capacity = rank_stream_capacity(subscriber.max_sockets, open_files_limit())
    if num_streams > capacity.num_streams:
        raise ConfigError(f"workers: {num_streams} KV event rank streams (the workers' dp_ranks) are more than "
                          f"this process can follow: {capacity.reason}", param="workers")


async def loops_context(app: web.Application) -> AsyncIterator[None]:
    """The background loops: started; cancelled and awaited."""
    gw = app[GATEWAY]
    loops: list[tuple[str, Coroutine[Any, Any, None]]] = [
        ("health-checks", gw.fleet.run_health_checks()),
        ("load-polling", gw.fleet.run_load_polling()),
        ("session-reaper", _reap_sessions(gw)),
        ("approximate-expiry", _expire_approximate(gw)),
    ]
    if gw.pool_watcher is not None:
        loops.append(("pool-watch", gw.pool_watcher.run()))
    if gw.config.memory.enable_trim:
        loops.append(("heap-trim", gw.heap.run()))
    if gw.config.discovery is not None:
        from router.discovery import run_discovery  # kubernetes_asyncio only when discovery runs

        loops.append(("discovery", run_discovery(gw.config, gw)))
    tasks = [asyncio.create_task(coro, name=name) for name, coro in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task


CLEANUP_CONTEXTS = (transport_context, subscriber_context, sessions_context, workers_context, loops_context)
"""The app's cleanup contexts, in start-up order (module docstring)."""


async def _expire_approximate(gw: Gateway) -> None:
    """Drop approximate index entries past their TTL, once a second, in slices that yield to the loop."""
    while True:
        await asyncio.sleep(APPROXIMATE_EXPIRY_INTERVAL_S)
        now_s = gw.clock()
        for index in list(gw.indexes.values()):
            while True:
                index.expire(now_s, APPROXIMATE_EXPIRY_SLICE_BLOCKS)
                if not index.has_expired(now_s):
                    break
                await asyncio.sleep(0)


async def _reap_sessions(gw: Gateway) -> None:
    """Forget expired sessions every ``sessions.reap_interval_s``; a failure is logged and the loop goes on."""
    interval_s = gw.config.sessions.reap_interval_s
    while True:
        await asyncio.sleep(interval_s)
        try:
            await gw.sessions.reap_expired()
        except Exception:
            logger.exception("session reaping failed")
