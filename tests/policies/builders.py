"""``make_*`` helpers for policy tests."""

from __future__ import annotations

from policies.base import RequestView, Snapshot, WorkerState

BLOCK_SIZE = 16


def make_worker(worker_id: str, **fields: object) -> WorkerState:
    """A healthy idle worker with ``fields`` overridden."""
    return WorkerState(worker_id, **fields)  # type: ignore[arg-type]


def make_view(num_prompt_tokens: int = 1024, session_key: str | None = None, request_id: str = "req-0") -> RequestView:
    """A request of ``num_prompt_tokens`` tokens."""
    return RequestView(
        request_id=request_id,
        model="llama-3-8b",
        num_prompt_tokens=num_prompt_tokens,
        num_max_output_tokens=128,
        block_size=BLOCK_SIZE,
        session_key=session_key,
    )


def make_snapshot(*workers: WorkerState, session_owner: str | None = None) -> Snapshot:
    """A snapshot of ``workers`` in the given (configuration) order."""
    return Snapshot(workers=tuple(workers), session_owner=session_owner)


def make_fleet(num_workers: int, **fields: object) -> tuple[WorkerState, ...]:
    """``w0..w{n-1}``, identical."""
    return tuple(make_worker(f"w{i}", **fields) for i in range(num_workers))
