"""The workers behind the gateway: registry, health, circuit breakers, load and in-flight accounting.

``Fleet`` owns one ``WorkerRuntime`` per worker, in configuration order (then admin additions). Health and load
are learned by background loops (``run_health_checks``, ``run_load_polling``) started from the app's
``cleanup_ctx``; the request path only reads plain attributes.

Worker lifecycle (the index side of it lives in ``router.event_path``)::

    added ──(events worker)──► warming ──(snapshot applied | first event batch | ready timeout)──► warm
       └──(no events: approximate mode)──────────────────────────────────────────────────────────► warm
    warm ──(Resync from the subscriber)──► warming (index cleared; routed on approximate entries meanwhile)
    any  ──drain──► draining (no new requests; in-flight streams finish) ──undrain──► back
    any  ──remove──► gone

``Fleet.add`` and ``Fleet.remove`` only register and forget the worker; the gateway (``router.gateway.Gateway``
``add_worker``/``remove_worker``) wires the rest: event subscription and warm-up, index entries, sessions,
pooled connections.

Health: ``failure_threshold`` consecutive failed checks mark a worker unhealthy, ``success_threshold``
consecutive successes mark it healthy again. Circuit breaker (per worker, over proxied requests): closed →
``failure_threshold`` consecutive failures → open for ``open_s`` → half-open (one trial request) → closed on
success, open again on failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import Annotated, Any

import msgspec

from router.config import CircuitBreakerConfig, GatewayConfig, WorkerConfig, worker_block_size_error
from router.errors import ConfigError, NotFoundError, TransportError
from router.transport import Transport

logger = logging.getLogger(__name__)


class CircuitState(IntEnum):
    """Circuit breaker states (the metric's values)."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Consecutive-failure circuit breaker (see module docstring). Times are monotonic seconds."""

    __slots__ = ("_config", "worker_id", "state", "num_consecutive_failures", "opened_at_s", "is_trial_in_flight")

    def __init__(self, config: CircuitBreakerConfig, worker_id: str = "?") -> None:
        """Args:
            config: thresholds and the open time.
            worker_id: the worker it guards (named in its log lines).
        """
        self._config = config
        self.worker_id = worker_id
        self.state = CircuitState.CLOSED
        self.num_consecutive_failures = 0
        self.opened_at_s = 0.0
        self.is_trial_in_flight = False

    def allows(self, now_s: float) -> bool:
        """Whether a request may be sent now (an open circuit turns half-open after ``open_s``)."""
        if self.state == CircuitState.CLOSED or not self._config.enabled:
            return True
        if self.state == CircuitState.OPEN and now_s - self.opened_at_s >= self._config.open_s:
            self.state = CircuitState.HALF_OPEN
            self.is_trial_in_flight = False
        return self.state == CircuitState.HALF_OPEN and not self.is_trial_in_flight

    def on_attempt(self) -> None:
        """A request is being sent (half-open: it is the trial)."""
        if self.state == CircuitState.HALF_OPEN:
            self.is_trial_in_flight = True

    def on_abandoned(self) -> None:
        """A request was given up with no verdict (its client went away): a half-open trial no longer blocks the
        next request from being the trial."""
        self.is_trial_in_flight = False

    def record_success(self) -> None:
        """A request got a non-5xx response."""
        self.num_consecutive_failures = 0
        self.state = CircuitState.CLOSED
        self.is_trial_in_flight = False

    def record_failure(self, now_s: float) -> None:
        """A request failed (connect error, timeout, 5xx)."""
        self.num_consecutive_failures += 1
        self.is_trial_in_flight = False
        if not self._config.enabled:
            return
        if self.state == CircuitState.HALF_OPEN or self.num_consecutive_failures >= self._config.failure_threshold:
            if self.state != CircuitState.OPEN:
                logger.warning("worker %s: circuit opened after %d consecutive failures", self.worker_id,
                               self.num_consecutive_failures)
            self.state = CircuitState.OPEN
            self.opened_at_s = now_s


MAX_LOAD_REQUESTS = 1_000_000
"""Most running or waiting requests a load answer may report; a larger count is refused as malformed."""


class WorkerLoad(msgspec.Struct, frozen=True, gc=False):
    """The worker's load endpoint answer (fields the gateway reads; unknown ones ignored). A value out of range
    (a negative count, a count over ``MAX_LOAD_REQUESTS``, a KV usage outside 0..1) makes the whole answer
    malformed: the previous load is kept and the worker's first such answer is logged.

    Attributes:
        num_running_requests: requests decoding or prefilling.
        num_waiting_requests: requests queued.
        kv_usage: fraction of GPU KV blocks in use, 0..1.
        start_id: changes when the worker (and its event publisher) restarts.
        num_free_blocks: free blocks per tier (``{"GPU": n, ...}``; the reference worker's ``/load``), or ``None``.
        num_total_blocks: blocks per tier, or ``None``.
    """

    num_running_requests: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOAD_REQUESTS)] = 0
    num_waiting_requests: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOAD_REQUESTS)] = 0
    kv_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    start_id: str | int | None = None
    num_free_blocks: dict[str, Annotated[int, msgspec.Meta(ge=0)]] | None = None
    num_total_blocks: dict[str, Annotated[int, msgspec.Meta(ge=0)]] | None = None

    @property
    def num_free_gpu_blocks(self) -> int | None:
        """Free GPU blocks, or ``None`` when the worker does not say."""
        return self.num_free_blocks.get("GPU") if self.num_free_blocks is not None else None

    @property
    def num_total_gpu_blocks(self) -> int | None:
        """GPU blocks in all, or ``None`` when the worker does not say."""
        return self.num_total_blocks.get("GPU") if self.num_total_blocks is not None else None


