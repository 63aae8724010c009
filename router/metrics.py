"""Prometheus metrics of the gateway, in a per-app ``CollectorRegistry`` (no process-global state).

Counters and histograms updated on the request path live in ``GatewayMetrics``; figures owned by other
components (index size, event counters, sessions, circuit states) are read at scrape time through callbacks
registered with ``add_callback`` so the request path never pays for them.

Series (all prefixed ``kvgate_``)::

    requests_total{worker,policy,status}            proxied requests by final HTTP status
    request_duration_seconds{worker,policy}         gateway receive -> last byte sent
    ttft_seconds{worker}                            gateway-observed time to first token (streaming)
    decision_seconds                                request view + policy select (+ session resolve)
    rejected_total{reason}                          requests refused before routing (bad_request, overloaded...)
    retries_total{worker,reason}                    attempts abandoned before the first byte
    predicted_cached_tokens_total{worker}           honesty check: what the gateway predicted
    reported_cached_tokens_total{worker}            ... and what the worker reported in usage
    cached_tokens_checks_total{worker,result}       result = match | mismatch
    inflight_requests{worker}                       requests in flight through this gateway
    index_blocks{worker,medium}                     (scrape time) index entries
    event_*{...}                                    (scrape time) event counters from the subscriber
    sessions_live / sessions_expired_total ...      (scrape time) session store stats
    circuit_state{worker}                           (scrape time) 0 closed, 1 open, 2 half-open
    worker_healthy{worker}                          (scrape time) 1 healthy
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)

MetricSample = tuple[str, str, str, dict[str, str], float]
"""(kind "counter"|"gauge", name, help, labels, value) produced by a scrape-time callback."""


class _CallbackCollector(Collector):
    """Yields metric families computed by callbacks at scrape time."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], Iterable[MetricSample]]] = []

    def add(self, callback: Callable[[], Iterable[MetricSample]]) -> None:
        self._callbacks.append(callback)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for callback in self._callbacks:
            try:
                samples = list(callback())
            except Exception:
                logger.exception("metrics callback failed")
                continue
            for kind, name, help_text, labels, value in samples:
                family = families.get(name)
                if family is None:
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    family = cls(name, help_text, labels=list(labels))
                    families[name] = family
                family.add_metric(list(labels.values()), value)
        yield from families.values()

    def describe(self) -> Iterator[Metric]:
        return iter(())


class WorkerMetrics:
    """The labelled children of one worker's request-path series, resolved once (``labels()`` is a locked dict
    lookup with label validation: too slow to repeat several times per request).

    Attributes:
        inflight: ``inflight_requests{worker}``.
        ttft_s: ``ttft_seconds{worker}``.
        predicted_cached_tokens: ``predicted_cached_tokens_total{worker}``.
        reported_cached_tokens: ``reported_cached_tokens_total{worker}``.
        checks_match: ``cached_tokens_checks_total{worker,result="match"}``.
        checks_mismatch: ``cached_tokens_checks_total{worker,result="mismatch"}``.
    """

    __slots__ = ("_metrics", "worker_id", "inflight", "ttft_s", "predicted_cached_tokens", "reported_cached_tokens",
                 "checks_match", "checks_mismatch", "_by_policy")

    def __init__(self, metrics: GatewayMetrics, worker_id: str) -> None:
        self._metrics = metrics
        self.worker_id = worker_id
        self.inflight = metrics.inflight_requests.labels(worker_id)
        self.ttft_s = metrics.ttft_s.labels(worker_id)
        self.predicted_cached_tokens = metrics.predicted_cached_tokens_total.labels(worker_id)
        self.reported_cached_tokens = metrics.reported_cached_tokens_total.labels(worker_id)
        self.checks_match = metrics.cached_tokens_checks_total.labels(worker_id, "match")
        self.checks_mismatch = metrics.cached_tokens_checks_total.labels(worker_id, "mismatch")
        self._by_policy: dict[str, Histogram] = {}

    def duration_s(self, policy: str) -> Histogram:
        """``request_duration_seconds{worker,policy}``."""
        child = self._by_policy.get(policy)
        if child is None:
            child = self._by_policy[policy] = self._metrics.request_duration_s.labels(self.worker_id, policy)
        return child

    def requests(self, policy: str, status: int) -> Counter:
        """``requests_total{worker,policy,status}``."""
        return self._metrics.requests_child(self.worker_id, policy, status)


