"""The CPU tier: a host block pool filled write-through from the GPU, with vLLM/LMCache's store rules.

Data structures::

    entries     block_hash -> CpuEntry(slot, meta, pin_cnt), least recently used first
                (only completed stores; these are what lookups see)
    in_flight   block_hash -> (job_id, slot) for stores issued but not completed
    free_slots  CPU slots holding nothing, lowest first

Store life cycle (two phases, ``prepare_store`` / ``complete_store``):
  1. ``prepare_store`` picks the blocks to store, skipping any whose store is already in flight (rule 1) and
     any already stored (rule 2), reserves a CPU slot for each (a free one, else the least recently used
     unpinned entry is evicted with a ``BlockRemoved`` CPU event; with none, the block is skipped and counted).
  2. The engine copies GPU -> CPU. The copy does not need the GPU block to stay (rule 3): the KV manager may
     evict and reuse it meanwhile; the engine snapshots the source when it issues the copy.
  3. ``complete_store`` makes the blocks visible to lookups and emits ``BlockStored`` (CPU), with parent and
     tokens so the event stands alone.

Restores pin their source entries (``pin``) so they cannot be evicted mid-copy; each request unpins exactly
the pins it took (``unpin``), never another's.

A shared pool tier (``Medium.MOONCAKE``) would implement the same five calls (``lookup``, ``prepare_store``,
``complete_store``, ``pin``/``unpin``) over a remote store; the KV manager talks to tiers only through them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from events.types import BlockRemoved, EngineBlockHash, KVEvent, Medium
from workers.errors import KVCacheError
from workers.kv.block_pool import BlockMeta, chain_order, stored_events
from workers.kv.hashing import BlockHash, to_engine_hash

logger = logging.getLogger(__name__)


class CpuEntry:
    """A stored block.

    Attributes:
        slot: CPU pool slot.
        meta: the block's content description.
        pin_cnt: restores reading it now.
    """

    __slots__ = ("slot", "meta", "pin_cnt")

    def __init__(self, slot: int, meta: BlockMeta) -> None:
        self.slot = slot
        self.meta = meta
        self.pin_cnt = 0


class CpuTier:
    """Host-memory block pool (see module docstring for structures, rules and eviction order)."""

    medium = Medium.CPU

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[KVEvent], None]) -> None:
        """Build an empty tier.

        Args:
            num_blocks: CPU slots (> 0).
            block_size: tokens per block (same as the GPU's).
            emit: called with each KV event.

        Raises:
            ValueError: a non-positive size.
        """
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self._entries: OrderedDict[BlockHash, CpuEntry] = OrderedDict()
        self._in_flight: dict[BlockHash, tuple[int, int, BlockMeta]] = {}
        self._jobs: dict[int, list[BlockHash]] = {}
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_stores_skipped_in_flight = 0
        self.num_stores_skipped_stored = 0
        self.num_stores_skipped_full = 0
        self.num_blocks_stored = 0
        self.num_blocks_evicted = 0

    @property
    def num_free_blocks(self) -> int:
        """Slots holding nothing (not counting evictable entries)."""
        return len(self._free_slots)

    @property
    def num_stored_blocks(self) -> int:
        """Completed stores visible to lookups."""
        return len(self._entries)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, are stored (completed stores only)."""
        n = 0
        for h in block_hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def prepare_store(self, job_id: int, metas: Sequence[BlockMeta]) -> list[tuple[BlockMeta, int]]:
        """Phase 1 of a store: choose blocks and reserve slots (rules 1 and 2).

        Args:
            job_id: the copy job these blocks belong to.
            metas: candidate blocks in prefix order.

        Returns:
            ``(meta, cpu_slot)`` for each block to copy; empty when nothing is to be stored (no job then).
        """
        out: list[tuple[BlockMeta, int]] = []
        for meta in metas:
            h = meta.block_hash
            if h in self._in_flight:
                self.num_stores_skipped_in_flight += 1
                continue
            if h in self._entries:
                self.num_stores_skipped_stored += 1
                self._entries.move_to_end(h)
                continue
            slot = self._take_slot()
            if slot is None:
                self.num_stores_skipped_full += 1
                continue
            self._in_flight[h] = (job_id, slot, meta)
            out.append((meta, slot))
        if out:
            self._jobs[job_id] = [m.block_hash for m, _ in out]
        return out

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for h, entry in self._entries.items():
            if entry.pin_cnt == 0:
                del self._entries[h]
                eh = entry.meta.engine_hash
                self._emit(
                    BlockRemoved(
                        block_hashes=(to_engine_hash(h) if eh is None else EngineBlockHash(eh),), medium=Medium.CPU
                    )
                )
                self.num_blocks_evicted += 1
                return entry.slot
        return None

    def complete_store(self, job_id: int) -> None:
        """Phase 2: the copy of ``job_id`` landed; its blocks become visible and ``BlockStored`` (CPU) is emitted.

        Raises:
            KVCacheError: an unknown job.
        """
        hashes = self._jobs.pop(job_id, None)
        if hashes is None:
            raise KVCacheError(f"unknown store job {job_id}")
        done: list[BlockMeta] = []
        for h in hashes:
            _job, slot, meta = self._in_flight.pop(h)
            self._entries[h] = CpuEntry(slot, meta)
            done.append(meta)
        self.num_blocks_stored += len(done)
        for ev in stored_events(done, self.block_size, Medium.CPU):
            self._emit(ev)

    def meta(self, block_hash: BlockHash) -> BlockMeta:
        """The meta of a stored block.

        Raises:
            KeyError: not stored.
        """
        return self._entries[block_hash].meta

    def pin(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Pin stored blocks for a restore and mark them recently used.

        Returns:
            Their CPU slots, in order.

        Raises:
            KVCacheError: a block that is not stored (callers ``lookup`` first).
        """
        slots: list[int] = []
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is None:
                raise KVCacheError("pin of a block not on the CPU tier")
            entry.pin_cnt += 1
            self._entries.move_to_end(h)
            slots.append(entry.slot)
        return slots

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Drop one pin on each block (the caller's own pins only).

        Raises:
            KVCacheError: a block without pins.
        """
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is None or entry.pin_cnt <= 0:
                raise KVCacheError("unpin of a block that is not pinned")
            entry.pin_cnt -= 1

    def reset(self) -> int:
        """Drop every unpinned stored block (no events; the manager emits ``AllBlocksCleared``).

        Returns:
            Blocks dropped.
        """
        dropped = [h for h, e in self._entries.items() if e.pin_cnt == 0]
        for h in dropped:
            self._free_slots.append(self._entries.pop(h).slot)
        return len(dropped)

    def stored_metas(self) -> list[BlockMeta]:
        """Every stored block's meta in snapshot order."""
        return chain_order(e.meta for e in self._entries.values())

    def lru_order(self) -> list[BlockHash]:
        """Test-only: stored hashes, evicted-next first."""
        return list(self._entries)
