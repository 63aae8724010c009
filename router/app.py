"""The gateway application: ``build_app(config) -> web.Application``.

Every component is built here and stored under a ``web.AppKey``; long-lived tasks (event subscriber, health
checks, load polling, session reaping) start in ``cleanup_ctx`` and are cancelled and awaited on exit.

Routes (their handlers live in ``router.api``)::

    POST /v1/completions, /v1/chat/completions    routed and proxied (streaming passthrough)
    GET  /v1/models                                the fleet's models
    GET  /health                                   alive (200 always)
    GET  /ready                                    200 when every worker's index is warm (or the ready timeout
                                                   passed; also with zero workers), else 503
    GET  /metrics                                  Prometheus text format
    *    /admin/...                                see ``router.admin``

Request path (``router.api``, one handler, no middleware): read the body (limit) -> ``parse_request``
(msgspec, routing fields only) -> the model's ``ModelTokenizer.view`` (incremental) -> admission ->
``RequestFlight.run`` (``router.lifecycle``: route, forward, finish). Every error is an OpenAI-style JSON body
(``router.errors`` gives the status).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any

import msgspec
from aiohttp import web

from events.types import EventBatch, Medium, Resync, normalize_medium
from policies import build_policy
from router.admission import Admission
from router.api import GATEWAY as GATEWAY
from router.api import (
    _add_json_fallbacks,
    chat_completions,
    completions,
    health,
    metrics,
    models,
    ready,
)
from router.api import error_response as error_response
from router.config import GatewayConfig, index_config, validate_policy, validate_sessions
from router.errors import GatewayError
from router.fleet import Fleet, WorkerRuntime
from router.index import PrefixIndex
from router.lifecycle import RequestLifecycle
from router.metrics import GatewayMetrics, MetricSample
from router.proxy import ClientHeaderReader, Proxy
from router.request_view import ModelTokenizer
from router.routing import PolicyHolder, Router
from router.sessions.base import SessionStore
from router.sessions.config import build_session_store
from router.transport import AiohttpTransport, Transport

logger = logging.getLogger(__name__)


class Gateway:
    """Every component of one gateway app (reachable as ``app[GATEWAY]``)."""

    def __init__(
        self, config: GatewayConfig, *, transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = GatewayMetrics()
        self.tokenizers: dict[str, ModelTokenizer] = {m.name: ModelTokenizer(m) for m in config.models}
        self.indexes: dict[str, PrefixIndex] = {m.name: PrefixIndex(index_config(config, m)) for m in config.models}
        self.sessions: SessionStore = build_session_store(validate_sessions(config.sessions), clock)
        policy_config = validate_policy(config.policy)
        self.holder = PolicyHolder(policy_config, build_policy(policy_config))
        self.transport: Transport = transport if transport is not None else AiohttpTransport(config.timeouts)
        self.fleet = Fleet(config, self.transport, _Hooks(self), clock)
        self.router = Router(
            self.fleet, self.indexes, self.sessions, self.holder,
            num_recent_decisions=config.admin.num_recent_decisions, clock=clock,
        )
        self.proxy = Proxy(self.transport, config.retry, self.metrics, clock=clock)
        self.admission = Admission(config.admission)
        self.lifecycle = RequestLifecycle(
            self.router, self.proxy, self.fleet, self.admission, self.metrics,
            max_inflight_per_worker=config.admission.max_inflight_per_worker, clock=clock,
        )
        self.client_headers = ClientHeaderReader()
        self.subscriber: Any = None
        self._request_ids = itertools.count(1)
        self._id_prefix = f"kvg-{os.getpid():x}-{int(time.time()):x}-"
        self.metrics.add_callback(self._samples)

    # -- helpers -------------------------------------------------------------------------------------------

    def index_for(self, worker: WorkerRuntime) -> PrefixIndex | None:
        """The prefix index of the worker's model."""
        model = self.config.model(worker.config.model)
        return self.indexes.get(model.name) if model is not None else None

    def next_request_id(self) -> str:
        return self._id_prefix + str(next(self._request_ids))

    def on_event(self, item: EventBatch | Resync) -> None:
        """The subscriber's sink: apply to the worker's model index; mark warm; rebuild after a resync."""
        worker = self.fleet.workers.get(item.worker_id)
        if worker is None:
            return
        index = self.index_for(worker)
        if index is None:
            return
        if isinstance(item, Resync):
            logger.warning("worker %s resync (%s): index cleared, rebuilding", item.worker_id, item.reason)
            index.apply_resync(item)
            self.fleet.mark_resync(item.worker_id)
            return
        for batch in self.fleet.admit(worker, item):  # held or dropped around a snapshot (router.fleet)
            index.apply(batch)

    def _samples(self) -> list[MetricSample]:
        out: list[MetricSample] = []
        now_s = self.clock()
        for worker in self.fleet.workers.values():
            wid = worker.worker_id
            out.append(("gauge", "kvgate_worker_healthy", "1 when the worker passes health checks.",
                        {"worker": wid}, float(worker.is_healthy)))
            out.append(("gauge", "kvgate_worker_draining", "1 while the worker is drained.",
                        {"worker": wid}, float(worker.is_draining)))
            worker.breaker.allows(now_s)
            out.append(("gauge", "kvgate_circuit_state", "Circuit breaker: 0 closed, 1 open, 2 half-open.",
                        {"worker": wid}, float(worker.breaker.state)))
            out.append(("gauge", "kvgate_pending_prefill_tokens", "Prompt tokens sent and not yet prefilled.",
                        {"worker": wid}, float(worker.num_pending_prefill_tokens)))
        for name, index in self.indexes.items():
            stats = index.stats()
            out.append(("gauge", "kvgate_index_entries", "Indexed blocks per model index.", {"model": name},
                        float(stats.num_blocks)))
            out.append(("gauge", "kvgate_index_approx_blocks", "Approximate (unconfirmed) blocks.",
                        {"model": name}, float(stats.num_approx_blocks)))
            for wid, media in stats.num_blocks_by_worker.items():
                for medium, n in media.items():
                    out.append(("gauge", "kvgate_index_blocks", "Blocks held per worker and tier.",
                                {"worker": wid, "medium": medium}, float(n)))
            for counter, n in stats.counters.items():
                out.append(("counter", "kvgate_index_events", "Index event and maintenance counters.",
                            {"model": name, "counter": counter}, float(n)))
        sub = self.subscriber
        if sub is not None:
            counters = sub.counters
            for kind, n in counters.drops_by_kind().items():
                out.append(("counter", "kvgate_event_drops", "Malformed or refused events by kind.",
                            {"kind": str(kind)}, float(n)))
            for key, value in _counter_fields(counters).items():
                out.append(("counter", "kvgate_event_stream", "Event stream counters (batches, gaps, replays...).",
                            {"counter": key}, float(value)))
        stats_fn = getattr(self.sessions, "stats", None)
        if stats_fn is not None:
            s = stats_fn()
            out.append(("gauge", "kvgate_sessions_live", "Live sessions.", {}, float(s.num_live_sessions)))
            out.append(("counter", "kvgate_sessions_expired", "Sessions expired.", {}, float(s.num_expired_total)))
            out.append(("counter", "kvgate_sessions_moved", "Sessions moved.", {}, float(s.num_moved_total)))
            out.append(("counter", "kvgate_sessions_created", "Sessions created.", {}, float(s.num_created_total)))
            out.append(("gauge", "kvgate_sessions_store_degraded",
                        "1 while the shared session store is unreachable and the local fallback answers.", {},
                        float(s.is_degraded)))
            out.append(("counter", "kvgate_sessions_store_fallbacks", "Switches to the local session fallback.", {},
                        float(s.num_fallbacks_total)))
        out.append(("gauge", "kvgate_admission_inflight", "Admitted requests in flight.", {},
                    float(self.admission.num_inflight)))
        out.append(("gauge", "kvgate_admission_waiting", "Requests waiting for admission.", {},
                    float(self.admission.num_waiting)))
        return out


