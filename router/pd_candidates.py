"""The candidates of a disaggregated request (``router.pd``): the fleet split by role, and each decode worker's
state as ``policies.pd`` reads it (free and total blocks from its last load poll, this gateway's reservations and
transfers in flight there, its own index depth of the prompt, its load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.base import Decision
from policies.pd import DecodeCandidate
from router.fleet import WorkerRuntime
from router.pd_ledger import DecodeLedger
from router.request_view import PromptView
from router.routing import Router

__all__ = ["UNKNOWN_BLOCKS", "decode_candidates", "split_roles"]

UNKNOWN_BLOCKS = 1 << 40
"""Free and total blocks assumed for a decode worker whose load endpoint has not said (no limit but the ledger's)."""

def split_roles(workers: Sequence[WorkerRuntime]) -> tuple[list[WorkerRuntime], list[WorkerRuntime]]:
    """``(prefill candidates, decode candidates)`` in registration order: role ``both`` is in each."""
    prefill = [w for w in workers if w.config.role in ("prefill", "both")]
    decode = [w for w in workers if w.config.role in ("decode", "both")]
    return prefill, decode


def decode_candidates(
    router: Router,
    workers: Sequence[WorkerRuntime],
    view: PromptView,
    match: Any,
    now_s: float,
    ledger: DecodeLedger,
) -> tuple[DecodeCandidate, ...]:
    """The decode workers' ``DecodeCandidate`` at ``now_s`` (free and total blocks from the last poll, this gateway's
    reservations and in-flight counts, their own index depth of the prompt)."""
    states, _ = router.states(workers, view, now_s, 0, match)
    out: list[DecodeCandidate] = []
    for w, s in zip(workers, states, strict=True):
        load = w.load
        free = load.num_free_gpu_blocks if load is not None else None
        total = load.num_total_gpu_blocks if load is not None else None
        if total is None:  # never polled, or a worker that does not say: only the gateway's own reservations bound it
            total = free if free is not None else UNKNOWN_BLOCKS
        if free is None:
            free = total
        out.append(
            DecodeCandidate(
                w.worker_id,
                num_free_blocks=free,
                num_total_blocks=total,
                is_healthy=s.is_healthy,
                is_draining=s.is_draining,
                num_reserved_blocks=ledger.reserved_blocks(w.worker_id),
                num_bytes_ahead=ledger.bytes_ahead(w.worker_id),
                num_gpu_cached_tokens=s.num_gpu_cached_tokens,
                num_running_requests=s.num_running_requests,
                num_inflight_prompt_tokens=s.num_inflight_prompt_tokens,
            )
        )
    return tuple(out)


def ranking(decision: Decision) -> tuple[str, ...]:
    """The worker ids of ``decision``, best first: its ranking, else its one worker, else none."""
    if decision.ranking:
        return decision.ranking
    return (decision.worker_id,) if decision.worker_id is not None else ()
