"""Prometheus metrics of the gateway, in a per-app ``CollectorRegistry`` (no process-global state).

The request path's series (requests, durations, TTFT, decision time, honesty, in flight) are plain numbers per
worker (``WorkerMetrics``, ``HistogramCounts``: an update is an integer add, no lock, no label lookup) turned into
metric families at scrape time; only the rare ones (rejections, retries) are ``prometheus_client`` counters.
Figures owned by other components (index size, event counters, sessions, circuit states) are read at scrape time
through callbacks registered with ``add_callback`` so the request path never pays for them. Everything runs on the
event loop thread.

Series (all prefixed ``kvgate_``)::

    requests_total{worker,policy,status}            proxied requests by final HTTP status
    request_duration_seconds{worker,policy}         gateway receive -> last byte sent
    ttft_seconds{worker}                            gateway-observed time to first token (streaming)
    decision_seconds                                request view + policy select (+ session resolve)
    decisions_total{policy,reason}                  routing decisions by the policy's reason (min_ttft,
                                                    min_ttft_all_saturated, sticky, ...)
    rejected_total{reason}                          requests refused before routing (bad_request, overloaded...)
    retries_total{worker,reason}                    attempts abandoned before the first byte
    predicted_cached_tokens_total{worker}           honesty check: what the gateway predicted
    reported_cached_tokens_total{worker}            ... and what the worker reported in usage
    prompt_tokens_total{worker}                     ... over prompts of this many tokens (usage.prompt_tokens):
                                                    the hit ratio's denominator, served and predicted
    cached_tokens_checks_total{worker,result}       result = match | mismatch | unchecked (a 200 whose answer
                                                    carries no usage: a stream without include_usage)
    cached_tokens_mismatches_total{worker,cause}    every mismatch by cause: index (predicted more than the worker
                                                    held and it reported no eviction of those blocks since the
                                                    decision: the index was wrong), evicted (the worker reported
                                                    evicting a predicted block after the decision, or a shared
                                                    pool the worker is a member of lost one, as the pool watcher
                                                    found: a forecast miss under memory pressure), pending (the
                                                    first block missed was only pending at the decision, computed
                                                    by a request in flight and stored after this one was
                                                    admitted), late (the worker
                                                    held more than the index knew at the decision: its store
                                                    events were in flight)
    stream_errors_total{worker}                     streams the worker broke after their headers (ended with an
                                                    OpenAI error event; counted in requests_total by the 200
                                                    relayed, as a failure by the circuit breaker)
    inflight_requests{worker}                       requests in flight through this gateway
    admission_inflight / admission_waiting          (scrape time) admitted requests, requests in the queue
    pd_reserved_blocks / pd_reservations /          (scrape time, models with ``pd``) per decode worker: blocks,
      pd_transfer_bytes_ahead{worker}               requests and KV bytes in flight this gateway reserved there
    pd_waiting_requests, pd_capacity_rejected_total (scrape time) waiting for decode room, 429s for lack of it
    pd_reservations_made_total / _released_total    (scrape time) equal once no disaggregated request is in flight
    index_blocks{worker,medium}                     (scrape time) index entries
    event_*{...}                                    (scrape time) event counters from the subscriber
    worker_event_batches_total{worker}              (scrape time) event batches delivered per worker
    worker_resyncs_total{worker}                    (scrape time) index resyncs per worker
    event_lag_seconds{worker}                       (scrape time) receipt time - publisher time, last batch
    worker_warm{worker}                             (scrape time) 0 while warming or rebuilding after a resync
    sessions_live / sessions_expired_total ...      (scrape time) session store stats
    circuit_state{worker}                           (scrape time) 0 closed, 1 open, 2 half-open
    worker_healthy{worker}                          (scrape time) 1 healthy
    process_resident_memory_bytes, process_open_fds (scrape time) the gateway process (``common.process_stats``)
    process_asyncio_tasks                           (scrape time) tasks on the gateway's event loop
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from common.process_stats import register_process_collectors
from events.counters import DropKind, EventCounters
from router.admission import Admission
from router.fleet import Fleet
from router.index import PrefixIndex
from router.pool_watch import PoolWatcher
from router.sessions.base import SessionStore

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


class HistogramCounts:
    """A Prometheus-style histogram kept as plain counts (exported at scrape time).

    ``counts[i]`` is the number of observations in ``(bounds[i - 1], bounds[i]]``; the last item counts those above
    every bound (``+Inf``). Times are in seconds.
    """

    __slots__ = ("bounds", "counts", "sum", "_les")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._les = [repr(float(b)) for b in bounds] + ["+Inf"]

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last."""
        out: list[tuple[str, float]] = []
        total = 0
        for le, n in zip(self._les, self.counts, strict=True):
            total += n
            out.append((le, float(total)))
        return out