class WorkerRuntime:
    """Mutable state of one worker. Only the event loop thread touches it.

    Attributes:
        config: the worker's config.
        block_size: tokens per block (the worker's, else its model's).
        is_healthy: last health verdict (starts healthy: the breaker protects the first requests).
        is_draining: no new requests.
        is_warm: index entries are usable (see module docstring).
        is_approximate: decisions insert approximate index entries (no events, or rebuilding after resync).
        breaker: circuit breaker.
        num_inflight_requests: requests in flight through this gateway.
        num_inflight_prompt_tokens: prompt tokens of those requests.
        num_pending_prefill_tokens: prompt tokens sent but not yet prefilled (until the first byte).
        num_pending_prefill_token_pairs: the attention work of those tokens, ``sum(n**2 - k**2)`` over the requests
            pending (``n`` prompt, ``k`` predicted cached tokens): what their prefill costs beyond the linear part.
        pending_prefills: the same requests one by one, by lease, in admission order: ``(admitted_at_s,
            num_uncached_tokens, num_uncached_token_pairs)`` with the time on the worker's clock (``router.lease``).
        prefill_done_at_s: when the worker last finished its oldest pending prefill (its first byte), on its clock;
            0.0 before.
        num_decoding_requests: requests past their first byte and not finished.
        load: last polled load, or ``None``.
        start_id: last seen start id.
    """

    def __init__(self, config: WorkerConfig, block_size: int, breaker: CircuitBreakerConfig) -> None:
        self.config = config
        self.worker_id = config.id
        self.block_size = block_size
        self.is_healthy = True
        self.is_draining = False
        self.is_warm = not config.has_events
        self.is_approximate = not config.has_events
        self.breaker = CircuitBreaker(breaker, config.id)
        self.num_inflight_requests = 0
        self.num_inflight_prompt_tokens = 0
        self.num_pending_prefill_tokens = 0
        self.num_pending_prefill_token_pairs = 0
        self.pending_prefills: dict[object, tuple[float, int, int]] = {}
        self.prefill_done_at_s = 0.0
        self.num_decoding_requests = 0
        self.load: WorkerLoad | None = None
        self.start_id: str | int | None = None
        self.has_logged_bad_load = False
        self._num_health_failures = 0
        self._num_health_successes = 0

    def mark_warm(self) -> None:
        """The worker's index entries are usable (snapshot applied or first event batch seen)."""
        if not self.is_warm:
            self.is_warm = True
            self.is_approximate = not self.config.has_events
            logger.info("worker %s index warm", self.worker_id)

    def mark_cold(self) -> None:
        """The worker's index entries were cleared: route it on approximate entries until it is warm again."""
        self.is_warm = False
        self.is_approximate = True

    def record_health(self, is_ok: bool, failure_threshold: int, success_threshold: int) -> bool:
        """Fold one health check result in; returns True when ``is_healthy`` changed."""
        if is_ok:
            self._num_health_failures = 0
            self._num_health_successes += 1
            if not self.is_healthy and self._num_health_successes >= success_threshold:
                self.is_healthy = True
                return True
        else:
            self._num_health_successes = 0
            self._num_health_failures += 1
            if self.is_healthy and self._num_health_failures >= failure_threshold:
                self.is_healthy = False
                return True
        return False

    def info(self, now_s: float) -> dict[str, Any]:
        """JSON-ready description for the admin API."""
        return {
            "id": self.worker_id,
            "url": self.config.url,
            "model": self.config.model,
            "events_endpoint": self.config.events_endpoint,
            "topology": self.config.topology,
            "pools": list(self.config.pools),
            "block_size": self.block_size,
            "is_healthy": self.is_healthy,
            "is_draining": self.is_draining,
            "is_warm": self.is_warm,
            "is_approximate": self.is_approximate,
            "circuit": self.breaker.state.name.lower(),
            "num_inflight_requests": self.num_inflight_requests,
            "num_inflight_prompt_tokens": self.num_inflight_prompt_tokens,
            "num_pending_prefill_tokens": self.num_pending_prefill_tokens,
            "num_pending_prefill_token_pairs": self.num_pending_prefill_token_pairs,
            "num_decoding_requests": self.num_decoding_requests,
            "load": msgspec.to_builtins(self.load) if self.load is not None else None,
            "start_id": self.start_id,
        }