class GatewayMetrics:
    """Every metric of one gateway app, registered in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_total = Counter(
            "kvgate_requests", "Proxied requests by final status.", ["worker", "policy", "status"], registry=r
        )
        self.request_duration_s = Histogram(
            "kvgate_request_duration_seconds", "Gateway receive to last byte sent, seconds.", ["worker", "policy"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.ttft_s = Histogram(
            "kvgate_ttft_seconds", "Time to first token seen by the gateway (streaming), seconds.", ["worker"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.decision_s = Histogram(
            "kvgate_decision_seconds", "Routing decision time (view, sessions, policy), seconds.",
            buckets=DECISION_BUCKETS_S, registry=r,
        )
        self.rejected_total = Counter(
            "kvgate_rejected", "Requests refused before routing, by reason.", ["reason"], registry=r
        )
        self.retries_total = Counter(
            "kvgate_retries", "Attempts abandoned before the first byte and retried.", ["worker", "reason"], registry=r
        )
        self.predicted_cached_tokens_total = Counter(
            "kvgate_predicted_cached_tokens", "Cached prompt tokens predicted on the chosen worker.", ["worker"],
            registry=r,
        )
        self.reported_cached_tokens_total = Counter(
            "kvgate_reported_cached_tokens", "Cached prompt tokens the worker reported in usage.", ["worker"],
            registry=r,
        )
        self.cached_tokens_checks_total = Counter(
            "kvgate_cached_tokens_checks", "Honesty checks: predicted vs reported cached tokens.",
            ["worker", "result"], registry=r,
        )
        self.inflight_requests = Gauge(
            "kvgate_inflight_requests", "Requests in flight through this gateway.", ["worker"], registry=r
        )
        self.admission_queue_depth = Gauge(
            "kvgate_admission_queue_depth", "Requests waiting for admission.", registry=r
        )
        self._callbacks = _CallbackCollector()
        r.register(self._callbacks)
        self._workers: dict[str, WorkerMetrics] = {}
        self._requests: dict[tuple[str, str, int], Counter] = {}

    def worker(self, worker_id: str) -> WorkerMetrics:
        """The worker's cached series children (created on first use; ``forget_worker`` drops them)."""
        wm = self._workers.get(worker_id)
        if wm is None:
            wm = self._workers[worker_id] = WorkerMetrics(self, worker_id)
        return wm

    def requests_child(self, worker_id: str, policy: str, status: int) -> Counter:
        """``requests_total{worker,policy,status}``, cached per label tuple."""
        key = (worker_id, policy, status)
        child = self._requests.get(key)
        if child is None:
            if len(self._requests) > 65536:
                self._requests.clear()
            child = self._requests[key] = self.requests_total.labels(worker_id, policy, str(status))
        return child

    def forget_worker(self, worker_id: str) -> None:
        """Drop the cached children of a removed worker (its series stay in the registry)."""
        self._workers.pop(worker_id, None)
        for key in [k for k in self._requests if k[0] == worker_id]:
            del self._requests[key]

    def add_callback(self, callback: Callable[[], Iterable[MetricSample]]) -> None:
        """Register a scrape-time source of samples (index, events, sessions, fleet)."""
        self._callbacks.add(callback)

    def record_honesty(self, worker_id: str, predicted: int, reported: int) -> None:
        """Record one predicted-vs-reported pair of cached prompt tokens."""
        wm = self.worker(worker_id)
        if predicted:
            wm.predicted_cached_tokens.inc(predicted)
        if reported:
            wm.reported_cached_tokens.inc(reported)
        (wm.checks_match if predicted == reported else wm.checks_mismatch).inc()

    def render(self) -> bytes:
        """The text exposition format of every series."""
        return generate_latest(self.registry)
