"""The routing policy interface: pure, synchronous decisions over a snapshot.

The gateway builds a ``RequestView`` (what routing needs to know about the request) and a ``Snapshot`` (what it
knows about the fleet right now: index match per worker, loads, health), then calls ``policy.select(view,
snapshot)``. A policy does no I/O and never awaits; sessions are resolved by the gateway before and committed
after (see ``router/sessions/base.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import msgspec


class RequestView(msgspec.Struct, frozen=True, gc=False):
    """What routing knows about one request.

    Attributes:
        request_id: the gateway's id for the request.
        model: requested model name.
        num_prompt_tokens: prompt length in tokens (from the gateway's tokenizer).
        num_max_output_tokens: ``max_tokens`` (or the configured default) in tokens.
        block_size: tokens per block used for ``num_prompt_blocks``.
        session_key: the session key, or ``None`` without one.
    """

    request_id: str
    model: str
    num_prompt_tokens: int
    num_max_output_tokens: int
    block_size: int
    session_key: str | None = None


class WorkerState(msgspec.Struct, frozen=True, gc=False):
    """One candidate worker as seen at decision time.

    Attributes:
        worker_id: the worker.
        is_healthy: passes health checks and its circuit is closed.
        is_draining: takes no new sessions or requests (existing streams finish).
        num_gpu_cached_tokens: prompt tokens the index says it holds on GPU from the root.
        num_cpu_cached_tokens: further prompt tokens it holds on its own CPU/disk tier, past the GPU ones.
        num_pool_cached_tokens: further prompt tokens reachable in a shared pool it is attached to.
        num_running_requests: requests in flight through this gateway (plus polled load, if newer).
        num_waiting_requests: requests queued at the worker (polled).
        num_pending_prefill_tokens: prompt tokens still to be prefilled ahead of this request.
        kv_usage: fraction of GPU KV blocks in use, 0..1 (polled).
        num_inflight_prompt_tokens: prompt tokens of the requests in flight on the worker through this gateway
            (the context its decode steps read, up to the tokens generated since).
        num_recent_assignments: how many of the gateway's latest decisions went to this worker (a window of a
            few decisions per worker; ``router.routing.RecentAssignments``): ties between equally costly workers
            go to the one given least lately, so new sessions on an idle fleet spread instead of piling onto the
            first configured worker.
    """

    worker_id: str
    is_healthy: bool = True
    is_draining: bool = False
    num_gpu_cached_tokens: int = 0
    num_cpu_cached_tokens: int = 0
    num_pool_cached_tokens: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_pending_prefill_tokens: int = 0
    kv_usage: float = 0.0
    num_inflight_prompt_tokens: int = 0
    num_recent_assignments: int = 0

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens it would not recompute (all tiers)."""
        return self.num_gpu_cached_tokens + self.num_cpu_cached_tokens + self.num_pool_cached_tokens


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    """The fleet at decision time.

    Attributes:
        workers: candidates serving the request's model, in a stable order (configuration order).
        session_owner: the worker owning the request's session (resolved from the store), or ``None``.
        now_s: monotonic clock in seconds (injected in tests).
    """

    workers: tuple[WorkerState, ...]
    session_owner: str | None = None
    now_s: float = 0.0


class Decision(msgspec.Struct, frozen=True, gc=False):
    """A policy's answer.

    Attributes:
        worker_id: the chosen worker, or ``None`` when no candidate can take the request.
        reason: short machine-readable reason (``"min_ttft"``, ``"sticky"``, ``"sticky_moved"``,
            ``"no_healthy_worker"``...).
        scores: per worker id, the policy's score (cache_aware: estimated TTFT in seconds; lower is better).
        predicted_cached_tokens: cached prompt tokens predicted on the chosen worker (the honesty check).
        ranking: candidate worker ids best first (retries walk it).
        detail: human-readable qualifier of ``reason`` for logs and the admin's decision list (e.g. why a
            session moved: ``"owner_unhealthy"``, ``"owner_costlier"``); ``""`` when there is nothing to add.
    """

    worker_id: str | None
    reason: str
    scores: Mapping[str, float] = msgspec.field(default_factory=dict)
    predicted_cached_tokens: int = 0
    ranking: tuple[str, ...] = ()
    detail: str = ""


class Policy(Protocol):
    """A routing policy: pure and synchronous."""

    name: str

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose a worker for ``view`` given ``snapshot``. Never raises for an empty or unhealthy fleet:
        returns ``Decision(worker_id=None, reason=...)``."""
        ...
