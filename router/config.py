"""The gateway's configuration: one YAML file decoded once into one tree of frozen, typed msgspec structs.

``load_config(path)`` reads the file, ``parse_config(obj)`` decodes an already-parsed mapping into a
``GatewayConfig``; every section is a struct of the tree, decoded in the same pass and passed down as is (the
policy by ``policies.decode_policy_config``, the decoder ``PUT /admin/policy`` uses; sessions, the prefix index,
the event subscriber and discovery by their own packages' structs). Keys are snake_case, the field names
(``router.config_base``; the old kebab-case keys of ``events.subscriber`` and ``index`` are still accepted for one
release, with a warning naming the new key). Unknown keys are rejected, every value is type-checked (a float must
be finite: ``.nan`` and ``.inf`` are refused in every section), and every cross-field rule is checked in
``__post_init__``; the error is a ``ConfigError`` naming the key path (``$.workers[1].url``,
``$.policy.inner.temperature``) and the reason. ``deploy/gateway.example.yaml`` documents every key.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from common.yaml_load import safe_load_yaml
from events.subscriber import SubscriberConfig
from policies import PolicyConfigError, decode_policy_config
from policies.config import CacheAwareConfig, PolicyConfig, SessionStickyConfig
from router.config_base import (
    AtLeastOne,
    ConfigStruct,
    Count,
    NonNegativeSeconds,
    Port,
    PositiveSeconds,
    check_finite,
    check_non_negative,
    check_positive,
    non_finite_value,
    rename_deprecated_keys,
)
from router.discovery_config import DiscoveryConfig
from router.epp_config import EndpointPickerConfig
from router.errors import ConfigError
from router.index.config import IndexConfig
from router.pool_watch_config import PoolWatchConfig
from router.sessions.config import SessionsConfig
from router.tracing_config import TracingConfig
from router.worker_config import (
    MAX_DP_RANKS,
    ModelConfig,
    Topology,
    WorkerConfig,
    decode_worker,
    worker_block_size_error,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "MAX_DP_RANKS",
    "AdminConfig",
    "AdmissionConfig",
    "CircuitBreakerConfig",
    "EventsConfig",
    "GatewayConfig",
    "HealthConfig",
    "ListenConfig",
    "LoadPollConfig",
    "ModelConfig",
    "RetryConfig",
    "TimeoutsConfig",
    "Topology",
    "WorkerConfig",
    "decode_worker",
    "index_config",
    "load_config",
    "non_finite_value",
    "parse_config",
    "validate_policy",
    "validate_sessions",
    "worker_block_size_error",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024
"""A non-streamed worker answer is read whole before it is relayed; past this many bytes it is a 502."""
"""16 MiB: a 200K-token prompt as text (~4 bytes/token, up to ~6x for JSON escapes of non-ASCII) or as a JSON
token-id array (~7 bytes/token) fits."""


class ListenConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the gateway listens.

    Attributes:
        host: bind address (loopback by default).
        port: TCP port; 0 picks a free one.
        max_body_bytes: request bodies over this get 413.
        body_timeout_s: a request body not fully received this many seconds after its headers gets 408 (a
            client sending slowly, or stalled, holds no connection and admission slot longer), seconds.
        shutdown_grace_s: a graceful stop (SIGTERM) waits this long for the requests in flight, then ends each
            stream still relayed with an error event (``router.drain``), seconds; a supervisor's kill timeout must
            exceed it by a few seconds (Kubernetes' ``terminationGracePeriodSeconds``, 30 by default).
    """

    host: str = "127.0.0.1"
    port: Port = 8080
    max_body_bytes: AtLeastOne = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        check_positive("max_body_bytes", self.max_body_bytes)
        check_positive("body_timeout_s", self.body_timeout_s)
        check_non_negative("shutdown_grace_s", self.shutdown_grace_s)

class EventsConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The event path.

    Attributes:
        bind_endpoint: the SUB endpoint workers with ``topology: bind`` connect to, or ``None`` if none do.
        warmup_from_snapshot: warm a worker's index entries from its snapshot endpoint at start and on resync.
        snapshot_timeout_s: limit of one snapshot fetch, seconds. A snapshot is the worker's whole cache (about
            100 bytes per block: megabytes for a large cache), so it gets longer than a health check.
        subscriber: the event subscriber's settings (``events.subscriber.SubscriberConfig``, e.g.
            ``replay_timeout_s``); its ``bind_endpoint`` is this section's (``subscriber_config()``).
    """

    bind_endpoint: str | None = None
    warmup_from_snapshot: bool = True
    snapshot_timeout_s: PositiveSeconds = 30.0
    subscriber: SubscriberConfig = msgspec.field(default_factory=SubscriberConfig)

    def __post_init__(self) -> None:
        found = non_finite_value(msgspec.to_builtins(self.subscriber))  # its ranges (gt=0) let infinity through
        if found is not None:
            raise ValueError(f"subscriber: {found[0].removeprefix('$.')} must be a finite number, got {found[1]}")

    def subscriber_config(self) -> SubscriberConfig:
        """The subscriber's settings with this section's ``bind_endpoint``."""
        return msgspec.structs.replace(self.subscriber, bind_endpoint=self.bind_endpoint)


class TimeoutsConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
        check_positive("connect_s", self.connect_s)
        check_positive("first_byte_s", self.first_byte_s)
        check_positive("total_s", self.total_s)
        if self.total_s < self.first_byte_s:
            raise ValueError("total_s must be >= first_byte_s")


class RetryConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Retries before the first byte reached the client (never after).

    Attributes:
        max_retries: extra attempts after the first, each on the next-best worker.
        backoff_initial_s: wait before the first retry.
        backoff_multiplier: growth of the wait per retry.
        backoff_max_s: cap of the wait.
    """

    max_retries: Count = 2
    backoff_initial_s: NonNegativeSeconds = 0.01
    backoff_multiplier: Annotated[float, msgspec.Meta(ge=1.0)] = 2.0
    backoff_max_s: NonNegativeSeconds = 0.5

    def __post_init__(self) -> None:
        check_non_negative("max_retries", self.max_retries)
        check_non_negative("backoff_initial_s", self.backoff_initial_s)
        check_finite("backoff_multiplier", self.backoff_multiplier)
        if not self.backoff_multiplier >= 1:
            raise ValueError("backoff_multiplier must be >= 1")
        check_non_negative("backoff_max_s", self.backoff_max_s)

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number ``attempt`` (1-based), in seconds."""
        return float(min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** (attempt - 1)))


class AdmissionConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Admission control: the gateway never accepts work the fleet cannot start.

    Attributes:
        max_inflight_requests: global in-flight limit (0 = unlimited).
        max_inflight_per_worker: per-worker in-flight limit (0 = unlimited); a worker at it is not a candidate.
        queue_size: requests allowed to wait for a slot; past it, 429 at once.
        queue_timeout_s: longest wait for a slot before 429.
        retry_after_s: the ``Retry-After`` value sent with 429, in seconds.
    """

    max_inflight_requests: Count = 0
    max_inflight_per_worker: Count = 0
    queue_size: Count = 256
    queue_timeout_s: PositiveSeconds = 30.0
    retry_after_s: PositiveSeconds = 1.0

    def __post_init__(self) -> None:
        check_non_negative("max_inflight_requests", self.max_inflight_requests)
        check_non_negative("max_inflight_per_worker", self.max_inflight_per_worker)
        check_non_negative("queue_size", self.queue_size)
        check_positive("queue_timeout_s", self.queue_timeout_s)
        check_positive("retry_after_s", self.retry_after_s)


class HealthConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Active health checks.

    Attributes:
        interval_s: time between checks of one worker.
        timeout_s: a check slower than this fails.
        failure_threshold: consecutive failures that mark a healthy worker unhealthy.
        success_threshold: consecutive successes that mark an unhealthy worker healthy.
    """

    interval_s: PositiveSeconds = 5.0
    timeout_s: PositiveSeconds = 2.0
    failure_threshold: AtLeastOne = 3
    success_threshold: AtLeastOne = 2

    def __post_init__(self) -> None:
        check_positive("interval_s", self.interval_s)
        check_positive("timeout_s", self.timeout_s)
        check_positive("failure_threshold", self.failure_threshold)
        check_positive("success_threshold", self.success_threshold)


class CircuitBreakerConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-worker circuit breaker over proxied requests.

    Attributes:
        enabled: whether the breaker can open at all.
        failure_threshold: consecutive failed requests (connect error, 5xx, timeout) that open the circuit.
        open_s: how long an open circuit refuses traffic before letting one trial request through (half-open).
    """

    enabled: bool = True
    failure_threshold: AtLeastOne = 5
    open_s: PositiveSeconds = 10.0

    def __post_init__(self) -> None:
        check_positive("failure_threshold", self.failure_threshold)
        check_positive("open_s", self.open_s)


class LoadPollConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Polling of each worker's load endpoint.

    Attributes:
        interval_s: time between polls of one worker.
        timeout_s: a poll slower than this is skipped.
    """

    interval_s: PositiveSeconds = 1.0
    timeout_s: PositiveSeconds = 1.0

    def __post_init__(self) -> None:
        check_positive("interval_s", self.interval_s)
        check_positive("timeout_s", self.timeout_s)


class AdminConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
    num_recent_decisions: AtLeastOne = 256

    def __post_init__(self) -> None:
        check_positive("num_recent_decisions", self.num_recent_decisions)

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


class MemoryConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Returning freed memory to the kernel (``common.process_stats.HeapTrimmer``).

    Attributes:
        enable_trim: run ``malloc_trim`` (glibc) right after a worker is removed or an index cleared, and at a
            periodic check when the C heap's arenas' free bytes grew by at least ``trim_min_free_bytes`` since the
            last trim (``HeapTrimmer.trim_once``); without it the process's RSS stays at its peak after its caches
            and index shrink.
        trim_interval_s: seconds between checks (a check is one ``mallinfo2``; a trim walks the free lists).
        trim_min_free_bytes: growth of the arenas' free bytes since the last trim below which a periodic check does
            not trim.
    """

    enable_trim: bool = True
    trim_interval_s: PositiveSeconds = 30.0
    trim_min_free_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 20

    def __post_init__(self) -> None:
        check_positive("trim_interval_s", self.trim_interval_s)


