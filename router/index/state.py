"""State of the prefix index and its primitive operations: entries (the chain structure) and holdings.

Layout: dense ids. Every entry (and every dangling key, below) has a small integer id; one dict maps block
hashes to ids, and everything else is a flat per-id table indexed by id, with no Python object per block::

    id_of[block_hash] -> id          one dict for the whole index (entries and dangling keys)

    id:               0 (null)   1        2        3        4        5 ...
    block_hash[id]    0          h1       h2       h3       h7       h8        list
    parent[id]        0          0        1        2        2        4         array('q'); 0 = none (rooted)
    kind[id]          FREE       ROOTED   ENTRY    ENTRY    ENTRY    ENTRY     bytearray
    lanes[(g, m)][id] 0          mask     mask     mask     mask     mask      one list per (group, medium):
                                                                               one bit per slot (worker, dp_rank)
    stamp[id]         -1         -1       -1       -1       9        -1        array('q'): position in ``log``
    log               [1, 2, 3, 4, 5, ..., 4]                                  array('q'): eviction records

    extra_children[2] = 4          children not at ``id + 1`` (here 2 -> 4, a branch; 2 -> 3 is implicit)

Ids are handed out consecutively along a chain, so a chain of ``n`` new blocks costs one ``setdefault`` probe per
block into ``id_of`` and list and array extends (``parent`` and ``log`` copy slices of ``iota``, an ``array('q')``
with ``iota[i] == i``), and its parent links need no child table: ``c`` is a child of ``p`` when ``parent[c] ==
p``, and the children of ``p`` are ``p + 1`` (when ``parent[p + 1] == p``) plus ``extra_children[p]`` (an int for
one, a list for two or more). A chain stored again (another worker) is found by probing its first block and
comparing ``block_hash[i : i + n]`` with the chain. Id 0 is a null entry whose masks are always 0, so
``lane[id_of.get(h, 0)]`` reads 0 for an unknown hash. Ids of deleted entries go to ``free_ids`` and are reused (a
chain of ``n`` takes the last ``n`` when there are that many); per-slot tables (``slot.engine``, ``copies``,
``approx``...) keep block hashes, never ids, so a reused id can never be mistaken for the block it held before.

Kinds: ``FREE`` (unused id), ``ENTRY``, ``ROOTED`` (an entry starting a chain at a namespace seed; parent 0),
``DANGLING`` (a parent hash that is not an entry but has children; parent 0, masks 0).

Invariants:
  * A block is an entry (kind ``ENTRY`` or ``ROOTED``) while some lane holds it or it has children.
  * ``parent[c]`` is an entry or a dangling key for every ``ENTRY`` ``c``; a dangling key has at least one
    child, and becomes an entry (keeping its id) if its block is stored, or goes when its last child goes.
  * ``lanes[k][i]`` is non-zero only for entries; ``lane_sizes[k]`` counts the non-zero ones.
  * Copy counts: a slot holding a block twice on one lane needs as many removals before its bit clears.

Eviction order: ``log`` lists ids oldest first. An id's valid record is at position ``stamp[i]``, or, while
``stamp[i] == -1`` (an entry created by a bulk store and never moved since), its only record; other records of
``i`` are stale and skipped. ``log`` is compacted when stale records outnumber the entries (by 65,536), and after
each pruning pass. A new entry goes to the most recent end; a store of blocks already indexed moves only its last
block there (one append per store, not one per block); an offload store without tokens moves each block it marks.
Pruning takes leaves only, so a block's ancestors never go before it: an ancestor's own position matters only once
every descendant is gone, and then it ranks by its creation or its last store as the last block of a chain.

Gaps (group 0, GPU lane only): a *gap* of slot ``s`` is an ``ENTRY`` ``i`` that ``s`` holds on GPU whose parent
``s`` does not hold on GPU. ``slot.num_gaps`` equals the number of gaps of the slot, kept incrementally on every
change of a GPU holding bit (a hold or drop of ``i`` looks at ``parent[i]`` and at the children of ``i``:
O(children) per block, nothing on the bulk path of a new chain beyond its first block). ``dirty_mask`` has the
bits of the slots with gaps. A slot without gaps holds every ancestor of each block it holds, so along a chain of
block hashes its holder bit is set on a prefix of positions and then never again: ``router.index.query``
binary-searches where each such bit leaves instead of reading every position.
"""

