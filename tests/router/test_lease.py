"""``WorkerLease``: every counter it takes is given back exactly once, whatever order the exits come in, and the
circuit breaker gets one verdict per lease (or ``on_abandoned`` when there is none)."""

from __future__ import annotations

import pytest

from router.config import CircuitBreakerConfig, WorkerConfig
from router.fleet import CircuitState, WorkerRuntime
from router.lease import WorkerLease, uncached_token_pairs
from router.metrics import WorkerMetrics
from router.request_view import PromptView
from router.routing import Router


def _worker(time_scale: float = 1.0, **breaker: object) -> tuple[WorkerRuntime, WorkerMetrics]:
    config = WorkerConfig(id="w0", url="http://127.0.0.1:1", model="m", time_scale=time_scale)
    return WorkerRuntime(config, 16, CircuitBreakerConfig(**breaker)), WorkerMetrics("w0")  # type: ignore[arg-type]


def _counters(worker: WorkerRuntime, metrics: WorkerMetrics) -> tuple[int, int, int, int, int]:
    """(requests in flight, prompt tokens in flight, pending prefill tokens, decoding requests, metric in flight)."""
    return (worker.num_inflight_requests, worker.num_inflight_prompt_tokens, worker.num_pending_prefill_tokens,
            worker.num_decoding_requests, metrics.num_inflight)


def test_acquire_counts_and_release_twice_gives_back_once() -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 100, 60, 0.0)
    assert _counters(worker, metrics) == (1, 100, 60, 0, 1)
    other = WorkerLease.acquire(worker, metrics, 10, 0, 0.0)
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
    lease = WorkerLease.acquire(worker, metrics, 40, 24, 0.0)
    for step in steps:
        if step == "first":
            lease.on_first_byte(1.0)
        else:
            lease.on_last_byte()
    lease.release()
    lease.release()
    assert _counters(worker, metrics) == (0, 0, 0, 0, 0)
    assert worker.num_pending_prefill_token_pairs == 0 and worker.pending_prefills == {}
    assert lease.has_first_byte == (steps[:1] == ("first",))


def test_first_byte_moves_pending_prefill_to_decoding_once() -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 40, 24, 0.0)
    lease.on_first_byte(1.0)
    lease.on_first_byte(1.0)
    assert _counters(worker, metrics) == (1, 40, 0, 1, 1) and lease.has_first_byte
    lease.on_last_byte()
    assert _counters(worker, metrics) == (1, 40, 0, 0, 1)
    lease.release()
    assert _counters(worker, metrics) == (0, 0, 0, 0, 0)


def test_one_verdict_per_lease() -> None:
    worker, metrics = _worker(failure_threshold=2)
    lease = WorkerLease.acquire(worker, metrics, 4, 4, 0.0)
    lease.record_failure(1.0)
    lease.record_failure(2.0)  # the same attempt: not a second failure
    lease.release()
    assert (worker.breaker.state, worker.breaker.num_consecutive_failures) == (CircuitState.CLOSED, 1)
    lease = WorkerLease.acquire(worker, metrics, 4, 4, 0.0)
    lease.record_failure(3.0)
    lease.record_success()  # a verdict was given: this one is ignored
    lease.release()
    assert (worker.breaker.state, worker.breaker.opened_at_s) == (CircuitState.OPEN, 3.0)


def test_a_half_open_trial_released_without_a_verdict_frees_the_trial() -> None:
    worker, metrics = _worker(failure_threshold=1, open_s=10.0)
    breaker = worker.breaker
    failed = WorkerLease.acquire(worker, metrics, 4, 4, 0.0)
    failed.record_failure(0.0)
    failed.release()
    assert breaker.allows(10.0) and breaker.state is CircuitState.HALF_OPEN
    trial = WorkerLease.acquire(worker, metrics, 4, 4, 0.0)
    assert breaker.is_trial_in_flight and not breaker.allows(10.0)
    trial.release()  # its client went away: no verdict
    assert (breaker.state, breaker.is_trial_in_flight, breaker.allows(10.0)) == (CircuitState.HALF_OPEN, False, True)
    trial = WorkerLease.acquire(worker, metrics, 4, 4, 0.0)
    trial.record_success()
    trial.release()
    trial.release()
    assert (breaker.state, breaker.is_trial_in_flight) == (CircuitState.CLOSED, False)