class GatewayConfig(ConfigStruct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole gateway configuration (``kvgate serve --config FILE``).

    Attributes:
        listen: listen address and body limit.
        models: served models (at least one).
        workers: workers known at start (more can be added through the admin API).
        events: the event path.
        policy: routing policy config (``policies.config``, tagged by ``name``), decoded by
            ``policies.decode_policy_config`` as ``PUT /admin/policy`` is; by default ``session_sticky`` wrapping
            ``cache_aware``, each with its own defaults.
        sessions: session store config (``router.sessions.config.SessionsConfig``).
        timeouts: upstream timeouts.
        retry: retries before the first byte.
        admission: in-flight limits and the wait queue.
        health: active health checks.
        circuit_breaker: per-worker breaker.
        load_poll: load endpoint polling.
        admin: admin API auth.
        ready_timeout_s: ``/ready`` turns true at the latest this long after start, even if some worker's index
            entries are not warm yet.
        index: prefix index settings (``router.index.config.IndexConfig``): one index per model, whose
            ``block_size`` is the model's (``index_config``), whatever this section says.
        session_key_sources: where the session key comes from when the policy is not ``session_sticky`` (which
            has its own ``key_sources``): ``x-session-id``, ``x-smg-routing-key``, ``user``, ``opening_blocks``.
        discovery: Kubernetes worker discovery (``router.discovery_config.DiscoveryConfig``); ``None`` disables it.
        max_response_bytes: a non-streamed worker answer (read whole before it is relayed) over this many bytes
            gets the client a 502 (``upstream_error``); streams are relayed chunk by chunk, uncapped.
        memory: returning freed memory to the kernel (``MemoryConfig``).
        tracing: OpenTelemetry request traces (``router.tracing_config.TracingConfig``); off by default.
        endpoint_picker: the Gateway API Inference Extension's Endpoint Picker, an Envoy ext_proc server
            (``router.epp_config.EndpointPickerConfig``); ``None`` (default) runs none.
        pool_watch: the pool watcher (``router.pool_watch_config.PoolWatchConfig``): drops the index's pool
            entries the Mooncake master evicted or lost; ``None`` (default) runs none.
    """

    models: tuple[ModelConfig, ...]
    workers: tuple[WorkerConfig, ...] = ()
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    policy: PolicyConfig = msgspec.field(default_factory=lambda: SessionStickyConfig(inner=CacheAwareConfig()))
    sessions: SessionsConfig = msgspec.field(default_factory=SessionsConfig)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    circuit_breaker: CircuitBreakerConfig = msgspec.field(default_factory=CircuitBreakerConfig)
    load_poll: LoadPollConfig = msgspec.field(default_factory=LoadPollConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    ready_timeout_s: PositiveSeconds = 30.0
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    session_key_sources: tuple[Literal["x-session-id", "x-smg-routing-key", "user", "opening_blocks"], ...] = (
        "x-session-id", "x-smg-routing-key", "user")
    discovery: DiscoveryConfig | None = None
    max_response_bytes: AtLeastOne = DEFAULT_MAX_RESPONSE_BYTES
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    endpoint_picker: EndpointPickerConfig | None = None
    pool_watch: PoolWatchConfig | None = None

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
        check_positive("ready_timeout_s", self.ready_timeout_s)

    def model(self, name: str) -> ModelConfig | None:
        """The model config serving ``name`` (a base model name or one of its LoRA adapters)."""
        for model in self.models:
            if model.name == name or name in model.lora_adapters:
                return model
        return None

def validate_policy(obj: object) -> PolicyConfig:
    """Decode a policy section (YAML/JSON builtins, JSON text, or a config struct) the way ``parse_config`` and
    ``PUT /admin/policy`` do.

    Raises:
        ConfigError: ``config: <reason> - at `$.policy.<key>```.
    """
    try:
        return decode_policy_config(obj)
    except PolicyConfigError as exc:
        where = f"$.policy.{exc.key}" if exc.key else "$.policy"
        raise ConfigError(f"config: {exc.reason} - at `{where}`") from exc


def validate_sessions(obj: object) -> SessionsConfig:
    """Decode a sessions section (YAML/JSON builtins, or a ``SessionsConfig`` as is).

    Raises:
        ConfigError: ``config: <reason> - at `$.sessions...```.
    """
    try:
        return msgspec.convert(obj, SessionsConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config: {_under(str(exc), '$.sessions')}") from exc


def _under(message: str, prefix: str) -> str:
    """A msgspec message about a section decoded alone, its key path put under the section's (``prefix``)."""
    reason, sep, path = message.rpartition(" - at `$")
    if not sep:
        return f"{message} - at `{prefix}`"
    return f"{reason} - at `{prefix}{path}"


def index_config(config: GatewayConfig, model: ModelConfig) -> IndexConfig:
    """The ``IndexConfig`` of ``model``'s prefix index: the ``index`` section with the model's block size.

    Raises:
        ConfigError: the section cannot take that block size (naming ``index`` and the reason).
    """
    try:
        return msgspec.structs.replace(config.index, block_size=model.block_size)
    except ValueError as exc:
        raise ConfigError(f"config: {exc} - at `$.index`") from exc


def parse_config(obj: object) -> GatewayConfig:
    """Decode a parsed YAML/JSON mapping into the config tree, once.

    Old-style (kebab-case) keys are renamed to their snake_case fields first, each logged once as a deprecation
    warning naming the new key (``router.config_base.rename_deprecated_keys``).

    Raises:
        ConfigError: the message names the key path and the reason, e.g.
            ``Expected `int`, got `str` - at `$.listen.port``` or
            ``Expected `float` >= 0.0 - at `$.policy.inner.temperature```. NaN and infinities (YAML ``.nan``,
            ``.inf``) are refused in every section: ``Expected a finite number, got nan - at `$.health.interval_s```.
    """
    if not isinstance(obj, dict):
        raise ConfigError("config: the top level must be a mapping")
    found = non_finite_value(obj)  # every section; msgspec's float ranges let infinity through
    if found is not None:
        raise ConfigError(f"config: Expected a finite number, got {found[1]} - at `{found[0]}`")
    renamed, deprecated = rename_deprecated_keys(obj, GatewayConfig)
    for key in deprecated:
        logger.warning("config: key %s is deprecated and will be refused in the next release; write %s instead",
                       key.old, key.new)
    assert isinstance(renamed, dict)  # a mapping stays a mapping
    if "policy" in renamed:  # the policy goes through its own decoder, the one PUT /admin/policy uses
        renamed = {**renamed, "policy": validate_policy(renamed["policy"])}
    try:
        config = msgspec.convert(renamed, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config: {exc}") from exc
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
        obj = safe_load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: invalid YAML in {path}: {exc}") from exc
    return parse_config(obj)