class Fleet:
    """Registry of workers with their health, load and accounting."""

    def __init__(
        self, config: GatewayConfig, getter: Transport, *, clock: Callable[[], float] = time.monotonic,
        on_start_id_changed: Callable[[WorkerRuntime, str | int], None] | None = None,
    ) -> None:
        """Args:
            config: the gateway config (models, health, load polling, circuit breaker, ready timeout).
            getter: health and load GETs (the transport).
            clock: monotonic clock in seconds.
            on_start_id_changed: told each new start id a load answer reports (the event path: the subscriber
                checks whether the worker's publisher restarted).
        """
        self._config = config
        self._getter = getter
        self._clock = clock
        self._on_start_id_changed = on_start_id_changed
        self.workers: dict[str, WorkerRuntime] = {}
        self._by_model: dict[str, tuple[WorkerRuntime, ...]] = {}
        self.started_at_s = clock()

    # -- registry ----------------------------------------------------------------------------------------------

    def _block_size(self, config: WorkerConfig) -> int:
        if config.block_size is not None:
            return config.block_size
        model = self._config.model(config.model)
        return model.block_size if model is not None else 16

    def _reindex(self) -> None:
        by_model: dict[str, list[WorkerRuntime]] = {}
        for worker in self.workers.values():
            model = self._config.model(worker.config.model)
            name = model.name if model is not None else worker.config.model
            by_model.setdefault(name, []).append(worker)
        self._by_model = {k: tuple(v) for k, v in by_model.items()}

    def candidates(self, base_model: str) -> tuple[WorkerRuntime, ...]:
        """Workers serving ``base_model`` (a ``models[].name``), in registration order."""
        return self._by_model.get(base_model, ())

    def get(self, worker_id: str) -> WorkerRuntime:
        """The worker ``worker_id``.

        Raises:
            NotFoundError: no such worker.
        """
        worker = self.workers.get(worker_id)
        if worker is None:
            raise NotFoundError(f"no worker {worker_id!r}", param="worker_id")
        return worker

    def model_names(self) -> list[str]:
        """Every model name (base and LoRA adapters) served by at least one worker."""
        names: list[str] = []
        for model in self._config.models:
            if model.name in self._by_model:
                names.append(model.name)
                names.extend(a for a in model.lora_adapters if a not in names)
        return names

    def add(self, config: WorkerConfig) -> WorkerRuntime:
        """Validate and register a worker (nothing is started: see ``router.gateway.Gateway.add_worker``).

        Raises:
            ConfigError: duplicate id, unknown model, a block size that is not a multiple of its model's, or the
                bind topology without ``events.bind_endpoint``.
        """
        if config.id in self.workers:
            raise ConfigError(f"worker: id {config.id!r} already exists")
        model = self._config.model(config.model)
        if model is None:
            raise ConfigError(f"worker: model {config.model!r} is not configured")
        block_size_error = worker_block_size_error(config, model)
        if block_size_error is not None:
            raise ConfigError(f"worker: {block_size_error}", param="block_size")
        if config.topology == "bind" and self._config.events.bind_endpoint is None:
            raise ConfigError("worker: topology bind needs events.bind_endpoint")
        worker = WorkerRuntime(config, self._block_size(config), self._config.circuit_breaker)
        self.workers[config.id] = worker
        self._reindex()
        return worker

    def remove(self, worker_id: str) -> WorkerRuntime:
        """Forget a worker (no new request is routed to it).

        Raises:
            NotFoundError: no such worker.
        """
        worker = self.get(worker_id)
        del self.workers[worker_id]
        self._reindex()
        return worker

    def set_draining(self, worker_id: str, is_draining: bool) -> WorkerRuntime:
        """Drain (no new requests) or undrain a worker.

        Raises:
            NotFoundError: no such worker.
        """
        worker = self.get(worker_id)
        worker.is_draining = is_draining
        logger.info("worker %s %s", worker_id, "draining" if is_draining else "undrained")
        return worker

    # -- readiness ---------------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Every worker is warm, or the ready timeout has passed (also true with zero workers)."""
        if self._clock() - self.started_at_s >= self._config.ready_timeout_s:
            return True
        return all(w.is_warm for w in self.workers.values())

    # -- background loops --------------------------------------------------------------------------------------

    async def check_health_once(self, workers: Iterable[WorkerRuntime] | None = None) -> None:
        """Run one health check on each worker (concurrently)."""
        cfg = self._config.health
        targets: Sequence[WorkerRuntime] = list(workers if workers is not None else self.workers.values())
        await asyncio.gather(*(self._check_health(w, cfg.failure_threshold) for w in targets))

    async def probe_added(self, worker: WorkerRuntime) -> None:
        """The first health check of a worker added at run time, whose failure counts at once: a worker that does
        not answer is unhealthy (no request is sent to it) until ``health.success_threshold`` checks pass, instead
        of taking traffic until ``failure_threshold`` checks have failed."""
        await self._check_health(worker, 1)

    async def _check_health(self, worker: WorkerRuntime, failure_threshold: int) -> None:
        cfg = self._config.health
        try:
            status, _ = await self._getter.get_json(
                worker.worker_id, worker.config.url + worker.config.health_path, cfg.timeout_s
            )
            is_ok = 200 <= status < 300
        except TransportError:
            is_ok = False
        if worker.record_health(is_ok, failure_threshold, cfg.success_threshold):
            if worker.is_healthy:
                logger.info("worker %s is now healthy", worker.worker_id)
            else:
                logger.warning("worker %s is now unhealthy", worker.worker_id)

    async def run_health_checks(self) -> None:
        """Forever: check every worker each ``health.interval_s``."""
        while True:
            await self.check_health_once()
            await asyncio.sleep(self._config.health.interval_s)

    async def poll_load_once(self) -> None:
        """Poll each worker's load endpoint once; a new start id is passed to the subscriber."""
        cfg = self._config.load_poll

        async def one(worker: WorkerRuntime) -> None:
            path = worker.config.load_path
            if path is None:
                return
            try:
                status, body = await self._getter.get_json(worker.worker_id, worker.config.url + path, cfg.timeout_s)
                if status != 200 or not isinstance(body, dict):
                    return
                load = msgspec.convert(body, WorkerLoad, strict=False)
            except TransportError:
                return
            except msgspec.ValidationError as exc:
                if not worker.has_logged_bad_load:
                    worker.has_logged_bad_load = True
                    logger.warning("worker %s: malformed load answer ignored (%s); its last good load is kept",
                                   worker.worker_id, exc)
                return
            worker.load = load
            if load.start_id is not None and load.start_id != worker.start_id:
                is_restart = worker.start_id is not None
                worker.start_id = load.start_id
                if self._on_start_id_changed is not None:
                    self._on_start_id_changed(worker, load.start_id)
                if is_restart:
                    logger.warning("worker %s restarted (start id %s)", worker.worker_id, load.start_id)

        await asyncio.gather(*(one(w) for w in list(self.workers.values())))

    async def run_load_polling(self) -> None:
        """Forever: poll every worker's load each ``load_poll.interval_s``."""
        while True:
            await self.poll_load_once()
            await asyncio.sleep(self._config.load_poll.interval_s)