MISMATCH_CAUSES: tuple[str, ...] = ("index", "evicted", "pending", "late")
"""Causes of a cached-token mismatch (``cached_tokens_mismatches_total``; ``router.routing.IndexTicket``)."""


class WorkerMetrics:
    """One worker's request-path series as plain numbers, exported at scrape time (a ``prometheus_client`` child
    costs a lock and label checks per update: too much for several updates per request).

    Attributes:
        worker_id: the worker.
        num_inflight: ``inflight_requests{worker}``.
        ttft_s: ``ttft_seconds{worker}``.
        num_predicted_cached_tokens: ``predicted_cached_tokens_total{worker}``.
        num_reported_cached_tokens: ``reported_cached_tokens_total{worker}``.
        num_prompt_tokens: ``prompt_tokens_total{worker}``: prompt tokens of the answers the two above cover.
        num_checks_match: ``cached_tokens_checks_total{worker,result="match"}``.
        num_checks_mismatch: ``cached_tokens_checks_total{worker,result="mismatch"}``.
        num_checks_unchecked: ``cached_tokens_checks_total{worker,result="unchecked"}``.
        num_mismatches: ``cached_tokens_mismatches_total{worker,cause}`` keyed by cause (``MISMATCH_CAUSES``).
        num_requests: ``requests_total{worker,policy,status}`` keyed by ``(policy, status)``.
        num_stream_errors: ``stream_errors_total{worker}``.
        duration_s: ``request_duration_seconds{worker,policy}`` keyed by policy.
    """

    __slots__ = ("worker_id", "num_inflight", "ttft_s", "num_predicted_cached_tokens", "num_reported_cached_tokens",
                 "num_prompt_tokens", "num_checks_match", "num_checks_mismatch", "num_checks_unchecked",
                 "num_mismatches", "num_requests", "num_stream_errors", "duration_s")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.num_inflight = 0
        self.ttft_s = HistogramCounts(LATENCY_BUCKETS_S)
        self.num_predicted_cached_tokens = 0
        self.num_reported_cached_tokens = 0
        self.num_prompt_tokens = 0
        self.num_checks_match = 0
        self.num_checks_mismatch = 0
        self.num_checks_unchecked = 0
        self.num_mismatches: dict[str, int] = dict.fromkeys(MISMATCH_CAUSES, 0)
        self.num_requests: dict[tuple[str, int], int] = {}
        self.num_stream_errors = 0
        self.duration_s: dict[str, HistogramCounts] = {}

    def count_request(self, policy: str, status: int, duration_s: float) -> None:
        """One finished request: ``requests_total`` and ``request_duration_seconds``."""
        key = (policy, status)
        requests = self.num_requests
        requests[key] = requests.get(key, 0) + 1
        hist = self.duration_s.get(policy)
        if hist is None:
            hist = self.duration_s[policy] = HistogramCounts(LATENCY_BUCKETS_S)
        hist.counts[bisect_left(hist.bounds, duration_s)] += 1  # HistogramCounts.observe, inlined
        hist.sum += duration_s


