"""The gateway's configuration: one YAML file decoded into frozen, typed msgspec structs.

``load_config(path)`` reads the file, ``parse_config(obj)`` decodes an already-parsed mapping. Unknown keys are
rejected, every value is type-checked (a float must be finite: ``.nan`` and ``.inf`` are refused in every
section), and every cross-field rule is checked in ``__post_init__``; the error is a ``ConfigError`` naming the key
path (``$.workers[1].url``) and the reason. The policy section is decoded by ``policies.decode_policy_config`` and
the sessions section by ``router.sessions.config``; both are kept here as raw mappings (validated at load time) so
a policy can be replaced at run time through the admin API with the same decoder. ``deploy/gateway.example.yaml``
documents every key.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from events.errors import EventsConfigError
from events.publisher import offset_endpoint
from events.types import Medium, normalize_medium
from router.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a 200K-token prompt as text (~4 bytes/token, up to ~6x for JSON escapes of non-ASCII) or as a JSON
token-id array (~7 bytes/token) fits."""


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Frozen, strict struct base for every config section."""


MAX_DP_RANKS = 256
"""Most data-parallel ranks one worker may declare (``workers[].dp_ranks``). Each rank of a worker that publishes
events is one ZMQ subscription of the gateway (a SUB socket and its monitor); the subscriber's ZMQ context holds
about 340 of them in all (ZMQ's default of 1,023 sockets), so a larger fleet-wide total is refused when the worker
is added (nothing of it stays registered)."""

def _finite(name: str, value: float) -> None:
    """Refuse NaN and infinities (YAML ``.nan``, ``.inf``): every comparison with NaN is false, so range checks
    alone let it through, and no key of the config gives infinity a meaning."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _positive(name: str, value: float) -> None:
    _finite(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    _finite(name, value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def non_finite_value(obj: object) -> tuple[str, float] | None:
    """The key path (``$.timeouts.first_byte_s``) and value of the first NaN or infinite float in parsed YAML/JSON
    builtins (mappings, lists, scalars), or ``None`` when there is none.

    Walks without recursion and visits each container once (a YAML alias can make a list contain itself).
    """
    stack: list[tuple[str, object]] = [("$", obj)]
    seen: set[int] = set()
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path, value
        elif isinstance(value, dict | list | tuple):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                children = [(f"{path}.{key}", child) for key, child in value.items()]
            else:
                children = [(f"{path}[{i}]", child) for i, child in enumerate(value)]
            stack.extend(reversed(children))
    return None


class ListenConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the gateway listens.

    Attributes:
        host: bind address (loopback by default).
        port: TCP port; 0 picks a free one.
        max_body_bytes: request bodies over this get 413.
        body_timeout_s: a request body not fully received this many seconds after its headers gets 408 (a
            client sending slowly, or stalled, holds no connection and admission slot longer), seconds.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("body_timeout_s", self.body_timeout_s)


class ModelConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model the fleet serves, and how the gateway tokenizes and hashes its prompts.

    Tokens must equal the worker's, so the gateway uses the worker's own tokenization module with the same
    settings: ``tokenizer_path`` (a ``tokenizer.json``) or the byte-level default, and ``chat_template``.

    Attributes:
        name: the OpenAI ``model`` name clients send.
        tokenizer_path: path to a ``tokenizer.json``; ``None`` for the byte-level default.
        chat_template: path to a Jinja chat template, or ``None`` for the tokenization module's default.
        block_size: tokens per block of the engine's prefix cache.
        lora_adapters: model names that select a LoRA adapter on this base model; a request naming one is
            hashed in that adapter's namespace (vLLM feeds the adapter name into its block hash).
        honor_cache_salt: hash a request's ``cache_salt`` field into its namespace (vLLM semantics).
        default_max_tokens: ``max_tokens`` assumed when a request sends none, in tokens.
        enable_pending_blocks: when a request goes to a worker that publishes events, insert its full prompt
            blocks into the index as pending entries for that worker (``PrefixIndex.insert_approximate``), so a
            request routed right behind it predicts what the worker will have cached by the time it schedules
            that request, before the worker's events arrive (``router.routing``, step 5).
        pending_blocks_ttl_s: seconds a pending block lives unless the worker's ``BlockStored`` confirms it
            (then it is the event's and stops expiring); cover the queueing plus prefill time of a request.
    """

    name: str
    tokenizer_path: str | None = None
    chat_template: str | None = None
    block_size: int = 16
    lora_adapters: tuple[str, ...] = ()
    honor_cache_salt: bool = True
    default_max_tokens: int = 256
    enable_pending_blocks: bool = True
    pending_blocks_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        _positive("block_size", self.block_size)
        _positive("default_max_tokens", self.default_max_tokens)
        _positive("pending_blocks_ttl_s", self.pending_blocks_ttl_s)
        if self.tokenizer_path is not None and not Path(self.tokenizer_path).exists():
            raise ValueError(f"tokenizer_path {self.tokenizer_path!r} does not exist")


Topology = Literal["connect", "bind"]


class WorkerConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One worker (an engine process) behind the gateway.

    Attributes:
        id: unique worker id; in the ``bind`` topology it must equal the ``<worker>`` of the topic
            ``kv@<worker>@<model>`` the worker publishes with.
        url: OpenAI HTTP base URL, ``http(s)://host[:port]``, e.g. ``http://127.0.0.1:8001``; request paths
            (``/v1/completions``, ``health_path``...) are appended to it, so it takes no path, query or fragment (a
            trailing ``/`` is dropped).
        model: served model (one of ``models[].name``).
        events_endpoint: ZMQ PUB endpoint the gateway connects to (``connect`` topology), e.g.
            ``tcp://127.0.0.1:5557``. ``None`` with the ``connect`` topology means the worker publishes no
            events: the gateway routes it in approximate mode.
        replay_endpoint: ZMQ ROUTER endpoint serving replays after a sequence gap, or ``None``.
        topology: ``connect`` (gateway SUB connects to the worker's PUB) or ``bind`` (the worker's PUB connects
            to ``events.bind_endpoint``).
        dp_ranks: number of data-parallel ranks publishing events, 1..``MAX_DP_RANKS``. Rank ``r`` publishes on the
            port of ``events_endpoint`` (and serves replays on the port of ``replay_endpoint``) plus ``r``, vLLM's
            convention; every rank's port must be at most 65535.
        pools: shared pools (``MOONCAKE`` tier, or an engine's name for it) this worker is attached to; a worker's
            own tiers (``CPU``, ``DISK``) are refused.
        block_size: the worker's block size in tokens, a multiple of its model's ``block_size``; ``None`` takes the
            model's.
        load_path: the worker's load endpoint (polled; returns load and start id), or ``None``.
        snapshot_path: endpoint returning the worker's cached blocks as KV events (warm-up), or ``None``.
        health_path: active health check path. The three paths are appended to ``url``, so each starts with ``/``.
        time_scale: wall seconds per second of the worker's own clock, for a simulated worker run with
            ``kvgate worker --time-scale X`` (1 for real engines). The TTFT the gateway observes (wall time) is
            divided by it before it calibrates the cost model, whose constants are in the worker's seconds.
    """

    id: str
    url: str
    model: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    topology: Topology = "connect"
    dp_ranks: int = 1
    pools: tuple[str, ...] = ()
    block_size: int | None = None
    load_path: str | None = "/load"
    snapshot_path: str | None = "/kv/snapshot"
    health_path: str = "/health"
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        _positive("time_scale", self.time_scale)
        if not self.id:
            raise ValueError("id must not be empty")
        msgspec.structs.force_setattr(self, "url", _base_url(self.url))
        if not 1 <= self.dp_ranks <= MAX_DP_RANKS:
            raise ValueError(f"dp_ranks must be in 1..{MAX_DP_RANKS}, got {self.dp_ranks}")
        if self.topology == "connect":  # the bind topology has no per-worker events endpoint
            _check_rank_ports("events_endpoint", self.events_endpoint, self.dp_ranks)
        _check_rank_ports("replay_endpoint", self.replay_endpoint, self.dp_ranks)
        if self.block_size is not None:
            _positive("block_size", self.block_size)
        for pool in self.pools:
            if normalize_medium(pool) is not Medium.MOONCAKE:  # a worker's own tiers are never shared
                raise ValueError(f"pools: {pool!r} is not a shared pool tier; the shared tier is MOONCAKE (also "
                                 f"named EXTERNAL, STORAGE or L3)")
        for name, path in (("load_path", self.load_path), ("snapshot_path", self.snapshot_path),
                           ("health_path", self.health_path)):
            if path is not None and not path.startswith("/"):  # appended to url, which has no trailing "/"
                raise ValueError(f"{name} must start with '/', got {path!r}")

    @property
    def has_events(self) -> bool:
        """Whether the worker publishes KV events the gateway can read."""
        return self.topology == "bind" or self.events_endpoint is not None


def _base_url(url: str) -> str:
    """``url`` checked as a worker's base URL (``http(s)://host[:port]``), without a trailing ``/``.

    Raises:
        ValueError: another scheme, no host, a bad port, or a path, query or fragment (the message names ``url``).
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsing the port raises ValueError for a non-numeric one)
    except ValueError as exc:
        raise ValueError(f"url {url!r} does not parse: {exc}") from exc
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host")
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        raise ValueError(f"url must be a base URL, http(s)://host[:port], without a path, query or fragment "
                         f"(request paths such as /v1/completions are appended to it), got {url!r}")
    return url.removesuffix("/")


def _check_rank_ports(name: str, endpoint: str | None, dp_ranks: int) -> None:
    """Refuse an endpoint that the last data-parallel rank cannot use.

    Rank ``r`` uses ``events.publisher.offset_endpoint(endpoint, r)`` (vLLM's data-parallel convention: the port
    plus ``r``, or a ``_dp<r>`` suffix for ``ipc://`` and ``inproc://``); ``tcp://host:*`` is used as is by every
    rank.

    Raises:
        ValueError: naming the key, the endpoint and why (e.g. the last rank's port over 65535).
    """
    try:
        offset_endpoint(endpoint, dp_ranks - 1)
    except EventsConfigError as exc:
        raise ValueError(f"{name} {endpoint!r} with dp_ranks {dp_ranks}: {exc}") from exc


def worker_block_size_error(worker: WorkerConfig, model: ModelConfig) -> str | None:
    """Why ``worker`` cannot serve ``model`` with its block size, or ``None`` when it can.

    The model's prefix index hashes blocks of the model's ``block_size``; a worker's block events are split into
    whole index blocks, so a worker's ``block_size`` must be a multiple of it (else every event is refused).
    """
    if worker.block_size is None or worker.block_size % model.block_size == 0:
        return None
    return (f"block_size {worker.block_size} is not a multiple of the block_size {model.block_size} of its model "
            f"{model.name!r} (models[].block_size): its events could not be indexed")


class EventsConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The event path.

    Attributes:
        bind_endpoint: the SUB endpoint workers with ``topology: bind`` connect to, or ``None`` if none do.
        warmup_from_snapshot: warm a worker's index entries from its snapshot endpoint at start and on resync.
        subscriber: further ``events.subscriber.SubscriberConfig`` keys (kebab-case, e.g. ``replay-timeout-s``).
    """

    bind_endpoint: str | None = None
    warmup_from_snapshot: bool = True
    subscriber: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        from events.subscriber import SubscriberConfig  # the subscriber's own struct checks the keys and ranges

        try:
            msgspec.convert(self.subscriber, SubscriberConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"subscriber: {exc}") from exc
        found = non_finite_value(self.subscriber)  # its ranges (gt=0) let infinity through
        if found is not None:
            raise ValueError(f"subscriber: {found[0].removeprefix('$.')} must be a finite number, got {found[1]}")


class TimeoutsConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Upstream timeouts, in seconds (separate, explicit, as in httpx ``Timeout`` / aiohttp ``ClientTimeout``).

    Attributes:
        connect_s: to open a TCP connection to a worker (a pooled connection skips it).
        first_byte_s: from sending the request to the response headers.
        total_s: for the whole upstream exchange, streaming included; past it the exchange is cut (a 504 when
            nothing has reached the client yet, else the client's response is aborted).
    """

    connect_s: float = 2.0
    first_byte_s: float = 300.0
    total_s: float = 3600.0

    def __post_init__(self) -> None:
        _positive("connect_s", self.connect_s)
        _positive("first_byte_s", self.first_byte_s)
        _positive("total_s", self.total_s)
        if self.total_s < self.first_byte_s:
            raise ValueError("total_s must be >= first_byte_s")


class RetryConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Retries before the first byte reached the client (never after).

    Attributes:
        max_retries: extra attempts after the first, each on the next-best worker.
        backoff_initial_s: wait before the first retry.
        backoff_multiplier: growth of the wait per retry.
        backoff_max_s: cap of the wait.
    """

    max_retries: int = 2
    backoff_initial_s: float = 0.01
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 0.5

    def __post_init__(self) -> None:
        _non_negative("max_retries", self.max_retries)
        _non_negative("backoff_initial_s", self.backoff_initial_s)
        _finite("backoff_multiplier", self.backoff_multiplier)
        if not self.backoff_multiplier >= 1:
            raise ValueError("backoff_multiplier must be >= 1")
        _non_negative("backoff_max_s", self.backoff_max_s)

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number ``attempt`` (1-based), in seconds."""
        return float(min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** (attempt - 1)))


class AdmissionConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Admission control: the gateway never accepts work the fleet cannot start.

    Attributes:
        max_inflight_requests: global in-flight limit (0 = unlimited).
        max_inflight_per_worker: per-worker in-flight limit (0 = unlimited); a worker at it is not a candidate.
        queue_size: requests allowed to wait for a slot; past it, 429 at once.
        queue_timeout_s: longest wait for a slot before 429.
        retry_after_s: the ``Retry-After`` value sent with 429, in seconds.
    """

    max_inflight_requests: int = 0
    max_inflight_per_worker: int = 0
    queue_size: int = 256
    queue_timeout_s: float = 30.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        _non_negative("max_inflight_requests", self.max_inflight_requests)
        _non_negative("max_inflight_per_worker", self.max_inflight_per_worker)
        _non_negative("queue_size", self.queue_size)
        _positive("queue_timeout_s", self.queue_timeout_s)
        _positive("retry_after_s", self.retry_after_s)


class HealthConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Active health checks.

    Attributes:
        interval_s: time between checks of one worker.
        timeout_s: a check slower than this fails.
        failure_threshold: consecutive failures that mark a healthy worker unhealthy.
        success_threshold: consecutive successes that mark an unhealthy worker healthy.
    """

    interval_s: float = 5.0
    timeout_s: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2

    def __post_init__(self) -> None:
        _positive("interval_s", self.interval_s)
        _positive("timeout_s", self.timeout_s)
        _positive("failure_threshold", self.failure_threshold)
        _positive("success_threshold", self.success_threshold)


class CircuitBreakerConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-worker circuit breaker over proxied requests.

    Attributes:
        enabled: whether the breaker can open at all.
        failure_threshold: consecutive failed requests (connect error, 5xx, timeout) that open the circuit.
        open_s: how long an open circuit refuses traffic before letting one trial request through (half-open).
    """

    enabled: bool = True
    failure_threshold: int = 5
    open_s: float = 10.0

    def __post_init__(self) -> None:
        _positive("failure_threshold", self.failure_threshold)
        _positive("open_s", self.open_s)


class LoadPollConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Polling of each worker's load endpoint.

    Attributes:
        interval_s: time between polls of one worker.
        timeout_s: a poll slower than this is skipped.
    """

    interval_s: float = 1.0
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        _positive("interval_s", self.interval_s)
        _positive("timeout_s", self.timeout_s)


class AdminConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The admin REST API under ``/admin``.

    Attributes:
        token: bearer token; ``None`` reads ``token_env``.
        token_env: environment variable holding the token.
        disable_auth: serve ``/admin`` without a token (local use only). Without a token and without this flag
            the config is refused.
        num_recent_decisions: decisions kept for ``/admin/decisions``.
    """

    token: str | None = None
    token_env: str = "KVGATE_ADMIN_TOKEN"
    disable_auth: bool = False
    num_recent_decisions: int = 256

    def __post_init__(self) -> None:
        _positive("num_recent_decisions", self.num_recent_decisions)

    def resolve_token(self) -> str | None:
        """The token from config, else from the environment; ``None`` when auth is disabled."""
        if self.disable_auth:
            return None
        token = self.token or os.environ.get(self.token_env) or None
        if token is None:
            raise ConfigError(
                f"admin: no token (set admin.token or ${self.token_env}, or admin.disable_auth: true for local use)"
            )
        return token


class GatewayConfig(_Base, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole gateway configuration (``kvgate serve --config FILE``).

    Attributes:
        listen: listen address and body limit.
        models: served models (at least one).
        workers: workers known at start (more can be added through the admin API).
        events: the event path.
        policy: routing policy config, decoded by ``policies.decode_policy_config`` (tagged by ``name``); by default
            ``session_sticky`` wrapping ``cache_aware``, each with its own defaults.
        sessions: session store config, decoded by ``router.sessions.config``.
        timeouts: upstream timeouts.
        retry: retries before the first byte.
        admission: in-flight limits and the wait queue.
        health: active health checks.
        circuit_breaker: per-worker breaker.
        load_poll: load endpoint polling.
        admin: admin API auth.
        ready_timeout_s: ``/ready`` turns true at the latest this long after start, even if some worker's index
            entries are not warm yet.
        index: prefix index settings (``router.index.config.IndexConfig`` keys, kebab-case, without
            ``block-size``, which comes from each model): one index per model.
        session_key_sources: where the session key comes from when the policy is not ``session_sticky`` (which
            has its own ``key_sources``): ``x-session-id``, ``x-smg-routing-key``, ``user``, ``opening_blocks``.
        discovery: Kubernetes worker discovery, decoded by ``router.discovery``; ``None`` disables it.
    """

    models: tuple[ModelConfig, ...]
    workers: tuple[WorkerConfig, ...] = ()
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    policy: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"name": "session_sticky", "inner": {"name": "cache_aware"}}
    )
    sessions: dict[str, Any] = msgspec.field(default_factory=dict)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    circuit_breaker: CircuitBreakerConfig = msgspec.field(default_factory=CircuitBreakerConfig)
    load_poll: LoadPollConfig = msgspec.field(default_factory=LoadPollConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    ready_timeout_s: float = 30.0
    index: dict[str, Any] = msgspec.field(default_factory=dict)
    session_key_sources: tuple[Literal["x-session-id", "x-smg-routing-key", "user", "opening_blocks"], ...] = (
        "x-session-id", "x-smg-routing-key", "user")
    discovery: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must list at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("models: duplicate model name")
        all_names = set(names) | {a for m in self.models for a in m.lora_adapters}
        ids: set[str] = set()
        for i, worker in enumerate(self.workers):
            if worker.id in ids:
                raise ValueError(f"workers: duplicate id {worker.id!r}")
            ids.add(worker.id)
            if worker.model not in all_names:
                raise ValueError(f"workers: worker {worker.id!r} serves unknown model {worker.model!r}")
            if worker.topology == "bind" and self.events.bind_endpoint is None:
                raise ValueError(f"workers: worker {worker.id!r} uses topology bind but events.bind_endpoint is unset")
            model = self.model(worker.model)
            error = worker_block_size_error(worker, model) if model is not None else None
            if error is not None:
                raise ValueError(f"workers[{i}].{error}")
        _positive("ready_timeout_s", self.ready_timeout_s)

    def model(self, name: str) -> ModelConfig | None:
        """The model config serving ``name`` (a base model name or one of its LoRA adapters)."""
        for model in self.models:
            if model.name == name or name in model.lora_adapters:
                return model
        return None


def decode_worker(obj: object) -> WorkerConfig:
    """Decode one worker (admin API payload) with the same rules as the YAML.

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    try:
        return msgspec.convert(obj, WorkerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"worker: {exc}") from exc


def validate_policy(obj: dict[str, Any]) -> Any:
    """Decode a policy section through the policies registry; returns the typed policy config.

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    from policies import decode_policy_config  # local: policies imports nothing from router

    try:
        return decode_policy_config(obj)
    except (msgspec.ValidationError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"policy: {exc}") from exc


def validate_sessions(obj: dict[str, Any]) -> Any:
    """Decode the sessions section into ``router.sessions.config.SessionsConfig``.

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    from router.sessions.config import SessionsConfig

    try:
        return msgspec.convert(obj, SessionsConfig)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ConfigError(f"sessions: {exc}") from exc


def index_config(config: GatewayConfig, model: ModelConfig) -> Any:
    """The ``IndexConfig`` of ``model``'s prefix index (the ``index`` section with the model's block size).

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    from router.index.config import IndexConfig

    try:
        return msgspec.convert({**config.index, "block-size": model.block_size}, IndexConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"index: {exc}") from exc


def parse_config(obj: object, *, validate_sections: bool = True) -> GatewayConfig:
    """Decode a parsed YAML/JSON mapping.

    Args:
        obj: the mapping.
        validate_sections: also decode ``policy`` and ``sessions`` through their packages.

    Raises:
        ConfigError: the message names the key path and the reason, e.g.
            ``Expected `int`, got `str` - at `$.listen.port```. NaN and infinities (YAML ``.nan``, ``.inf``) are
            refused in every section: ``Expected a finite number, got nan - at `$.health.interval_s```.
    """
    if not isinstance(obj, dict):
        raise ConfigError("config: the top level must be a mapping")
    found = non_finite_value(obj)  # every section, those decoded by other packages included
    if found is not None:
        raise ConfigError(f"config: Expected a finite number, got {found[1]} - at `{found[0]}`")
    try:
        config = msgspec.convert(obj, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config: {exc}") from exc
    if validate_sections:
        validate_policy(config.policy)
        validate_sessions(config.sessions)
        if config.discovery is not None:
            from router.discovery import decode_discovery_config

            decode_discovery_config(config.discovery)
        for model in config.models:
            index_config(config, model)
        config.admin.resolve_token()
    return config


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and decode a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or an invalid value (key path and reason in the message).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: invalid YAML in {path}: {exc}") from exc
    return parse_config(obj)