from __future__ import annotations

import sys
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import add, ne
from typing import cast

import numpy as np

from events.types import Medium
from router.index.config import GroupKind, GroupSpec, IndexConfig
from router.index.errors import IndexConfigError
from router.index.slots import ApproxRecord, Journal, JournalWindows, LaneKey, Slot

POOL_MEDIA: frozenset[Medium] = frozenset({Medium.MOONCAKE})
"""Tiers shared by several workers; membership comes from ``set_pool_members``."""
OWN_LOWER_MEDIA: tuple[Medium, ...] = (Medium.CPU, Medium.DISK)
"""A worker's own tiers below the GPU."""
GPU0: LaneKey = (0, Medium.GPU)
"""The lane of group 0 on GPU: the one with gap accounting and the jump search."""

FREE = 0
"""Kind of an unused id (and of the null id 0)."""
ENTRY = 1
"""Kind of an entry with a parent entry or dangling key."""
ENTRY_BYTES = bytes([ENTRY])
FREE_BYTE = bytes([FREE])
ROOTED = 3
"""Kind of an entry starting a chain at a namespace seed (``kind & 1`` is set for both entry kinds)."""
DANGLING = 4
"""Kind of a parent hash that is not an entry but has children."""
DANGLING_BYTE = bytes([DANGLING])
NULL_ID = 0
"""The null id: never an entry, every mask 0; ``parent`` of rooted entries and dangling keys."""
UNSTAMPED = -1
"""``stamp`` of an id whose only eviction record is the one appended when it was created."""
UNSTAMPED_BYTES = UNSTAMPED.to_bytes(8, sys.byteorder, signed=True)

COUNTER_NAMES: tuple[str, ...] = (
    "num_batches",
    "num_events",
    "num_blocks_stored",
    "num_blocks_removed",
    "num_extra_copies_stored",
    "num_unknown_removals",
    "num_removals_not_held",
    "num_orphan_blocks",
    "num_parked_blocks_applied",
    "num_parked_blocks_dropped",
    "num_block_size_mismatch_blocks",
    "num_unsupported_extra_key_blocks",
    "num_unresolved_offload_blocks",
    "num_malformed_events",
    "num_unknown_group_events",
    "num_engine_hash_reuse_blocks",
    "num_pruned_blocks",
    "num_approx_blocks_inserted",
    "num_approx_blocks_expired",
    "num_approx_blocks_withdrawn",
    "num_approx_blocks_confirmed",
    "num_worker_clears",
    "num_resyncs",
)


IOTA_GROWTH = 65536
"""Ids ``IndexState.iota`` grows by past the one asked for."""