class _RequestPathCollector(Collector):
    """Exports every ``WorkerMetrics`` and the decision-time histogram."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        workers = list(m.workers.values())
        requests = CounterMetricFamily("kvgate_requests", "Proxied requests by final status.",
                                       labels=["worker", "policy", "status"])
        duration = HistogramMetricFamily("kvgate_request_duration_seconds",
                                         "Gateway receive to last byte sent, seconds.", labels=["worker", "policy"])
        ttft = HistogramMetricFamily("kvgate_ttft_seconds",
                                     "Time to first token seen by the gateway (streaming), seconds.", labels=["worker"])
        predicted = CounterMetricFamily("kvgate_predicted_cached_tokens",
                                        "Cached prompt tokens predicted on the chosen worker.", labels=["worker"])
        reported = CounterMetricFamily("kvgate_reported_cached_tokens",
                                       "Cached prompt tokens the worker reported in usage.", labels=["worker"])
        prompt = CounterMetricFamily("kvgate_prompt_tokens",
                                     "Prompt tokens (usage) of the answers the cached-token counts cover.",
                                     labels=["worker"])
        checks = CounterMetricFamily("kvgate_cached_tokens_checks",
                                     "Honesty checks: predicted vs reported cached tokens.",
                                     labels=["worker", "result"])
        mismatches = CounterMetricFamily("kvgate_cached_tokens_mismatches",
                                         "Cached-token mismatches by cause (index, evicted, pending, late).",
                                         labels=["worker", "cause"])
        stream_errors = CounterMetricFamily("kvgate_stream_errors",
                                            "Streams the worker broke after their headers (ended with an error).",
                                            labels=["worker"])
        inflight = GaugeMetricFamily("kvgate_inflight_requests", "Requests in flight through this gateway.",
                                     labels=["worker"])
        for w in workers:
            wid = w.worker_id
            for (policy, status), n in list(w.num_requests.items()):
                requests.add_metric([wid, policy, str(status)], float(n))
            for policy, hist in list(w.duration_s.items()):
                duration.add_metric([wid, policy], hist.buckets(), hist.sum)
            ttft.add_metric([wid], w.ttft_s.buckets(), w.ttft_s.sum)
            predicted.add_metric([wid], float(w.num_predicted_cached_tokens))
            reported.add_metric([wid], float(w.num_reported_cached_tokens))
            prompt.add_metric([wid], float(w.num_prompt_tokens))
            checks.add_metric([wid, "match"], float(w.num_checks_match))
            checks.add_metric([wid, "mismatch"], float(w.num_checks_mismatch))
            checks.add_metric([wid, "unchecked"], float(w.num_checks_unchecked))
            for cause, n in w.num_mismatches.items():
                mismatches.add_metric([wid, cause], float(n))
            stream_errors.add_metric([wid], float(w.num_stream_errors))
            inflight.add_metric([wid], float(w.num_inflight))
        decision = HistogramMetricFamily("kvgate_decision_seconds",
                                         "Routing decision time (view, sessions, policy), seconds.")
        decision.add_metric([], m.decision_s.buckets(), m.decision_s.sum)
        decisions = CounterMetricFamily("kvgate_decisions", "Routing decisions by the policy's reason.",
                                        labels=["policy", "reason"])
        for (policy, reason), n in list(m.num_decisions.items()):
            decisions.add_metric([policy, reason], float(n))
        yield from (requests, duration, ttft, decision, decisions, predicted, reported, prompt, checks, mismatches,
                    stream_errors, inflight)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class GatewayMetrics:
    """Every metric of one gateway app, registered in its own registry.

    Attributes:
        workers: per worker id, its request-path series (``worker()`` creates them).
        decision_s: ``decision_seconds``.
        num_decisions: ``decisions_total{policy,reason}`` keyed by ``(policy, reason)``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rejected_total = Counter(
            "kvgate_rejected", "Requests refused before routing, by reason.", ["reason"], registry=r
        )
        self.retries_total = Counter(
            "kvgate_retries", "Attempts abandoned before the first byte and retried.", ["worker", "reason"], registry=r
        )
        self.workers: dict[str, WorkerMetrics] = {}
        self.decision_s = HistogramCounts(DECISION_BUCKETS_S)
        self.num_decisions: dict[tuple[str, str], int] = {}
        r.register(_RequestPathCollector(self))
        self._callbacks = _CallbackCollector()
        r.register(self._callbacks)
        register_process_collectors(r)

    def worker(self, worker_id: str) -> WorkerMetrics:
        """The worker's request-path series (created on first use)."""
        wm = self.workers.get(worker_id)
        if wm is None:
            wm = self.workers[worker_id] = WorkerMetrics(worker_id)
        return wm

    def count_decision(self, policy: str, reason: str) -> None:
        """One routing decision: ``decisions_total{policy,reason}``."""
        key = (policy, reason)
        self.num_decisions[key] = self.num_decisions.get(key, 0) + 1

    def forget_worker(self, worker_id: str) -> None:
        """Drop a removed worker's series (its request-path ones and its ``retries_total`` children), so a fleet
        whose worker ids churn (pods) keeps no label set of a worker that went."""
        self.workers.pop(worker_id, None)
        retries = self.retries_total
        for labels in [k for k in retries._metrics if k[0] == worker_id]:
            retries.remove(*labels)

    def add_callback(self, callback: Callable[[], Iterable[MetricSample]]) -> None:
        """Register a scrape-time source of samples (index, events, sessions, fleet)."""
        self._callbacks.add(callback)

    def render(self) -> bytes:
        """The text exposition format of every series."""
        return generate_latest(self.registry)


