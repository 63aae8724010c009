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

    def add_callback(self, callback: Callable[[], Iterable[MetricSample]]) -> None:
        """Register a scrape-time source of samples (index, events, sessions, fleet)."""
        self._callbacks.add(callback)

    def record_honesty(self, worker_id: str, predicted: int, reported: int) -> None:
        """Record one predicted-vs-reported pair of cached prompt tokens."""
        self.predicted_cached_tokens_total.labels(worker_id).inc(predicted)
        self.reported_cached_tokens_total.labels(worker_id).inc(reported)
        self.cached_tokens_checks_total.labels(worker_id, "match" if predicted == reported else "mismatch").inc()

    def render(self) -> bytes:
        """The text exposition format of every series."""
        return generate_latest(self.registry)
