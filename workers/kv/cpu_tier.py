"""The CPU tier: a host block pool filled write-through from the GPU, with vLLM/LMCache's store rules.

Data structures::

    entries     block_hash -> slot of every completed store, least recently used first (a plain dict: a touch
                re-inserts); what lookups see
    slot_hash   [num_blocks] the u64 engine hash held by each slot (for events)
    slot_meta   [num_blocks] the ``BlockMeta`` held by each slot (tokens and parent, for snapshots of blocks that
                left the GPU); a reference to the meta the GPU index registered, set by slice on runs
    in_flight   hashes of stores issued but not completed (a set; small: the jobs of a few steps)
    jobs        job id -> (hashes, slots, engine hashes, metas) of one store in flight
    pins        block_hash -> restores reading it now (only pinned blocks are present)
    free_runs   CPU slots holding nothing, as maximal runs of consecutive slots (``FreeRuns``)

Slot allocation: a store job's blocks get consecutive slots where possible, so a restored prefix reads a few
long runs of host memory (the torch engine's restore copies each run with one copy-engine transfer; random
slots fall back to a kernel reading pinned memory, which reaches a lower fraction of the bandwidth)::

    free runs cover n      the smallest run of length >= n (lowest start among equal lengths): slots
                           start .. start + n - 1; the rest of the run stays free. A fresh pool is one run,
                           so jobs get 0 .. n1 - 1, n1 .. n1 + n2 - 1, ...
    no single run covers   the longest runs first, each cut to what is still needed
    fewer free than n      every free slot, plus the least recently used unpinned entries evicted (exactly as
                           many as missing: eviction order is untouched); the job's slots are all of these in
                           ascending order, so the evicted slots of a previous job (consecutive when it got a run)
                           stay runs

A job's slots are always ascending, so block ``i`` of a job sits at ``slots[i]``.

The store path is batched: one ``prepare_store`` and one ``complete_store`` per copy job, with the per-block
work done by dict/list operations over whole runs, and no per-block Python objects. A completed block keeps
its slot, its engine hash and a reference to its meta (a restore rebuilds its metas from the restoring
request's own tokens). Traffic that never comes back (every block new, nothing pinned) takes the fast path
only: per block, one membership test and one insert on ``entries``, a set insert and removal on ``in_flight``
and, when full, one eviction; per-slot arrays are written by slice when the job's slots are one run.

Store life cycle (two phases, ``prepare_store`` / ``complete_store``):
  1. ``prepare_store`` picks the blocks to store, skipping any whose store is already in flight (rule 1) and
     any already stored (rule 2, the entry is touched), reserves a CPU slot for each (a free one, else the
     least recently used unpinned entries are evicted, one ``BlockRemoved`` CPU event per batch; with none left,
     the remaining blocks are skipped and counted).
  2. The engine copies GPU -> CPU. The copy does not need the GPU block to stay (rule 3): the KV manager may
     evict and reuse it meanwhile; the engine snapshots the source when it issues the copy.
  3. ``complete_store`` makes the blocks visible to lookups and emits one ``BlockStored`` (CPU) per job, as
     vLLM's offloading connector does: engine hashes only, no parent and no tokens (the gateway resolves them
     through the GPU store of the same hashes). When some of the job's blocks already left the GPU prefix index
     (rule 3), the event carries parent and tokens instead, so it still stands alone. Snapshots list the
     stored blocks' metas (``stored_metas``): the manager emits the blocks still on GPU token-less and the
     others with tokens.

Restores pin their source entries (``pin``) so they cannot be evicted mid-copy; each request unpins exactly
the pins it took (``unpin``), never another's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from operator import attrgetter

from sortedcontainers import SortedDict, SortedList

from events.types import BlockRemoved, EngineBlockHash, KVEvent, Medium
from workers.errors import KVCacheError
from workers.kv.block_pool import BlockMeta, emit_tier_stored, engine_hash_of
from workers.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

_engine_hash_attr = attrgetter("engine_hash")


class FreeRuns:
    """Free slots of a pool as maximal runs of consecutive slots (allocation rules: module docstring).

    Structures::

        by_start    start -> length of each free run (sorted by start; neighbours merge on ``add``)
        by_length   (length, start) of each free run (sorted: best fit by bisection, longest last)

    Invariants: runs are disjoint and never adjacent (adjacent runs are merged); ``num_free`` is the sum of
    their lengths.
    """

    def __init__(self, num_slots: int) -> None:
        """All of ``0 .. num_slots - 1`` free (one run)."""
        self._by_start: SortedDict = SortedDict()
        self._by_length: SortedList = SortedList()
        self.num_free = 0
        if num_slots > 0:
            self._insert(0, num_slots)
            self.num_free = num_slots

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_length.add((length, start))

    def _delete(self, start: int, length: int) -> None:
        del self._by_start[start]
        self._by_length.remove((length, start))

    def runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every free run, by start."""
        return list(self._by_start.items())

    def take(self, num_slots: int) -> list[int]:
        """Up to ``num_slots`` free slots (all free ones when fewer), ascending, in as few runs as the rules give."""
        n = min(num_slots, self.num_free)
        if n <= 0:
            return []
        by_length = self._by_length
        self.num_free -= n
        i = by_length.bisect_left((n, -1))
        if i < len(by_length):
            length, start = by_length[i]
            self._delete(start, length)
            if length > n:
                self._insert(start + n, length - n)
            return list(range(start, start + n))
        runs: list[tuple[int, int]] = []
        need = n
        while need:
            length, start = by_length[-1]
            self._delete(start, length)
            k = min(length, need)
            if k < length:
                self._insert(start + k, length - k)
            runs.append((start, k))
            need -= k
        runs.sort()
        return [slot for start, k in runs for slot in range(start, start + k)]

    def add(self, slots: Sequence[int]) -> None:
        """Return ascending, distinct ``slots`` (none of them free) to the free runs, merging neighbours."""
        if not slots:
            return
        self.num_free += len(slots)
        by_start = self._by_start
        start = prev = slots[0]
        for slot in (*slots[1:], -1):
            if slot == prev + 1:
                prev = slot
                continue
            length = prev - start + 1
            i = by_start.bisect_left(start)
            if i > 0:
                left_start, left_length = by_start.peekitem(i - 1)
                if left_start + left_length == start:
                    self._delete(left_start, left_length)
                    start, length = left_start, left_length + length
            right_length = by_start.get(start + length)
            if right_length is not None:
                self._delete(start + length, right_length)
                length += right_length
            self._insert(start, length)
            start = prev = slot


