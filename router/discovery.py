"""Kubernetes worker discovery: worker pods found by label selector become workers of the gateway's fleet.

The ``discovery:`` section of the gateway config (every key but ``label_selector`` optional; defaults shown)::

    discovery:
      kind: kubernetes
      namespace: ""                 # "" = $POD_NAMESPACE, else the service account's namespace
      label_selector: app=vllm      # required: which pods are workers
      port: 8000                    # worker HTTP port (OpenAI API)
      port_annotation: ""           # e.g. kvgate.io/port: a pod annotation overriding `port`
      events_port: 5557             # ZMQ PUB port of the worker's KV events; null = no events (approximate mode)
      replay_port: null             # ZMQ ROUTER port answering replays, or null
      model: ""                     # served model when the pod names none
      model_label: ""               # e.g. kvgate.io/model: pod label naming the served model
      model_annotation: ""          # or a pod annotation naming it (the label wins when both are set)
      role_label: kvgate.io/role    # pod label: prefill | decode | both (absent: both)
      bootstrap_port_annotation: sglang.ai/bootstrap-port   # a prefill pod's SGLang bootstrap port
      worker: {}                    # further workers[] keys for every discovered worker (pools, load_path, ...)
      kubeconfig: ""                # "" = in-cluster service account; a path = that kubeconfig (development)
      watch_timeout_s: 300          # server-side timeout of one watch request
      backoff_initial_s: 0.5        # wait after a failed list or watch, doubling up to backoff_max_s
      backoff_max_s: 30

A pod is a worker while it is ``Running``, its ``Ready`` condition is ``True``, it has a pod IP and it is not being
deleted; the kubelet's readiness probe on the worker thus decides when it joins, and the gateway's own health checks
and circuit breaker come on top. Each pod becomes one worker::

    id               pod name
    url              http://<podIP>:<port>           ([<podIP>] for IPv6)
    events_endpoint  tcp://<podIP>:<events_port>     (connect topology: every gateway replica subscribes itself)
    replay_endpoint  tcp://<podIP>:<replay_port>
    model            label, then annotation, then `model`
    role             the `role_label` label (prefill, decode; anything else: both)
    bootstrap_port   the `bootstrap_port_annotation` annotation, when it holds a port

The loop (``PodDiscovery.run``)::

    list pods (selector) ──► reconcile fleet to the list ──► watch from the list's resourceVersion
        ▲                                                        │ ADDED / MODIFIED: add, replace or remove
        │                                                        │ DELETED: remove   BOOKMARK: new resourceVersion
        │                                                        │ stream end (timeout): watch again from the last rv
        └──── 410 Gone (resourceVersion too old) ◄───────────────┤
        └──── any other error: wait backoff (doubling, capped), then list again

Only workers this module added are ever removed by it; workers from ``workers:`` or the admin API are left alone,
and a pod whose name is already a worker id it does not own is skipped. ``kubernetes_asyncio`` is an optional
dependency (the ``k8s`` extra) imported only when discovery runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from router.config import GatewayConfig, WorkerConfig, decode_worker
from router.discovery_config import OWNED_WORKER_KEYS as _OWNED_WORKER_KEYS  # noqa: F401
from router.discovery_config import DiscoveryConfig as DiscoveryConfig
from router.discovery_config import decode_discovery_config as decode_discovery_config
from router.errors import ConfigError, GatewayError

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""Where Kubernetes mounts the pod's namespace next to the service-account token."""

def resolve_namespace(config: DiscoveryConfig, environ: Mapping[str, str] | None = None,
                      namespace_path: str = SERVICE_ACCOUNT_NAMESPACE_PATH) -> str:
    """The namespace to watch: the config's, else ``$POD_NAMESPACE``, else the service account's.

    Raises:
        ConfigError: none of the three is set.
    """
    if config.namespace:
        return config.namespace
    env = os.environ if environ is None else environ
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        namespace = Path(namespace_path).read_text(encoding="utf-8").strip()
    except OSError:
        namespace = ""
    if not namespace:
        raise ConfigError("discovery: no namespace (set discovery.namespace or $POD_NAMESPACE)")
    return namespace


