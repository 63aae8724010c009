"""The engine seam: what the scheduler hands an engine each step, and what it gets back.

The scheduler and KV manager (``workers.scheduler``, ``workers.kv``) decide *what* runs; an engine only executes
it. Two engines implement this protocol: ``sim`` (``workers.engines.sim``: no model, a timing model) and
``torch`` (a real Llama-shaped model over a paged KV pool). Block ids index the engine's KV pools:

    GPU pool  [num_gpu_blocks, block_size, num_kv_heads, head_size] per layer (K and V)
    CPU pool  [num_cpu_blocks, block_size, num_kv_heads, head_size] per layer (pinned host memory)

One step::

    scheduler.schedule() -> ScheduledStep --engine.execute()--> StepResult -> scheduler.update(result)

Copies between tiers run asynchronously beside the compute and are tracked as jobs:

* A **store** (GPU -> CPU, write-through offload) is issued in the step that lists it. The engine must
  snapshot the source GPU blocks before any later step can overwrite them (e.g. record the copy on a side
  stream and make the next step's compute wait on it), so the store completes even if the KV manager frees
  and reuses the GPU blocks meanwhile.
* A **restore** (CPU -> GPU) writes into GPU blocks the KV manager reserved for it; the request that owns them
  does not run until the engine reports the job finished. The CPU source slots stay pinned until then.

``StepResult.finished_store_job_ids`` / ``finished_restore_job_ids`` report completions (each job exactly
once, possibly in a later step than it was issued).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, gc=False):
    """How to pick the next token of a sequence.

    Attributes:
        temperature: 0 for greedy.
        top_p: nucleus mass, (0, 1].
        seed: per-request seed; outputs are a deterministic function of (seed, tokens so far).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


class PrefillChunk(msgspec.Struct, frozen=True, gc=False):
    """New tokens of one sequence computed this step (a prompt chunk, or a recompute after preemption).

    Attributes:
        request_id: the sequence.
        token_ids: the ``num_new_tokens`` tokens to compute, at positions ``start_pos ..``.
        start_pos: tokens of the sequence whose KV is already in ``block_ids`` (cached or computed earlier).
        block_ids: the sequence's GPU block table, covering at least ``start_pos + len(token_ids)`` tokens (the
            scheduler's own list, not a copy: valid during ``execute`` only; an engine must not keep it).
        sample: sample one token after the chunk (the chunk reaches the end of the known tokens).
        sampling: sampling parameters.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: Sequence[int]
    sample: bool
    sampling: SamplingParams


class DecodeSeq(msgspec.Struct, frozen=True, gc=False):
    """One decoding sequence: computes its last token's KV at ``position`` and samples the next token.

    Attributes:
        request_id: the sequence.
        token_id: the token fed this step (the last sampled one).
        position: its position (= tokens already in the KV cache).
        block_ids: the GPU block table, covering ``position + 1`` tokens (live, as for ``PrefillChunk``).
        sampling: sampling parameters.
    """

    request_id: str
    token_id: int
    position: int
    block_ids: Sequence[int]
    sampling: SamplingParams


class BlockCopy(msgspec.Struct, frozen=True, gc=False):
    """One copy job between tiers, block by block (``src_block_ids[i] -> dst_block_ids[i]``).

    Attributes:
        job_id: unique per worker process, reported back on completion.
        src_block_ids: block ids in the source pool (GPU for stores, CPU for restores; empty for a restore from
            the shared pool, which is addressed by block hash).
        dst_block_ids: block ids in the destination pool, same length (empty for a store to the shared pool).
    """

    job_id: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


class ScheduledStep(msgspec.Struct, frozen=True, gc=False):
    """Everything one engine step does.

    Attributes:
        prefills: prompt chunks, in scheduling order.
        decodes: decoding sequences, in scheduling order.
        stores: GPU -> CPU copies issued this step.
        restores: CPU -> GPU copies issued this step.
        pool_stores: GPU -> shared pool copies issued this step (job ids share the space of ``stores``; their
            completions are reported in ``finished_store_job_ids``). Only the sim engine runs them.
        pool_restores: shared pool -> GPU copies (completions in ``finished_restore_job_ids``).
        freed_request_ids: sequences finished or aborted since the last step (engines drop per-request state).
    """

    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeSeq, ...] = ()
    stores: tuple[BlockCopy, ...] = ()
    restores: tuple[BlockCopy, ...] = ()
    freed_request_ids: tuple[str, ...] = ()
    pool_stores: tuple[BlockCopy, ...] = ()
    pool_restores: tuple[BlockCopy, ...] = ()
    num_state_copies: int = 0
    """Recurrent-state checkpoint copies made since the last step (hybrid models, ``workers.kv.hybrid``)."""
    state_copy_bytes: int = 0
    """Bytes of those copies within device memory (checkpoint commits)."""
    state_restore_bytes: int = 0
    """Bytes of those copies from host memory (resumes from a CPU checkpoint)."""
    num_state_pool_restores: int = 0
    """Recurrent-state checkpoints read back from the shared pool since the last step (resumes from the pool)."""
    state_pool_restore_bytes: int = 0
    """Bytes of those reads."""

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed this step (prefill chunk tokens plus one per decode)."""
        return sum(len(p.token_ids) for p in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        """No compute and no new copies."""
        return not (
            self.prefills or self.decodes or self.stores or self.restores or self.pool_stores or self.pool_restores
        )


class StepResult(msgspec.Struct, frozen=True, gc=False):
    """What one step produced.

    Attributes:
        sampled_token_ids: request id -> the token sampled this step (prefills with ``sample`` and all decodes).
        duration_s: time the step took (simulated seconds for ``sim``, measured for ``torch``); the scheduler
            advances its clock by it.
        finished_store_job_ids: store jobs complete by the end of this step.
        finished_restore_job_ids: restore jobs complete by the end of this step.
    """

    sampled_token_ids: dict[str, int]
    duration_s: float
    finished_store_job_ids: tuple[int, ...] = ()
    finished_restore_job_ids: tuple[int, ...] = ()


class Engine(Protocol):
    """Executes scheduled steps. Implementations: ``SimEngine``, the torch engine."""

    name: str

    def execute(self, step: ScheduledStep) -> StepResult:
        """Run one step: compute the chunks and decodes, issue the copies, report finished copies.

        An empty step (``step.is_empty``) with copies still in flight waits for (sim: advances to) the next
        copy completion and reports it; with nothing in flight it returns at once with ``duration_s == 0``.
        """
        ...

    def has_pending_copies(self) -> bool:
        """Whether any store or restore job is still in flight."""
        ...

    def close(self) -> None:
        """Release resources (device memory, threads)."""
        ...