def _counter_fields(counters: object) -> dict[str, int]:
    """Totals of the subscriber's ``EventCounters`` (batches, gaps, replays, disconnects...; resyncs as
    ``num_resyncs``). Each is a ``Counter`` keyed by worker or endpoint; a plain int is taken as is."""
    out: dict[str, int] = {}
    for name in dir(counters):
        if name.startswith("num_") or name == "resyncs":
            value = getattr(counters, name, None)
            key = "num_resyncs" if name == "resyncs" else name
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
            elif isinstance(value, Mapping):
                out[key] = int(sum(value.values()))
    return out


def _update_pools(gw: Gateway) -> None:
    """Pool membership from the workers' ``pools`` (tier names, e.g. ``MOONCAKE``), per model index."""
    for name, index in gw.indexes.items():
        members: dict[Medium, list[str]] = {}
        for worker in gw.fleet.candidates(name):
            for pool in worker.config.pools:
                medium = normalize_medium(pool)
                if medium is not None:
                    members.setdefault(medium, []).append(worker.worker_id)
        for medium in (Medium.MOONCAKE, Medium.DISK, Medium.CPU):
            if medium in members or medium == Medium.MOONCAKE:
                index.set_pool_members(medium, members.get(medium, ()))


class _Hooks:
    """Fleet -> rest of the gateway: subscriber, index, sessions, transport, calibrator."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    async def on_worker_added(self, worker: WorkerRuntime) -> None:
        gw = self._gw
        if worker.config.pools:
            _update_pools(gw)
        if gw.subscriber is not None and worker.config.has_events:
            _add_to_subscriber(gw.subscriber, worker)

    async def on_worker_removed(self, worker: WorkerRuntime) -> None:
        gw = self._gw
        if gw.subscriber is not None:
            gw.subscriber.remove_worker(worker.worker_id)
        index = gw.index_for(worker)
        if index is not None:
            index.remove_worker(worker.worker_id)
        if worker.config.pools:
            _update_pools(gw)
        num = await gw.sessions.drop_worker(worker.worker_id)
        if num:
            logger.info("worker %s removed: %d sessions will be routed afresh", worker.worker_id, num)
        # Its requests in flight are relayed to their end (as after a drain); then its connections close.
        await gw.transport.remove_worker(worker.worker_id, is_idle=lambda: worker.num_inflight_requests == 0)
        gw.metrics.forget_worker(worker.worker_id)
        calibrator = gw.holder.calibrator
        if calibrator is not None:
            calibrator.forget(worker.worker_id)

    def on_start_id_changed(self, worker: WorkerRuntime, start_id: str | int) -> None:
        sub = self._gw.subscriber
        if sub is not None and worker.config.has_events:
            sub.notify_start_id(worker.worker_id, start_id)

    async def warm_up(self, worker: WorkerRuntime) -> int | None:
        """Apply the worker's snapshot (a vLLM wire batch, msgpack) to its index.

        Returns:
            The snapshot's ``x-kvgate-last-seq`` (-1 when absent: nothing published before it), or ``None`` when
            snapshots are off, the worker has none (non-200), it stays unreachable, or it does not decode.
        """
        gw = self._gw
        path = worker.config.snapshot_path
        if not gw.config.events.warmup_from_snapshot or path is None:
            return None
        from events.counters import EventCounters
        from events.decode import EventDecoder

        for _ in range(50):
            try:
                status, headers, body = await gw.transport.get_with_headers(
                    worker.worker_id, worker.config.url + path, gw.config.health.timeout_s)
            except GatewayError:
                await asyncio.sleep(0.2)
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
            counters = gw.subscriber.counters if gw.subscriber is not None else EventCounters()
            batch = EventDecoder(counters).decode(body, worker_id=worker.worker_id, seq=max(last_seq, 0),
                                                  block_size=worker.block_size)
            index = gw.index_for(worker)
            if batch is None or index is None:
                logger.warning("worker %s: snapshot not decodable", worker.worker_id)
                return None
            if not 0 <= batch.dp_rank < worker.config.dp_ranks:  # as the subscriber drops such live batches
                logger.warning("worker %s: snapshot of dp rank %d refused (the worker has %d)", worker.worker_id,
                               batch.dp_rank, worker.config.dp_ranks)
                return None
            index.apply(batch)
            logger.info("worker %s warmed from its snapshot (%d events, last seq %d)", worker.worker_id,
                        len(batch.events), last_seq)
            return last_seq
        return None

    def apply_batches(self, worker: WorkerRuntime, batches: Sequence[EventBatch]) -> None:
        index = self._gw.index_for(worker)
        if index is not None:
            for batch in batches:
                index.apply(batch)


def _add_to_subscriber(subscriber: Any, worker: WorkerRuntime) -> None:
    from events.subscriber import WorkerSpec

    cfg = worker.config
    for rank in range(cfg.dp_ranks):
        endpoint = cfg.events_endpoint if cfg.topology == "connect" else None
        subscriber.add_worker(WorkerSpec(
            worker_id=cfg.id, endpoint=_offset_endpoint(endpoint, rank), replay_endpoint=_offset_endpoint(
                cfg.replay_endpoint, rank), dp_rank=rank, block_size=worker.block_size,
        ))


def _offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's data-parallel convention: rank ``r`` publishes on the configured port + ``r``."""
    if endpoint is None or rank == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if port.isdigit() else endpoint


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start the subscriber, the sessions store, the workers and the background loops; stop them on exit."""
    gw = app[GATEWAY]
    from events.subscriber import KVEventSubscriber, SubscriberConfig

    sub_cfg = msgspec.convert(
        {**gw.config.events.subscriber, "bind-endpoint": gw.config.events.bind_endpoint}, SubscriberConfig
    )
    gw.subscriber = KVEventSubscriber(sub_cfg, gw.on_event)
    await gw.subscriber.start()
    start = getattr(gw.sessions, "start", None)
    if start is not None:
        await start()
    gw.fleet.started_at_s = gw.clock()
    for worker_config in gw.config.workers:
        await gw.fleet.add(worker_config)
    tasks = [
        asyncio.create_task(gw.fleet.run_health_checks(), name="health-checks"),
        asyncio.create_task(gw.fleet.run_load_polling(), name="load-polling"),
        asyncio.create_task(_reap_sessions(gw), name="session-reaper"),
        asyncio.create_task(_expire_approximate(gw), name="approximate-expiry"),
    ]
    if gw.config.discovery is not None:
        from router.discovery import run_discovery

        tasks.append(asyncio.create_task(run_discovery(gw.config, gw.fleet), name="discovery"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
        await gw.fleet.aclose()
        await gw.subscriber.aclose()
        await gw.sessions.aclose()
        await gw.transport.aclose()


async def _expire_approximate(gw: Gateway) -> None:
    """Drop approximate index entries past their TTL, once a second."""
    while True:
        await asyncio.sleep(1.0)
        now_s = gw.clock()
        for index in gw.indexes.values():
            index.expire(now_s)


async def _reap_sessions(gw: Gateway) -> None:
    interval_s = validate_sessions(gw.config.sessions).reap_interval_s
    reap = getattr(gw.sessions, "reap_expired", None)
    while reap is not None:
        await asyncio.sleep(interval_s)
        try:
            await reap()
        except Exception:
            logger.exception("session reaping failed")


def build_app(
    config: GatewayConfig, *, transport: Transport | None = None, clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """Build the gateway application (nothing starts until the app runs).

    Args:
        config: the decoded configuration.
        transport: the upstream transport (default ``AiohttpTransport``; tests pass a ``MockTransport``).
        clock: monotonic clock in seconds (injected in tests: session expiry, breakers, readiness).

    Raises:
        ConfigError: a section that does not validate, a tokenizer that does not load, or no admin token.
    """
    from router.admin import add_admin_routes

    admin_token = config.admin.resolve_token()
    app = web.Application(client_max_size=config.listen.max_body_bytes)
    app[GATEWAY] = Gateway(config, transport=transport, clock=clock)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, admin_token)
    _add_json_fallbacks(app)
    app.cleanup_ctx.append(_lifecycle)
    return app
