"""Answers of the prefix index: match results, statistics and dumps."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec

from router.index.slots import Slot


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


Levels = tuple[tuple[int, int], ...]
"""``((depth, slot_mask), ...)``, deepest first: the slots whose depth is exactly ``depth`` (disjoint masks, each
depth ``>= 1`` and each mask non-zero)."""


_UNKNOWN = WorkerMatch("", -1, 0)
"""``HolderMatches.get``'s marker of a worker not resolved yet."""


def _depth_in(levels: Levels, mask: int) -> int:
    for depth, holders in levels:
        if holders & mask:
            return depth
    return 0


class HolderMatches(Mapping[str, WorkerMatch]):
    """``MatchResult.workers`` of an index match: the depths as levels of slot masks, resolved per worker on
    demand, so a prompt whose first block a thousand workers hold costs no object per holder.

    ``get`` / ``[]`` / ``in``: O(levels x the worker's dp ranks). Iteration: worker ids deepest first (by all
    tiers together, then by slot bit), lazily, so ``itertools.islice(workers, k)`` reads only the ``k`` deepest;
    ``len``, ``items`` and comparisons materialize the whole dict once (O(holders)).

    Args:
        total: levels of the whole match (GPU, then own lower tiers, then pools).
        gpu, own: levels of the GPU depth and of GPU plus own lower tiers; ``None`` when the match is GPU only
            (then every level is ``total``).
        slots_by_bit, slots_of_worker: the index's roster when matched (``IndexState``; never changed in place).
    """

    __slots__ = ("_total", "_gpu", "_own", "_by_bit", "_of_worker", "_all", "_found")

    def __init__(
        self,
        total: Levels,
        gpu: Levels | None,
        own: Levels | None,
        slots_by_bit: Mapping[int, Slot],
        slots_of_worker: Mapping[str, tuple[Slot, ...]],
    ) -> None:
        self._total = total
        self._gpu = gpu
        self._own = own
        self._by_bit = slots_by_bit
        self._of_worker = slots_of_worker
        self._all: dict[str, WorkerMatch] | None = None
        self._found: dict[str, WorkerMatch | None] = {}
        """``get``'s answers so far (a decision reads the chosen worker's match several times)."""

    def _best(self, slots: tuple[Slot, ...]) -> WorkerMatch | None:
        """The worker's best dp rank: the longest match (then the longest on GPU), then the lowest rank."""
        best: WorkerMatch | None = None
        total_levels = self._total
        for slot in slots:
            mask = slot.mask
            total = _depth_in(total_levels, mask)
            if not total:
                continue
            if self._gpu is None:
                if best is None or (total, -slot.dp_rank) > (best.num_gpu_blocks, -best.dp_rank):
                    best = WorkerMatch(slot.worker_id, slot.dp_rank, total)
                continue
            num_gpu = _depth_in(self._gpu, mask)
            num_own = _depth_in(self._own or (), mask)
            found = WorkerMatch(slot.worker_id, slot.dp_rank, num_gpu, num_own - num_gpu, total - num_own)
            if best is None or (total, num_gpu, -slot.dp_rank) > (best.num_blocks, best.num_gpu_blocks,
                                                                  -best.dp_rank):
                best = found
        return best

    def get(self, worker_id: str, default: WorkerMatch | None = None) -> WorkerMatch | None:  # type: ignore[override]
        found = self._found.get(worker_id, _UNKNOWN)
        if found is _UNKNOWN:
            if self._all is not None:
                found = self._all.get(worker_id)
            else:
                slots = self._of_worker.get(worker_id)
                found = self._best(slots) if slots else None
            self._found[worker_id] = found
        return default if found is None else found

    def __getitem__(self, worker_id: str) -> WorkerMatch:
        found = self.get(worker_id)
        if found is None:
            raise KeyError(worker_id)
        return found

    def __contains__(self, worker_id: object) -> bool:
        return isinstance(worker_id, str) and self.get(worker_id) is not None

    def _iter_ids(self) -> Iterator[str]:
        seen: set[str] = set()
        by_bit = self._by_bit
        for _, holders in self._total:
            while holders:
                low = holders & -holders
                holders ^= low
                slot = by_bit.get(low.bit_length() - 1)
                if slot is not None and slot.worker_id not in seen:
                    seen.add(slot.worker_id)
                    yield slot.worker_id

    def __iter__(self) -> Iterator[str]:
        if self._all is not None:
            return iter(self._all)
        return self._iter_ids()

    def materialize(self) -> dict[str, WorkerMatch]:
        """Every worker's match, deepest first (computed once)."""
        if self._all is None:
            of_worker = self._of_worker
            found = {worker_id: self._best(of_worker[worker_id]) for worker_id in self._iter_ids()}
            self._all = {worker_id: m for worker_id, m in found.items() if m is not None}
        return self._all

    def __len__(self) -> int:
        return len(self.materialize())

    def __bool__(self) -> bool:
        return bool(self._all) if self._all is not None else bool(self._total)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.materialize() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HolderMatches({self.materialize()!r})"


class MatchResult:
    """``PrefixIndex.match`` for one prompt.

    Attributes:
        workers: per worker id with a non-empty match, its best dp_rank's match (a dict, or the lazy
            ``HolderMatches`` of an index match). Workers absent match nothing.
        num_blocks: blocks queried (full blocks of the prompt).
    """

    __slots__ = ("workers", "num_blocks")

    def __init__(self, workers: Mapping[str, WorkerMatch], num_blocks: int) -> None:
        self.workers = workers
        self.num_blocks = num_blocks

    def get(self, worker_id: str) -> WorkerMatch | None:
        """The worker's match, or ``None`` when it holds nothing of the prefix."""
        return self.workers.get(worker_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchResult):
            return NotImplemented
        return self.num_blocks == other.num_blocks and dict(self.workers.items()) == dict(other.workers.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MatchResult({dict(self.workers.items())!r}, {self.num_blocks})"


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
