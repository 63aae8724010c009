"""Helpers shared by every policy: who may be chosen, how load compares, the "nobody" decision.

Eligibility rule (all policies): a worker is a candidate when it ``is_healthy`` and not ``is_draining``.
Configuration order (the order of ``Snapshot.workers``) is the last tie-break everywhere, so every decision is
deterministic for a given snapshot and policy state.
"""

from __future__ import annotations

from policies.base import Decision, Snapshot, WorkerState

__all__ = ["eligible_workers", "is_eligible", "load_key", "no_worker_decision", "num_load_requests"]

REASON_NO_WORKERS = "no_workers"
REASON_NO_HEALTHY_WORKER = "no_healthy_worker"
REASON_ALL_WORKERS_DRAINING = "all_workers_draining"


def is_eligible(worker: WorkerState) -> bool:
    """True when ``worker`` may take a new request: healthy and not draining."""
    return worker.is_healthy and not worker.is_draining


def eligible_workers(snapshot: Snapshot) -> list[WorkerState]:
    """The candidates of ``snapshot`` in configuration order (healthy, not draining)."""
    return [w for w in snapshot.workers if w.is_healthy and not w.is_draining]


def num_load_requests(worker: WorkerState) -> int:
    """Requests on the worker: running plus waiting."""
    return worker.num_running_requests + worker.num_waiting_requests


def load_key(worker: WorkerState) -> tuple[int, int]:
    """Sort key of load, lower is less loaded: (running + waiting requests, pending prefill tokens)."""
    return (worker.num_running_requests + worker.num_waiting_requests, worker.num_pending_prefill_tokens)


def no_worker_decision(snapshot: Snapshot) -> Decision:
    """The decision when no candidate exists.

    Returns:
        ``Decision(worker_id=None)`` with reason ``"no_workers"`` (empty fleet), ``"all_workers_draining"``
        (every worker draining, whatever its health: the operator's doing) or ``"no_healthy_worker"`` (every
        worker unhealthy or draining, at least one of them not draining).
    """
    workers = snapshot.workers
    if not workers:
        return Decision(worker_id=None, reason=REASON_NO_WORKERS)
    if all(w.is_draining for w in workers):
        return Decision(worker_id=None, reason=REASON_ALL_WORKERS_DRAINING)
    return Decision(worker_id=None, reason=REASON_NO_HEALTHY_WORKER)