def _is_ready(pod: Mapping[str, Any]) -> bool:
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def pod_to_worker(config: DiscoveryConfig, pod: Mapping[str, Any]) -> WorkerConfig | None:
    """The worker a pod stands for, or ``None`` while it is not a routable worker.

    Args:
        config: the discovery config.
        pod: the pod as the Kubernetes API serializes it (camelCase JSON: ``metadata``, ``status.podIP``...).

    Returns:
        The worker config, or ``None`` when the pod is not Running and Ready, has no IP, is being deleted, names
        no model, or carries an unusable port annotation (the last two are logged).
    """
    if not _is_ready(pod):
        return None
    metadata = pod.get("metadata") or {}
    name = str(metadata.get("name") or "")
    labels: Mapping[str, str] = metadata.get("labels") or {}
    annotations: Mapping[str, str] = metadata.get("annotations") or {}
    model = (labels.get(config.model_label, "") if config.model_label else "") or (
        annotations.get(config.model_annotation, "") if config.model_annotation else "") or config.model
    if not model:
        logger.warning("pod %s names no model (label %r, annotation %r) and discovery.model is empty; skipped",
                       name, config.model_label, config.model_annotation)
        return None
    port = config.port
    if config.port_annotation and config.port_annotation in annotations:
        raw_port = annotations[config.port_annotation]
        if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
            logger.warning("pod %s: annotation %s=%r is not a port; skipped", name, config.port_annotation, raw_port)
            return None
        port = int(raw_port)
    ip = str(pod["status"]["podIP"])
    host = f"[{ip}]" if ":" in ip else ip
    fields: dict[str, Any] = {
        **config.worker,
        "id": name,
        "url": f"http://{host}:{port}",
        "model": model,
        "events_endpoint": f"tcp://{host}:{config.events_port}" if config.events_port is not None else None,
        "replay_endpoint": f"tcp://{host}:{config.replay_port}" if config.replay_port is not None else None,
    }
    role = labels.get(config.role_label, "") if config.role_label else ""
    fields["role"] = role if role in ("prefill", "decode") else "both"
    bootstrap = annotations.get(config.bootstrap_port_annotation, "") if config.bootstrap_port_annotation else ""
    if bootstrap.isdigit() and 1 <= int(bootstrap) <= 65535:
        fields["bootstrap_port"] = int(bootstrap)
    return decode_worker(fields)


class WorkerRegistry(Protocol):
    """What discovery drives: the gateway's worker registration (``router.gateway.Gateway``)."""

    async def add_worker(self, config: WorkerConfig) -> object: ...

    async def remove_worker(self, worker_id: str) -> object: ...


class ResourceVersionExpired(Exception):
    """The watch's resourceVersion is too old (HTTP 410 Gone): list again."""


