"""The ``discovery:`` section of the gateway config (``router.discovery`` runs it).

Split from ``router.discovery`` so that the config tree (``router.config.GatewayConfig.discovery``) holds the typed
section without importing the discovery loop. The YAML is documented in ``router.discovery``'s module docstring.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from router.errors import ConfigError
from router.worker_config import decode_worker

__all__ = ["OWNED_WORKER_KEYS", "DiscoveryConfig", "decode_discovery_config"]

OWNED_WORKER_KEYS = frozenset({"id", "url", "model", "events_endpoint", "replay_endpoint", "role"})


class DiscoveryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``discovery:`` section (see the module docstring for the YAML)."""

    label_selector: str
    """Label selector of the worker pods (``app=vllm,tier=decode``); must not be empty."""
    kind: Literal["kubernetes"] = "kubernetes"
    """Discovery backend; Kubernetes pods are the only one."""
    namespace: str = ""
    """Namespace to watch; empty means ``$POD_NAMESPACE``, else the service account's namespace."""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    """Worker HTTP port (OpenAI API, health, load)."""
    port_annotation: str = ""
    """Pod annotation whose value overrides ``port`` for that pod; empty disables it."""
    events_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = 5557
    """ZMQ PUB port of the worker's KV events; ``None``: the workers publish none (approximate mode)."""
    replay_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    """ZMQ ROUTER port of the worker's replay endpoint, or ``None``."""
    model: str = ""
    """Served model of a pod that names none through ``model_label``/``model_annotation``."""
    model_label: str = ""
    """Pod label naming the served model; empty disables it."""
    model_annotation: str = ""
    """Pod annotation naming the served model; empty disables it."""
    role_label: str = "kvgate.io/role"
    """Pod label giving the worker's ``role`` (``prefill``, ``decode``, ``both``; like SGLang's router's
    ``--prefill-selector role=prefill``); empty, absent or another value: ``both``."""
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"
    """Pod annotation giving a prefill worker's SGLang bootstrap port (the annotation SGLang's router reads)."""
    worker: dict[str, Any] = msgspec.field(default_factory=dict)
    """Further ``workers[]`` keys for every discovered worker (``pools``, ``dp_ranks``, ``load_path``...)."""
    kubeconfig: str = ""
    """Path of a kubeconfig (development); empty uses the in-cluster service account."""
    watch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    """Server-side timeout of one watch request, in seconds; the watch then resumes from the last resourceVersion."""
    backoff_initial_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    """Wait after the first failed list or watch, in seconds."""
    backoff_max_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Cap of the doubling wait between failed attempts, in seconds."""

    def __post_init__(self) -> None:
        if not self.label_selector.strip():
            raise ValueError("label_selector must not be empty (it would select every pod)")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        owned = sorted(OWNED_WORKER_KEYS & set(self.worker))
        if owned:
            raise ValueError(f"worker: {', '.join(owned)} come from the pod and cannot be set here")
        probe = {"id": "probe", "url": "http://127.0.0.1:1", "model": self.model or "probe", **self.worker}
        try:
            decode_worker(probe)
        except ConfigError as exc:
            raise ValueError(f"discovery.worker: {exc.message.removeprefix('worker: ')}") from exc


def decode_discovery_config(obj: object) -> DiscoveryConfig:
    """Decode the ``discovery:`` section alone (YAML/JSON builtins, or a ``DiscoveryConfig`` as is).

    Raises:
        ConfigError: naming the bad key and the reason.
    """
    try:
        return msgspec.convert(obj, DiscoveryConfig)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ConfigError(f"discovery: {exc}") from exc
