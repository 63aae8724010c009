"""The routing policy interface: pure, synchronous decisions over a snapshot.

The gateway builds a ``RequestView`` (what routing needs to know about the request) and a ``Snapshot`` (what it
knows about the fleet right now: index match per worker, loads, health), then calls ``policy.select(view,
snapshot)``. A policy does no I/O and never awaits; sessions are resolved by the gateway before and committed
after (see ``router/sessions/base.py``).
"""

from __future__ import annotations

import math
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
        num_expected_growth_tokens: tokens the session's prompt is expected to grow by over its remaining turns
            (``policies.residents.SessionResidents.projected_growth_tokens``; 0 without a session).
        is_new_session: the request opens a session this gateway has not placed yet (``session_sticky`` sets it for
            its inner policy): whatever it finds cached is a head shared with other sessions, not state of its own.
        session_return_probability: the chance that a live session returns once more (``policies.returning``), the
            weight of ``cache_aware``'s charge for the turns a placement holds up (``WorkerState.returning_in_s``); 0
            charges none.
        session_return_tail_s: the fleet's served tail (``policies.move_cost.SessionMoveCost.tail_s``), seconds: the
            charge never raises a worker's ranking cost past it (``policies/returning.py``, "The cap");
            ``math.inf``: no cap.
    """

    request_id: str
    model: str
    num_prompt_tokens: int
    num_max_output_tokens: int
    block_size: int
    session_key: str | None = None
    num_expected_growth_tokens: int = 0
    is_new_session: bool = False
    session_return_probability: float = 0.0
    session_return_tail_s: float = math.inf


PendingPrefill = tuple[float, int, int]
"""One request sent to a worker and not yet prefilled: ``(admitted_at_s, num_uncached_tokens,
num_uncached_token_pairs)``, the admission time on the worker's clock (seconds), the prompt tokens it is predicted to
compute and their attention work ``n**2 - k**2`` in token pairs (``router.lease.uncached_token_pairs``)."""


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
        num_gpu_capacity_tokens: tokens its GPU KV cache holds (the polled GPU blocks times its block size); 0 when
            unknown.
        num_resident_tokens: prompt tokens of the live sessions it owns, the request's own session left out
            (``policies.residents.SessionResidents``, kept by ``session_sticky``); 0 without one.
        num_pending_prefill_token_pairs: the attention work of the pending prefill, ``sum(n_i**2 - k_i**2)`` over
            the requests whose tokens ``num_pending_prefill_tokens`` counts (``n_i`` prompt, ``k_i`` predicted cached
            tokens), in token pairs; 0 when unknown.
        pending_prefills: the same pending requests one by one, ``(admitted_at_s, num_uncached_tokens,
            num_uncached_token_pairs)`` in admission order, times on the worker's clock (seconds); when given, the
            cost model drains them over the time since admission (``policies.cost_model.drained_prefill_s``) and
            the two sums above only rank and limit. Empty: the sums are the queue, as if admitted at ``clock_s``.
        prefill_done_at_s: when the worker last finished its oldest pending prefill (its first byte), on its
            clock; the requests still pending were not served before then (0.0: none yet).
        clock_s: the decision time on the worker's clock (seconds; the gateway's clock over the worker's
            ``time_scale``).
        returning_in_s: for each live session it owns, seconds from ``clock_s`` until its next turn is expected
            (``policies.returning.ReturningSessions``, filled by ``session_sticky`` for a new session's request);
            empty: none counted.
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
    num_gpu_capacity_tokens: int = 0
    num_resident_tokens: int = 0
    num_pending_prefill_token_pairs: int = 0
    pending_prefills: tuple[PendingPrefill, ...] = ()
    prefill_done_at_s: float = 0.0
    clock_s: float = 0.0
    returning_in_s: tuple[float, ...] = ()

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
