"""Answers of the prefix index: match results, statistics and dumps."""

from __future__ import annotations

import msgspec


class WorkerMatch(msgspec.Struct, frozen=True, gc=False):
    """How much of a prompt's prefix one worker can serve from cache.

    The three counts are consecutive runs from the root: blocks ``[0, num_gpu_blocks)`` are on the worker's
    GPU; the prefix then continues on its own lower tiers (CPU, disk; a block there may also still be on GPU)
    for ``num_cpu_blocks``; then in a shared pool the worker is attached to for ``num_pool_blocks``.

    Attributes:
        worker_id: the worker.
        dp_rank: the data-parallel rank (engine) of the worker holding the longest prefix.
        num_gpu_blocks: blocks from the root held on GPU.
        num_cpu_blocks: further blocks held on the worker's CPU or disk tier.
        num_pool_blocks: further blocks reachable in a shared pool.
    """

    worker_id: str
    dp_rank: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    num_pool_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the worker would not recompute (all tiers)."""
        return self.num_gpu_blocks + self.num_cpu_blocks + self.num_pool_blocks


class MatchResult(msgspec.Struct, frozen=True, gc=False):
    """``PrefixIndex.match`` for one prompt.

    Attributes:
        workers: per worker id with a non-empty match, its best dp_rank's match. Workers absent match nothing.
        num_blocks: blocks queried (full blocks of the prompt).
    """

    workers: dict[str, WorkerMatch]
    num_blocks: int

    def get(self, worker_id: str) -> WorkerMatch | None:
        """The worker's match, or ``None`` when it holds nothing of the prefix."""
        return self.workers.get(worker_id)


class IndexStats(msgspec.Struct, frozen=True, gc=False):
    """Sizes and counters for metrics and the admin API.

    Attributes:
        num_blocks: indexed blocks (entries, including ones kept only as ancestors of held blocks).
        num_approx_blocks: (worker, block) pairs inserted by routing decisions and not yet confirmed.
        num_blocks_by_worker: worker id -> medium name -> (block, worker) holdings, summed over dp ranks
            and cache groups.
        counters: event and maintenance counters (``num_unknown_removals``, ``num_orphan_blocks``...).
        num_blocks_by_group: cache group index (as a string, a JSON key) -> worker id -> medium name -> holdings,
            summed over dp ranks: hybrid models' entries per group (a recurrent group's are its checkpoints).
    """

    num_blocks: int
    num_approx_blocks: int
    num_blocks_by_worker: dict[str, dict[str, int]]
    counters: dict[str, int]
    num_blocks_by_group: dict[str, dict[str, dict[str, int]]] = msgspec.field(default_factory=dict)


class ChainDump(msgspec.Struct, frozen=True, gc=False):
    """One chain of a worker, root-most block first, for debugging.

    Attributes:
        dp_rank: the engine the chain belongs to.
        block_hashes: our block hashes from the first held block to a held leaf.
        media: per block, the media (``"GPU"``, ``"CPU"``...) the worker holds it on, group 0.
    """

    dp_rank: int
    block_hashes: tuple[int, ...]
    media: tuple[tuple[str, ...], ...]