class IndexState:
    """Everything a ``PrefixIndex`` stores, with the primitive operations on ids and entries; see the module docstring.

    The tables are public attributes so that the index's collaborators (``router.index.holdings``, ``upkeep``,
    ``ingest``, ``query``), which are given this object, read and write them directly; nothing outside
    ``router.index`` touches them (``PrefixIndex`` is the API).

    Args:
        config: sizes, caps and TTLs.
        pool_members: pool medium -> ids of the workers attached to that pool.
        groups: cache group index -> spec, for hybrid models, on top of ``config.groups`` (group 0 is full
            attention unless given). Events of a group declared neither here nor there are refused.

    Raises:
        IndexConfigError: a non-pool medium in ``pool_members``.
    """

    def __init__(
        self,
        config: IndexConfig | None = None,
        *,
        pool_members: Mapping[Medium, Iterable[str]] | None = None,
        groups: Mapping[int, GroupSpec] | None = None,
    ) -> None:
        self.config = config if config is not None else IndexConfig()
        self.block_size = self.config.block_size
        self.reset_tables((GPU0,))
        self.dirty_mask = 0
        self.slots: dict[tuple[str, int], Slot] = {}
        # Copied on write (``set_roster``), never changed in place: a match result keeps the roster of its time.
        self.slots_by_bit: dict[int, Slot] = {}
        self.slots_of_worker: dict[str, tuple[Slot, ...]] = {}
        self.free_bits: list[int] = []
        self.pool_members: dict[Medium, frozenset[str]] = {}
        self.pool_masks: dict[Medium, int] = {}
        self.groups: dict[int, GroupSpec] = {0: GroupSpec()}
        self.is_hybrid = False
        """More than one cache group, or group 0 not full attention (kept by ``set_group_spec``)."""
        for group_idx, spec in enumerate(self.config.groups):
            self.set_group_spec(group_idx, spec)
        self.approx_queue: list[tuple[float, int, ApproxRecord]] = []  # heap by expiry (router.index.approximate)
        self.approx_seq = self.num_approx = 0
        self.journal_seq = 0  # GPU and pool evictions, pending confirmations so far (journals below and per slot)
        self.windows = JournalWindows()  # the stamps of the decisions still open (``open_journal_window``)
        self.pool_evicted: defaultdict[Medium, Journal] = defaultdict(Journal)
        """Per pool medium: blocks dropped from its group 0 lane by a ``BlockRemoved`` of that medium (the watcher
        saw the master lose them, or a worker said so), stamped with ``journal_seq``: the honesty check reads a pool
        block lost after the decision as a forecast miss of every member, as ``Slot.evicted`` is for one GPU."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        for medium, workers in (pool_members or {}).items():
            self.set_pool_members(medium, workers)
        for group_idx, spec in (groups or {}).items():
            self.set_group_spec(group_idx, spec)

    def journal_floor(self) -> int:
        """The stamp at or below which no open decision reads a journal entry."""
        return self.windows.floor(self.journal_seq)

    def reset_tables(self, lane_keys: Iterable[LaneKey]) -> None:
        """Empty id tables holding only the null id, with empty lanes ``lane_keys`` (plus ``GPU0``)."""
        self.id_of: dict[int, int] = {}
        self.hash_of: list[int] = [0]
        self.parent: array[int] = array("q", [NULL_ID])
        self.kind = bytearray([FREE])
        self.stamp: array[int] = array("q", [UNSTAMPED])
        self.log: array[int] = array("q")
        self.extra_children: dict[int, int | list[int]] = {}
        self.free_ids: list[int] = []
        self.iota: array[int] = array("q", [NULL_ID])
        self.num_ids = 1
        self.num_entries = 0
        self.num_dangling = 0
        self.lanes: dict[LaneKey, list[int]] = {key: [0] for key in (GPU0, *lane_keys)}
        self.lane_sizes: dict[LaneKey, int] = dict.fromkeys(self.lanes, 0)
        self.gpu0: list[int] = self.lanes[GPU0]

    # ------------------------------------------------------------------ configuration

    def set_pool_members(self, medium: Medium, worker_ids: Iterable[str]) -> None:
        """Declare which workers are attached to a shared pool tier (replaces the previous set). A member that
        has no slot yet (no event so far) gets its dp rank 0 slot now, so the pool's entries count for it at once.

        Raises:
            IndexConfigError: ``medium`` is not a pool tier.
        """
        if medium not in POOL_MEDIA:
            raise IndexConfigError(f"{medium} is not a shared pool tier")
        self.pool_members[medium] = members = frozenset(worker_ids)
        for worker_id in members:  # a member reaches the pool before its first event (rank 0's slot)
            if not any(wid == worker_id for wid, _ in self.slots):
                self.slot(worker_id, 0)
        self.recompute_pool_masks()

    def set_group_spec(self, group_idx: int, spec: GroupSpec) -> None:
        """Declare a cache group or change its kind (hybrid models); events of undeclared groups are refused.

        Raises:
            IndexConfigError: a negative group index.
        """
        if group_idx < 0:
            raise IndexConfigError(f"group index must be >= 0, got {group_idx}")
        self.groups[group_idx] = spec
        self.is_hybrid = len(self.groups) > 1 or self.groups[0].kind is not GroupKind.FULL

    def recompute_pool_masks(self) -> None:
        self.pool_masks = {
            medium: sum(s.mask for s in self.slots.values() if s.worker_id in members)
            for medium, members in self.pool_members.items()
        }

    def slot(self, worker_id: str, dp_rank: int) -> Slot:
        slot = self.slots.get((worker_id, dp_rank))
        if slot is None:
            bit = self.free_bits.pop() if self.free_bits else len(self.slots_by_bit)
            slot = Slot(worker_id, dp_rank, bit)
            self.slots[(worker_id, dp_rank)] = slot
            by_bit = self.slots_by_bit.copy()  # copies, not in place: see ``set_roster``
            by_bit[bit] = slot
            self.slots_by_bit = by_bit
            of_worker = self.slots_of_worker.copy()
            of_worker[worker_id] = (*of_worker.get(worker_id, ()), slot)
            self.slots_of_worker = of_worker
            if any(worker_id in members for members in self.pool_members.values()):
                self.recompute_pool_masks()
        return slot

    def set_roster(self) -> None:
        """Rebuild ``slots_by_bit`` and ``slots_of_worker`` from ``slots`` as new dicts (O(slots), on a worker's
        first event, removal or a clear only): a ``MatchResult`` resolves its bits through the dicts of its time."""
        self.slots_by_bit = {slot.bit: slot for slot in self.slots.values()}
        of_worker: dict[str, tuple[Slot, ...]] = {}
        for slot in self.slots.values():
            of_worker[slot.worker_id] = (*of_worker.get(slot.worker_id, ()), slot)
        self.slots_of_worker = of_worker

    def worker_slots(self, worker_id: str) -> tuple[Slot, ...]:
        """The worker's slots in creation order (O(1))."""
        return self.slots_of_worker.get(worker_id, ())

    def lane(self, lane_key: LaneKey) -> list[int]:
        lane = self.lanes.get(lane_key)
        if lane is None:
            lane = self.lanes[lane_key] = [0] * self.num_ids
            self.lane_sizes[lane_key] = 0
        return lane

    # ------------------------------------------------------------------ ids

    def iota_slice(self, start: int, num_ids: int) -> array[int]:
        """``array("q", range(start, start + num_ids))`` by one copy (``iota[i] == i``, grown by ``IOTA_GROWTH``
        past ``end`` from numpy's ``arange`` bytes: 0.1-0.3 ms, not ``array.extend(range(...))``'s 4-7 ms)."""
        iota = self.iota
        end = start + num_ids
        if len(iota) < end:
            iota.frombytes(np.arange(len(iota), end + IOTA_GROWTH, dtype=np.int64).tobytes())
        return iota[start:end]

    def extend_ids(self, num_ids: int) -> int:
        """Append ``num_ids`` fresh ids (kind ``FREE``, masks 0) to every table; returns the first."""
        base = self.num_ids
        self.num_ids = base + num_ids
        self.hash_of.extend(repeat(0, num_ids))
        self.parent.frombytes(bytes(8 * num_ids))
        self.kind.extend(bytes(num_ids))
        self.stamp.frombytes(UNSTAMPED_BYTES * num_ids)
        for lane in self.lanes.values():
            lane.extend(repeat(0, num_ids))
        return base

    def take_id(self, block_hash: int) -> int:
        """An unused id (reused or fresh), mapped from ``block_hash``; its kind is still ``FREE``."""
        new_id = self.free_ids.pop() if self.free_ids else self.extend_ids(1)
        self.id_of[block_hash] = new_id
        self.hash_of[new_id] = block_hash
        return new_id

    def release_id(self, old_id: int) -> None:
        """Return an id without holders, children or parent link to the free list."""
        del self.id_of[self.hash_of[old_id]]
        self.hash_of[old_id] = 0
        self.parent[old_id] = NULL_ID
        self.kind[old_id] = FREE
        self.stamp[old_id] = UNSTAMPED
        self.free_ids.append(old_id)

    def touch(self, entry_id: int) -> None:
        """Move an entry to the most recent end of the eviction order."""
        log = self.log
        self.stamp[entry_id] = len(log)
        log.append(entry_id)

    def compact_log(self) -> None:
        """Drop stale records from the eviction log; stamp every entry with its record's new position (numpy)."""
        if not self.log:
            return
        ids = np.frombuffer(self.log, dtype=np.int64)
        stamp = np.frombuffer(self.stamp, dtype=np.int64)  # a view: the writes below go to ``self.stamp``
        stamps = stamp[ids]
        is_live = (stamps == np.arange(len(ids))) | (stamps == UNSTAMPED)
        is_live &= (np.frombuffer(self.kind, dtype=np.uint8)[ids] & 1).astype(bool)
        live = ids[is_live]
        stamp[live] = np.arange(len(live))
        self.log = array("q", live.tobytes())
        del ids, stamp  # release the buffers: the arrays must stay resizable

    def is_entry_run(self, first: int, num_ids: int) -> bool:
        """Whether ids ``first .. first + num_ids - 1`` are all entries."""
        run = self.kind[first : first + num_ids]
        return FREE_BYTE not in run and (not self.num_dangling or DANGLING_BYTE not in run)

    def parent_id(self, block_hash: int) -> int:
        """Id of a parent hash: its entry, or its dangling key (created when unknown)."""
        parent_id = self.id_of.get(block_hash)
        if parent_id is None:
            parent_id = self.take_id(block_hash)
            self.kind[parent_id] = DANGLING
            self.num_dangling += 1
        return parent_id

    def is_entry_hash(self, block_hash: int) -> bool:
        entry_id = self.id_of.get(block_hash)
        return entry_id is not None and bool(self.kind[entry_id] & 1)

    def find_entry(self, block_hash: int) -> int | None:
        """Id of an entry, or ``None`` when ``block_hash`` is not one."""
        entry_id = self.id_of.get(block_hash)
        if entry_id is None or not self.kind[entry_id] & 1:
            return None
        return entry_id

    # ------------------------------------------------------------------ entries

    def iter_children(self, up: int) -> Iterator[int]:
        nxt = up + 1
        if nxt < self.num_ids and self.parent[nxt] == up:
            yield nxt
        extra = self.extra_children.get(up)
        if extra is None:
            return
        if type(extra) is int:
            yield extra
        else:
            assert isinstance(extra, list)
            yield from extra

    def has_children(self, up: int) -> bool:
        nxt = up + 1
        return (nxt < self.num_ids and self.parent[nxt] == up) or up in self.extra_children

    def add_child(self, up: int, child: int) -> None:
        """Record ``child`` under ``up`` (``parent[child] == up`` is already set)."""
        if child == up + 1:
            return  # implicit
        extra = self.extra_children
        value = extra.get(up)
        if value is None:
            extra[up] = child
        elif type(value) is int:
            extra[up] = [value, child]
        else:
            assert isinstance(value, list)
            value.append(child)

    def remove_child(self, up: int, child: int) -> None:
        """Forget ``child`` under ``up`` (its parent link is reset by the caller); frees a childless dangling key."""
        if child != up + 1:
            extra = self.extra_children
            value = extra.get(up)
            if type(value) is int:
                del extra[up]
            elif isinstance(value, list):
                value.remove(child)
                if len(value) == 1:
                    extra[up] = value[0]
        if self.kind[up] == DANGLING and not self.has_children(up):
            self.num_dangling -= 1
            self.release_id(up)

    def create_chain(
        self, hashes: list[int], ids: Sequence[int], up: int, is_rooted: bool, lane: list[int], mask: int
    ) -> None:
        """Fill the tables of a chain of new entries already mapped in ``id_of``, held by ``mask`` on ``lane``.

        Args:
            hashes: ``[n]`` our block hashes of the chain.
            ids: ``[n]`` their ids: ``num_ids .. num_ids + n - 1`` (fresh, tables extended by array copies), or
                the last ``n`` of ``free_ids``, last first (reused: written by slices when they form one ascending
                run, else per id).
            up: id of the parent of ``hashes[0]`` (``NULL_ID`` when ``is_rooted``).
            is_rooted: the chain starts at a namespace seed.
            lane: the lane to hold the chain on; ``mask``: the holder bit.
        """
        num_blocks = len(hashes)
        parent = self.parent
        kind = self.kind
        log = self.log
        first = ids[0]
        if first == self.num_ids:
            self.num_ids = first + num_blocks
            self.hash_of.extend(hashes)
            fresh = self.iota_slice(first, num_blocks)
            parent.append(up)
            parent.extend(fresh[:-1])
            kind.append(ROOTED if is_rooted else ENTRY)
            kind += ENTRY_BYTES * (num_blocks - 1)
            self.stamp.frombytes(UNSTAMPED_BYTES * num_blocks)
            log.extend(fresh)
            for other in self.lanes.values():
                other.extend(repeat(mask if other is lane else 0, num_blocks))
            if not is_rooted and first != up + 1:
                self.add_child(up, first)
        elif ids[-1] - first == num_blocks - 1 and array("q", ids) == self.iota_slice(first, num_blocks):
            # Reused ids that form one ascending run (a chain freed leaf first): slice writes, implicit links.
            del self.free_ids[-num_blocks:]
            end = first + num_blocks
            self.hash_of[first:end] = hashes
            parent[first] = up
            parent[first + 1 : end] = self.iota_slice(first, num_blocks - 1)
            kind[first:end] = ENTRY_BYTES * num_blocks
            if is_rooted:
                kind[first] = ROOTED
            lane[first:end] = repeat(mask, num_blocks)
            self.stamp[first:end] = self.iota_slice(len(log), num_blocks)
            log.extend(self.iota_slice(first, num_blocks))
            if not is_rooted and first != up + 1:
                self.add_child(up, first)
        else:
            # Reused ids in several ascending runs (chains freed leaf first, one after the other): each run by
            # slice writes as above, linked to the run before it.
            del self.free_ids[-num_blocks:]
            block_hash_of = self.hash_of
            stamp = self.stamp
            prev = up
            cuts = compress(range(1, num_blocks), map(ne, ids[1:], map(add, ids, repeat(1))))
            start = 0
            for end in (*cuts, num_blocks):
                run_first = ids[start]
                length = end - start
                run_end = run_first + length
                block_hash_of[run_first:run_end] = hashes[start:end]
                parent[run_first] = prev
                parent[run_first + 1 : run_end] = self.iota_slice(run_first, length - 1)
                kind[run_first:run_end] = ENTRY_BYTES * length
                lane[run_first:run_end] = repeat(mask, length)
                stamp[run_first:run_end] = self.iota_slice(len(log), length)
                log.extend(self.iota_slice(run_first, length))
                if prev != NULL_ID:
                    self.add_child(prev, run_first)
                prev = run_end - 1
                start = end
            if is_rooted:
                kind[first] = ROOTED
        self.num_entries += num_blocks

    def link(self, hashes: Sequence[int], first_parent: int, is_rooted: bool) -> tuple[list[int], bool, bool]:
        """Create the missing entries of a chain, root-most first, and touch its last block (LRU).

        Only the last block moves to the most recent end of the eviction order: pruning takes leaves only, so
        its ancestors cannot go before it (see "Eviction order" in the module docstring).

        Args:
            hashes: ``[n]`` our block hashes of the chain (``n >= 1``).
            first_parent: parent of ``hashes[0]`` (a block hash, or a namespace seed when ``is_rooted``).
            is_rooted: the chain starts at a namespace seed.

        Returns:
            ``(ids, is_all_new, is_consistent)``: the ``[n]`` entry ids; no block was an entry or a dangling key
            before (none is held, none has children); every entry ``ids[i]`` for ``i >= 1`` has
            ``parent == ids[i - 1]`` (true unless two chains collide).
        """
        id_of = self.id_of
        olds: list[int | None] = list(map(id_of.get, hashes))
        kind = self.kind
        parent = self.parent
        if None not in olds and not (self.num_dangling and any(kind[i] == DANGLING for i in olds if i is not None)):
            # Every block was an entry (a second holder storing the same chain).
            entry_ids = cast(list[int], olds)
            self.touch(entry_ids[-1])
            return entry_ids, False, list(map(parent.__getitem__, entry_ids[1:])) == entry_ids[:-1]
        is_all_new = True
        is_consistent = True
        ids: list[int] = []
        prev = NULL_ID
        for position, (block_hash, old) in enumerate(zip(hashes, olds, strict=True)):
            if old is not None and kind[old] & 1:
                is_all_new = False
                if position and parent[old] != prev:
                    is_consistent = False
                entry_id = old
            else:
                known = id_of.get(block_hash)  # a repeat in the chain, or a dangling key
                entry_id = self.take_id(block_hash) if known is None else known
                if kind[entry_id] == DANGLING:
                    self.num_dangling -= 1
                    is_all_new = False  # its children stay: a holder of one may lose a gap
                if not kind[entry_id] & 1:
                    if is_rooted and not position:
                        kind[entry_id] = ROOTED
                    else:
                        up = prev if position else self.parent_id(first_parent)
                        kind[entry_id] = ENTRY
                        parent[entry_id] = up
                        self.add_child(up, entry_id)
                    self.num_entries += 1
                    self.touch(entry_id)
            ids.append(entry_id)
            prev = entry_id
        last = olds[-1]
        if last is not None and kind[last] & 1 and self.stamp[last] != len(self.log) - 1:
            self.touch(last)
        return ids, is_all_new, is_consistent

    def unlink(self, entry_id: int) -> int:
        """Delete an entry (no holders, no children); returns its parent id (``NULL_ID`` when rooted)."""
        up = self.parent[entry_id]
        is_rooted = self.kind[entry_id] == ROOTED
        self.num_entries -= 1
        self.release_id(entry_id)
        if not is_rooted:
            self.remove_child(up, entry_id)
        return up

    def maybe_delete_entry(self, entry_id: int) -> None:
        """Delete a childless, holderless entry and cascade to its parent."""
        kind = self.kind
        while kind[entry_id] & 1 and not self.has_children(entry_id) and not self.is_held(entry_id):
            entry_id = self.unlink(entry_id)
            if entry_id == NULL_ID:
                return

    def is_held(self, entry_id: int) -> bool:
        return any(lane[entry_id] for lane in self.lanes.values())

    def slot_holds(self, slot: Slot, entry_id: int) -> bool:
        mask = slot.mask
        return any(lane[entry_id] & mask for lane in self.lanes.values())

    def slot_holds_hash(self, slot: Slot, block_hash: int) -> bool:
        entry_id = self.id_of.get(block_hash, NULL_ID)
        mask = slot.mask
        return any(lane[entry_id] & mask for lane in self.lanes.values())

    def holder_mask(self, block_hash: int, lane_key: LaneKey = GPU0) -> int:
        """Slot bits holding a block on one lane (0 when unknown); for tests and debugging."""
        lane = self.lanes.get(lane_key)
        return lane[self.id_of.get(block_hash, NULL_ID)] if lane is not None else 0

    # ------------------------------------------------------------------ gaps (group 0, GPU)

    def add_gaps(self, slot: Slot, delta: int) -> None:
        slot.num_gaps += delta
        if slot.num_gaps:
            self.dirty_mask |= slot.mask
        else:
            self.dirty_mask &= ~slot.mask

    def reset_gaps(self, slot: Slot) -> None:
        slot.num_gaps = 0
        self.dirty_mask &= ~slot.mask

    def is_gap(self, mask: int, entry_id: int) -> bool:
        """Whether an entry held by the slot of ``mask`` on GPU is a gap (its parent is not held there)."""
        if self.kind[entry_id] == ROOTED:
            return False
        return not self.gpu0[self.parent[entry_id]] & mask

    def num_held_children(self, mask: int, entry_id: int, skip: set[int] | None = None) -> int:
        gpu = self.gpu0
        return sum(
            1
            for child in self.iter_children(entry_id)
            if gpu[child] & mask and (skip is None or child not in skip)
        )
