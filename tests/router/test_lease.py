"""``WorkerLease``: every counter it takes is given back exactly once, whatever order the exits come in, and the
circuit breaker gets one verdict per lease (or ``on_abandoned`` when there is none)."""

from __future__ import annotations

import pytest

from router.config import CircuitBreakerConfig, WorkerConfig
from router.fleet import CircuitState, WorkerRuntime
from router.lease import WorkerLease
from router.metrics import WorkerMetrics


def _worker(**breaker: object) -> tuple[WorkerRuntime, WorkerMetrics]:
    config = WorkerConfig(id="w0", url="http://127.0.0.1:1", model="m")
    return WorkerRuntime(config, 16, CircuitBreakerConfig(**breaker)), WorkerMetrics("w0")  # type: ignore[arg-type]


def _counters(worker: WorkerRuntime, metrics: WorkerMetrics) -> tuple[int, int, int, int, int]:
    """(requests in flight, prompt tokens in flight, pending prefill tokens, decoding requests, metric in flight)."""
    return (worker.num_inflight_requests, worker.num_inflight_prompt_tokens, worker.num_pending_prefill_tokens,
            worker.num_decoding_requests, metrics.num_inflight)


def test_acquire_counts_and_release_twice_gives_back_once() -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 100, 60)
    assert _counters(worker, metrics) == (1, 100, 60, 0, 1)
    other = WorkerLease.acquire(worker, metrics, 10, 0)
    assert _counters(worker, metrics) == (2, 110, 60, 0, 2)
    lease.release()
    assert lease.is_released and _counters(worker, metrics) == (1, 10, 0, 0, 1)
    lease.release()  # a second release is harmless
    assert _counters(worker, metrics) == (1, 10, 0, 0, 1)
    other.release()
    other.release()
    assert _counters(worker, metrics) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("steps", [
    (),  # given up before any byte (connect error, retry, client gone before the headers)
    ("first",),  # client gone mid-stream
    ("first", "last"),  # answered
    ("last",),  # a stream that ended with no chunk
    ("first", "first", "last", "last"),  # every step twice
    ("last", "first"),  # a first byte after the end changes nothing
])
def test_every_exit_order_leaves_every_counter_at_zero(steps: tuple[str, ...]) -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 40, 24)
    for step in steps:
        if step == "first":
            lease.on_first_byte()
        else:
            lease.on_last_byte()
    lease.release()
    lease.release()
    assert _counters(worker, metrics) == (0, 0, 0, 0, 0)
    assert lease.has_first_byte == (steps[:1] == ("first",))


def test_first_byte_moves_pending_prefill_to_decoding_once() -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 40, 24)
    lease.on_first_byte()
    lease.on_first_byte()
    assert _counters(worker, metrics) == (1, 40, 0, 1, 1) and lease.has_first_byte
    lease.on_last_byte()
    assert _counters(worker, metrics) == (1, 40, 0, 0, 1)
    lease.release()
    assert _counters(worker, metrics) == (0, 0, 0, 0, 0)


def test_one_verdict_per_lease() -> None:
    worker, metrics = _worker(failure_threshold=2)
    lease = WorkerLease.acquire(worker, metrics, 4, 4)
    lease.record_failure(1.0)
    lease.record_failure(2.0)  # the same attempt: not a second failure
    lease.release()
    assert (worker.breaker.state, worker.breaker.num_consecutive_failures) == (CircuitState.CLOSED, 1)
    lease = WorkerLease.acquire(worker, metrics, 4, 4)
    lease.record_failure(3.0)
    lease.record_success()  # a verdict was given: this one is ignored
    lease.release()
    assert (worker.breaker.state, worker.breaker.opened_at_s) == (CircuitState.OPEN, 3.0)


def test_a_half_open_trial_released_without_a_verdict_frees_the_trial() -> None:
    worker, metrics = _worker(failure_threshold=1, open_s=10.0)
    breaker = worker.breaker
    failed = WorkerLease.acquire(worker, metrics, 4, 4)
    failed.record_failure(0.0)
    failed.release()
    assert breaker.allows(10.0) and breaker.state is CircuitState.HALF_OPEN
    trial = WorkerLease.acquire(worker, metrics, 4, 4)
    assert breaker.is_trial_in_flight and not breaker.allows(10.0)
    trial.release()  # its client went away: no verdict
    assert (breaker.state, breaker.is_trial_in_flight, breaker.allows(10.0)) == (CircuitState.HALF_OPEN, False, True)
    trial = WorkerLease.acquire(worker, metrics, 4, 4)
    trial.record_success()
    trial.release()
    trial.release()
    assert (breaker.state, breaker.is_trial_in_flight) == (CircuitState.CLOSED, False)