def test_pending_prefill_token_pairs_are_n_squared_minus_k_squared_until_the_first_byte() -> None:
    worker, metrics = _worker()
    lease = WorkerLease.acquire(worker, metrics, 1000, 300, 0.0)  # k = 700 cached: 1000**2 - 700**2
    assert worker.num_pending_prefill_token_pairs == 510_000 == 300 * (2 * 1000 - 300)
    other = WorkerLease.acquire(worker, metrics, 64, 64, 0.0)  # nothing cached: 64**2
    assert worker.num_pending_prefill_token_pairs == 514_096
    lease.on_first_byte(1.0)
    assert worker.num_pending_prefill_token_pairs == 4_096
    assert worker.info(0.0)["num_pending_prefill_token_pairs"] == 4_096
    other.release()
    lease.release()
    assert worker.num_pending_prefill_token_pairs == 0


def test_pending_prefills_list_each_request_in_admission_order_on_the_worker_clock() -> None:
    worker, metrics = _worker(time_scale=0.25)  # a sim worker 4x faster than real time: worker time = wall / 0.25
    first = WorkerLease.acquire(worker, metrics, 1000, 300, 10.0)
    second = WorkerLease.acquire(worker, metrics, 64, 64, 10.5)
    empty = WorkerLease.acquire(worker, metrics, 32, 0, 11.0)
    assert list(worker.pending_prefills.values()) == [(40.0, 300, 510_000), (42.0, 64, 4_096), (44.0, 0, 0)]
    second.on_first_byte(12.0)  # out of order: it leaves the list; served beside the head, it says nothing of it
    assert list(worker.pending_prefills.values()) == [(40.0, 300, 510_000), (44.0, 0, 0)]
    assert worker.prefill_done_at_s == 0.0
    first.on_first_byte(11.5)  # the head finished at 46: nothing behind it was served before
    assert (list(worker.pending_prefills.values()), worker.prefill_done_at_s) == ([(44.0, 0, 0)], 46.0)
    empty.on_first_byte(11.25)  # the new head, reported at 45: the time does not go back
    assert (worker.pending_prefills, worker.prefill_done_at_s) == ({}, 46.0)
    given_up = WorkerLease.acquire(worker, metrics, 16, 16, 12.0)
    given_up.release()  # without a first byte: no prefill finished
    assert (worker.pending_prefills, worker.prefill_done_at_s) == ({}, 46.0)
    for lease in (first, second, empty):
        lease.release()


@pytest.mark.parametrize(("n", "u", "pairs"), [(0, 0, 0), (10, 0, 0), (10, 10, 100), (10, 4, 64), (10, 25, 100),
                                               (10, -3, 0), (-5, 2, 0)])
def test_uncached_token_pairs_clamps_the_uncached_tokens_to_the_prompt(n: int, u: int, pairs: int) -> None:
    assert uncached_token_pairs(n, u) == pairs


def test_the_snapshot_carries_the_pending_queue_on_the_worker_clock() -> None:
    worker, metrics = _worker(time_scale=0.25)
    first = WorkerLease.acquire(worker, metrics, 1000, 300, 10.0)
    second = WorkerLease.acquire(worker, metrics, 64, 64, 10.5)
    first.on_first_byte(11.0)  # the head
    (state,), _ = Router.states((worker,), PromptView(1, (), 16), 12.0, 0, None)
    # worker clock = gateway clock / 0.25: admitted at 42, first prefill done at 44, decision at 48
    assert (state.pending_prefills, state.prefill_done_at_s, state.clock_s) == (((42.0, 64, 4_096),), 44.0, 48.0)
    assert (state.num_pending_prefill_tokens, state.num_pending_prefill_token_pairs) == (64, 4_096)
    second.release()
    first.release()