class CpuTier:
    """Host-memory block pool (see module docstring for structures, rules and eviction order)."""

    medium = Medium.CPU

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        emit: Callable[[KVEvent], None],
        on_gpu: Callable[[Sequence[BlockHash]], bool] | None = None,
    ) -> None:
        """Build an empty tier.

        Args:
            num_blocks: CPU slots (> 0).
            block_size: tokens per block (same as the GPU's).
            emit: called with each KV event.
            on_gpu: whether all given hashes are in the GPU prefix index (picks the store event's shape).

        Raises:
            ValueError: a non-positive size.
        """
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self._on_gpu = on_gpu
        self._entries: dict[BlockHash, int] = {}
        self._slot_hash: list[int] = [0] * num_blocks
        self._slot_meta: list[BlockMeta | None] = [None] * num_blocks
        self._in_flight: set[BlockHash] = set()
        self._jobs: dict[int, tuple[list[BlockHash], list[int], tuple[EngineBlockHash, ...], Sequence[BlockMeta]]] = {}
        self._pins: dict[BlockHash, int] = {}
        self._free = FreeRuns(num_blocks)
        self.num_stores_skipped_in_flight = 0
        self.num_stores_skipped_stored = 0
        self.num_stores_skipped_full = 0
        self.num_blocks_stored = 0
        self.num_blocks_evicted = 0

    @property
    def num_free_blocks(self) -> int:
        """Slots holding nothing (not counting evictable entries)."""
        return self._free.num_free

    @property
    def num_stored_blocks(self) -> int:
        """Completed stores visible to lookups."""
        return len(self._entries)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, are stored (completed stores only)."""
        entries = self._entries
        n = 0
        for h in block_hashes:
            if h not in entries:
                break
            n += 1
        return n

    def prepare_store(
        self, job_id: int, hashes: list[BlockHash], metas: Sequence[BlockMeta]
    ) -> tuple[list[int] | None, list[int]]:
        """Phase 1 of a store: choose blocks and reserve slots (rules 1 and 2).

        Args:
            job_id: the copy job these blocks belong to.
            hashes: candidate blocks' hashes in prefix order (the list is kept by the tier).
            metas: their metas, same order (kept until the store completes).

        Returns:
            ``(chosen, slots)``: the positions in ``hashes`` of the blocks to copy (``None``: the first
            ``len(slots)``) and their CPU slots, same order. No slots: nothing to store (no job then).
        """
        entries = self._entries
        in_flight = self._in_flight
        chosen: list[int] | None = None
        if (not in_flight or in_flight.isdisjoint(hashes)) and entries.keys().isdisjoint(hashes):
            slots = self._take_slots(len(hashes))
            if len(slots) < len(hashes):
                self.num_stores_skipped_full += len(hashes) - len(slots)
                del hashes[len(slots) :]
                metas = metas[: len(slots)]
        else:
            chosen = []
            for i, h in enumerate(hashes):
                if h in in_flight:
                    self.num_stores_skipped_in_flight += 1
                elif h in entries:
                    self.num_stores_skipped_stored += 1
                    entries[h] = entries.pop(h)
                else:
                    chosen.append(i)
            slots = self._take_slots(len(chosen))
            if len(slots) < len(chosen):
                self.num_stores_skipped_full += len(chosen) - len(slots)
                del chosen[len(slots) :]
            hashes = [hashes[i] for i in chosen]
            metas = [metas[i] for i in chosen]
        if slots:
            in_flight.update(hashes)
            engine_hashes = tuple(map(_engine_hash_attr, metas))
            if None in engine_hashes:
                engine_hashes = tuple(map(engine_hash_of, metas))
            first = slots[0]
            if slots[-1] - first == len(slots) - 1:  # one run (slots ascend)
                self._slot_hash[first : first + len(slots)] = engine_hashes
                self._slot_meta[first : first + len(slots)] = metas
            else:
                deque(map(self._slot_hash.__setitem__, slots, engine_hashes), maxlen=0)
                deque(map(self._slot_meta.__setitem__, slots, metas), maxlen=0)
            self._jobs[job_id] = (hashes, slots, engine_hashes, metas)
        return chosen, slots

    def _take_slots(self, n: int) -> list[int]:
        """``n`` slots, ascending (fewer when too few are free or evictable): free runs first, then LRU evictions
        (allocation rules: module docstring)."""
        free = self._free
        if free.num_free >= n:
            return free.take(n)
        out = free.take(free.num_free)
        entries = self._entries
        need = n - len(out)
        if not self._pins:
            victims = list(islice(entries, need))
        else:
            pins = self._pins
            victims = list(islice((h for h in entries if h not in pins), need))
        if victims:
            slots = list(map(entries.pop, victims))
            self._emit(
                BlockRemoved(
                    block_hashes=tuple(map(self._slot_hash.__getitem__, slots)),  # type: ignore[arg-type]
                    medium=self.medium,
                )
            )
            self.num_blocks_evicted += len(victims)
            out += slots
            out.sort()
        return out

    def complete_store(self, job_id: int) -> None:
        """Phase 2: the copy of ``job_id`` landed; its blocks become visible and ``BlockStored`` (CPU) is emitted.

        Raises:
            KVCacheError: an unknown job.
        """
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise KVCacheError(f"unknown store job {job_id}")
        hashes, slots, engine_hashes, metas = job
        self._in_flight.difference_update(hashes)
        self._entries.update(zip(hashes, slots, strict=True))
        self.num_blocks_stored += len(slots)
        emit_tier_stored(
            self._emit,
            metas,
            engine_hashes,
            self.block_size,
            self.medium,
            self._on_gpu is not None and self._on_gpu(hashes),
        )

    def pin(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Pin stored blocks for a restore and mark them recently used.

        Returns:
            Their CPU slots, in order.

        Raises:
            KVCacheError: a block that is not stored (callers ``lookup`` first).
        """
        entries = self._entries
        pins = self._pins
        slots: list[int] = []
        for h in block_hashes:
            slot = entries.pop(h, None)
            if slot is None:
                raise KVCacheError("pin of a block not on the CPU tier")
            entries[h] = slot
            pins[h] = pins.get(h, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Drop one pin on each block (the caller's own pins only).

        Raises:
            KVCacheError: a block without pins.
        """
        pins = self._pins
        for h in block_hashes:
            n = pins.get(h, 0)
            if n <= 0:
                raise KVCacheError("unpin of a block that is not pinned")
            if n == 1:
                del pins[h]
            else:
                pins[h] = n - 1

    def pin_count(self, block_hash: BlockHash) -> int:
        """Restores reading ``block_hash`` now."""
        return self._pins.get(block_hash, 0)

    def reset(self) -> int:
        """Drop every unpinned completed block (no events; the manager emits ``AllBlocksCleared``). Stores in
        flight complete later as usual.

        Returns:
            Blocks dropped.
        """
        pins = self._pins
        entries = self._entries
        dropped = [h for h in entries if h not in pins]
        slots = sorted(map(entries.pop, dropped))
        self._free.add(slots)
        return len(dropped)

    def stored_engine_hashes(self) -> list[EngineBlockHash]:
        """The engine hashes of every stored block, least recently used first (for snapshots)."""
        return list(map(self._slot_hash.__getitem__, self._entries.values()))  # type: ignore[arg-type]

    def stored_metas(self) -> list[BlockMeta]:
        """The metas of every stored block, least recently used first (for snapshots)."""
        return list(map(self._slot_meta.__getitem__, self._entries.values()))  # type: ignore[arg-type]

    def free_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every run of free slots, by start (introspection, tests)."""
        return self._free.runs()

    def lru_order(self) -> list[BlockHash]:
        """Test-only: stored hashes, evicted-next first."""
        return list(self._entries)