class PodDiscovery:
    """List-then-watch of worker pods, reconciling the fleet to the pods that are Running and Ready.

    Attributes:
        workers: the workers this discovery added, by worker id (pod name).
        resource_version: the last resourceVersion seen (from a list, an event or a bookmark).
        num_lists: successful lists so far.
        num_gone: watches ended by 410 Gone.
        num_errors: failed lists or watches (each followed by a backoff wait).
    """

    def __init__(self, config: DiscoveryConfig, registry: WorkerRegistry, core_api: Any, namespace: str) -> None:
        """
        Args:
            config: the discovery config.
            registry: the fleet to add workers to and remove them from.
            core_api: a ``kubernetes_asyncio.client.CoreV1Api`` (its API client is owned by the caller).
            namespace: the namespace to watch.
        """
        self._config = config
        self._registry = registry
        self._core_api = core_api
        self._namespace = namespace
        self.workers: dict[str, WorkerConfig] = {}
        self.resource_version = ""
        self.num_lists = 0
        self.num_gone = 0
        self.num_errors = 0

    # -- reconciliation ----------------------------------------------------------------------------------------

    async def _remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        try:
            await self._registry.remove_worker(worker_id)
        except GatewayError as exc:  # removed meanwhile through the admin API
            logger.info("discovered worker %s already gone: %s", worker_id, exc)

    async def _apply(self, name: str, worker: WorkerConfig | None) -> None:
        """Make the fleet hold ``worker`` under ``name`` (``None``: hold nothing)."""
        current = self.workers.get(name)
        if current == worker:
            return
        if current is not None:
            logger.info("pod %s: worker %s", name, "changed" if worker is not None else "no longer ready")
            await self._remove(name)
        if worker is None:
            return
        try:
            await self._registry.add_worker(worker)
        except ConfigError as exc:
            logger.warning("pod %s not added: %s", name, exc.message)
            return
        self.workers[name] = worker

    async def _apply_pod(self, pod: Mapping[str, Any]) -> None:
        name = str((pod.get("metadata") or {}).get("name") or "")
        if name:
            await self._apply(name, pod_to_worker(self._config, pod))

    async def list_and_reconcile(self) -> None:
        """List the pods and make the discovered workers equal to the Running and Ready ones."""
        from kubernetes_asyncio.client.exceptions import ApiException

        # Raw JSON (no model objects): the same parsing as the watch's raw_object. Unpreloaded, the client leaves
        # the status check to us.
        resp = await self._core_api.list_namespaced_pod(
            self._namespace, label_selector=self._config.label_selector, _preload_content=False)
        try:
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=resp.reason)
            pod_list = json.loads(await resp.read())
        finally:
            resp.release()
        pods = {str(p["metadata"]["name"]): p for p in pod_list.get("items") or ()}
        for name in [n for n in self.workers if n not in pods]:
            logger.info("pod %s gone", name)
            await self._remove(name)
        for pod in pods.values():
            await self._apply_pod(pod)
        self.resource_version = str((pod_list.get("metadata") or {}).get("resourceVersion") or "")
        self.num_lists += 1

    async def watch_once(self) -> None:
        """Apply watch events from ``resource_version`` until the server ends the stream.

        Raises:
            ResourceVersionExpired: the server answered 410 Gone.
        """
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        stream = watch.Watch()
        try:
            async with stream.stream(
                self._core_api.list_namespaced_pod, self._namespace, label_selector=self._config.label_selector,
                resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self._config.watch_timeout_s)),
            ) as events:
                async for event in events:
                    await self._on_event(str(event["type"]), event["raw_object"])
        except ApiException as exc:
            if exc.status == 410:
                raise ResourceVersionExpired(str(exc.reason)) from exc
            raise

    async def _on_event(self, event_type: str, pod: Mapping[str, Any]) -> None:
        rv = str((pod.get("metadata") or {}).get("resourceVersion") or "")
        if event_type in ("ADDED", "MODIFIED"):
            await self._apply_pod(pod)
        elif event_type == "DELETED":
            name = str((pod.get("metadata") or {}).get("name") or "")
            if name in self.workers:
                logger.info("pod %s deleted", name)
                await self._remove(name)
        if rv:
            self.resource_version = rv

    # -- the loop ----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: list, then watch; re-list on 410 Gone; back off and re-list on any other failure."""
        backoff_s = self._config.backoff_initial_s
        is_listed = False
        while True:
            try:
                if not is_listed:
                    await self.list_and_reconcile()
                    is_listed = True
                    logger.info("discovery: %d worker pod(s) ready in %s (%s)", len(self.workers),
                                self._namespace, self._config.label_selector)
                await self.watch_once()
                backoff_s = self._config.backoff_initial_s
            except asyncio.CancelledError:
                raise
            except ResourceVersionExpired:
                self.num_gone += 1
                is_listed = False
                logger.info("discovery: resourceVersion %s expired; listing again", self.resource_version)
            except Exception as exc:
                self.num_errors += 1
                is_listed = False
                logger.warning("discovery: %s: %s; retrying in %.1f s", type(exc).__name__, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(self._config.backoff_max_s, backoff_s * 2)


async def _load_client_configuration(config: DiscoveryConfig) -> Any:
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kube_config

    configuration = client.Configuration()
    if config.kubeconfig:
        await kube_config.load_kube_config(config_file=config.kubeconfig, client_configuration=configuration,
                                           persist_config=False)
    else:
        kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


async def run_discovery(config: GatewayConfig, registry: WorkerRegistry) -> None:
    """Run Kubernetes discovery from ``config.discovery`` until cancelled (the gateway's background task).

    A discovery that cannot start (no namespace, ``kubernetes_asyncio`` missing, no credentials) is logged as an
    error and ends; the gateway keeps serving its static and admin-added workers.
    """
    if config.discovery is None:
        return
    try:
        await _run(config.discovery, registry)
    except ConfigError as exc:
        logger.error("worker discovery not running: %s", exc.message)


async def _run(discovery_config: DiscoveryConfig, registry: WorkerRegistry) -> None:
    namespace = resolve_namespace(discovery_config)
    try:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.config import ConfigException
    except ImportError as exc:
        raise ConfigError("discovery: kubernetes_asyncio is not installed (pip install 'kvgate[k8s]')") from exc
    try:
        configuration = await _load_client_configuration(discovery_config)
    except ConfigException as exc:
        raise ConfigError(f"discovery: no Kubernetes credentials: {exc}") from exc
    async with client.ApiClient(configuration) as api_client:
        discovery = PodDiscovery(discovery_config, registry, client.CoreV1Api(api_client), namespace)
        await discovery.run()