def gateway_samples(
    *, fleet: Fleet, indexes: Mapping[str, PrefixIndex], event_counters: Callable[[], EventCounters | None],
    event_lag_s: Callable[[str], float | None], sessions: SessionStore, admission: Admission,
    clock: Callable[[], float], pool_watcher: PoolWatcher | None = None,
) -> list[MetricSample]:
    """The scrape-time series of the gateway's components (``GatewayMetrics.add_callback``): worker health,
    drain, circuit and warm states, pending prefill tokens, event lag, index sizes and counters, event stream
    counters (once the subscriber runs: ``event_counters`` returns ``None`` before; per worker with events, and
    drops of every kind, from 0 on), session store stats, admission.

    Reading a circuit breaker's state lets an open one turn half-open after its ``open_s``, as a request would.
    """
    out: list[MetricSample] = []
    now_s = clock()
    for worker in fleet.workers.values():
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
        out.append(("gauge", "kvgate_worker_warm",
                    "1 when the worker's index entries are usable; 0 while warming or rebuilding after a resync.",
                    {"worker": wid}, float(worker.is_warm)))
        lag_s = event_lag_s(wid)
        if lag_s is not None:
            out.append(("gauge", "kvgate_event_lag_seconds",
                        "Receipt wall time minus the publisher's time of the worker's last event batch, seconds.",
                        {"worker": wid}, lag_s))
    for name, index in indexes.items():
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
    if pool_watcher is not None:
        out.extend(pool_watch_samples(pool_watcher))
    counters = event_counters()
    if counters is not None:
        drops = counters.drops_by_kind()
        for kind in DropKind:
            out.append(("counter", "kvgate_event_drops", "Malformed or refused events by kind.",
                        {"kind": str(kind)}, float(drops.get(kind, 0))))
        for key, value in _counter_fields(counters).items():
            out.append(("counter", "kvgate_event_stream", "Event stream counters (batches, gaps, replays...).",
                        {"counter": key}, float(value)))
        num_resyncs: dict[str, int] = {}
        for (wid, _), n in counters.resyncs.items():
            num_resyncs[wid] = num_resyncs.get(wid, 0) + n
        for wid, worker in fleet.workers.items():
            if worker.config.has_events:
                out.append(("counter", "kvgate_worker_event_batches", "Event batches delivered, per worker.",
                            {"worker": wid}, float(counters.num_batches.get(wid, 0))))
                out.append(("counter", "kvgate_worker_resyncs",
                            "Index resyncs (cleared and rebuilt), per worker; the log names each one's reason.",
                            {"worker": wid}, float(num_resyncs.get(wid, 0))))
    s = sessions.stats()
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
                float(admission.num_inflight)))
    out.append(("gauge", "kvgate_admission_waiting", "Requests waiting for admission.", {},
                float(admission.num_waiting)))
    return out


def _counter_fields(counters: EventCounters) -> dict[str, int]:
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


def pool_watch_samples(watcher: PoolWatcher) -> list[MetricSample]:
    """The pool watcher's series (``router.pool_watch``)."""
    out: list[MetricSample] = [
        ("gauge", "kvgate_pool_master_up", "1 when the last pool watch sweep reached the Mooncake master.", {},
         float(watcher.is_master_up)),
        ("gauge", "kvgate_pool_master_keys", "Keys the Mooncake master listed at the last sweep.", {},
         float(watcher.master_key_count)),
        ("gauge", "kvgate_pool_master_evicted_keys", "The master's master_evicted_key_count at the last sweep.", {},
         float(watcher.master_evicted_key_count)),
        ("gauge", "kvgate_pool_watch_sweep_seconds", "Duration of the last pool watch sweep, seconds.", {},
         watcher.last_sweep_s),
        ("gauge", "kvgate_pool_watch_check_seconds", "Duration of the last decision check, seconds.", {},
         watcher.last_check_s),
    ]  # fmt: skip
    for counter in ("num_sweeps", "num_failed_sweeps", "num_entries_dropped", "num_master_restarts",
                    "num_ttl_clears", "num_foreign_keys", "num_span_length_mismatches", "num_checks",
                    "num_checks_unanswered", "num_check_drops", "num_confirms", "num_confirm_drops"):
        out.append(("counter", "kvgate_pool_watch", "Pool watcher counters (sweeps, drops, restarts, checks).",
                    {"counter": counter}, float(getattr(watcher, counter))))  # fmt: skip
    return out

