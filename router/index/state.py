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
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import and_, or_
from typing import cast

import numpy as np

from events.types import Medium
from router.index.config import GroupSpec, IndexConfig
from router.index.errors import IndexConfigError
from router.index.slots import LaneKey, Slot

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


class IndexState:
    """Everything a ``PrefixIndex`` stores, with the operations on entries and holdings; see the module docstring.

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
        self._block_size = self.config.block_size
        self._reset_tables((GPU0,))
        self._dirty_mask = 0
        self._slots: dict[tuple[str, int], Slot] = {}
        self._slots_by_bit: dict[int, Slot] = {}
        self._free_bits: list[int] = []
        self._pool_members: dict[Medium, frozenset[str]] = {}
        self._pool_masks: dict[Medium, int] = {}
        self._groups: dict[int, GroupSpec] = {0: GroupSpec()}
        for group_idx, spec in enumerate(self.config.groups):
            self.set_group_spec(group_idx, spec)
        self._approx_queue: list[tuple[float, int, Slot, tuple[int, ...]]] = []  # heap by expiry
        self._approx_seq = 0
        self._num_approx = 0
        self._counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        for medium, workers in (pool_members or {}).items():
            self.set_pool_members(medium, workers)
        for group_idx, spec in (groups or {}).items():
            self.set_group_spec(group_idx, spec)

    def _reset_tables(self, lane_keys: Iterable[LaneKey]) -> None:
        """Empty id tables holding only the null id, with empty lanes ``lane_keys`` (plus ``GPU0``)."""
        self._id_of: dict[int, int] = {}
        self._hash: list[int] = [0]
        self._parent: array[int] = array("q", [NULL_ID])
        self._kind = bytearray([FREE])
        self._stamp: array[int] = array("q", [UNSTAMPED])
        self._log: array[int] = array("q")
        self._extra_children: dict[int, int | list[int]] = {}
        self._free_ids: list[int] = []
        self._iota: array[int] = array("q", [NULL_ID])
        self._num_ids = 1
        self._num_entries = 0
        self._num_dangling = 0
        self._lanes: dict[LaneKey, list[int]] = {key: [0] for key in (GPU0, *lane_keys)}
        self._lane_sizes: dict[LaneKey, int] = dict.fromkeys(self._lanes, 0)
        self._gpu0: list[int] = self._lanes[GPU0]

    # ------------------------------------------------------------------ configuration

    def set_pool_members(self, medium: Medium, worker_ids: Iterable[str]) -> None:
        """Declare which workers are attached to a shared pool tier (replaces the previous set).

        Raises:
            IndexConfigError: ``medium`` is not a pool tier.
        """
        if medium not in POOL_MEDIA:
            raise IndexConfigError(f"{medium} is not a shared pool tier")
        self._pool_members[medium] = frozenset(worker_ids)
        self._recompute_pool_masks()

    def set_group_spec(self, group_idx: int, spec: GroupSpec) -> None:
        """Declare a cache group or change its kind (hybrid models); events of undeclared groups are refused.

        Raises:
            IndexConfigError: a negative group index.
        """
        if group_idx < 0:
            raise IndexConfigError(f"group index must be >= 0, got {group_idx}")
        self._groups[group_idx] = spec

    def _recompute_pool_masks(self) -> None:
        self._pool_masks = {
            medium: sum(s.mask for s in self._slots.values() if s.worker_id in members)
            for medium, members in self._pool_members.items()
        }

    def _slot(self, worker_id: str, dp_rank: int) -> Slot:
        slot = self._slots.get((worker_id, dp_rank))
        if slot is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._slots_by_bit)
            slot = Slot(worker_id, dp_rank, bit)
            self._slots[(worker_id, dp_rank)] = slot
            self._slots_by_bit[bit] = slot
            if any(worker_id in members for members in self._pool_members.values()):
                self._recompute_pool_masks()
        return slot

    def _worker_slots(self, worker_id: str) -> list[Slot]:
        return [slot for (wid, _), slot in self._slots.items() if wid == worker_id]

    def _lane(self, lane_key: LaneKey) -> list[int]:
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._lanes[lane_key] = [0] * self._num_ids
            self._lane_sizes[lane_key] = 0
        return lane

    # ------------------------------------------------------------------ ids

    def _iota_slice(self, start: int, num_ids: int) -> array[int]:
        """``array("q", range(start, start + num_ids))`` by one copy (``iota[i] == i``, grown on demand)."""
        iota = self._iota
        end = start + num_ids
        if len(iota) < end:
            iota.extend(range(len(iota), end + 65536))
        return iota[start:end]

    def _extend_ids(self, num_ids: int) -> int:
        """Append ``num_ids`` fresh ids (kind ``FREE``, masks 0) to every table; returns the first."""
        base = self._num_ids
        self._num_ids = base + num_ids
        self._hash.extend(repeat(0, num_ids))
        self._parent.frombytes(bytes(8 * num_ids))
        self._kind.extend(bytes(num_ids))
        self._stamp.frombytes(UNSTAMPED_BYTES * num_ids)
        for lane in self._lanes.values():
            lane.extend(repeat(0, num_ids))
        return base

    def _take_id(self, block_hash: int) -> int:
        """An unused id (reused or fresh), mapped from ``block_hash``; its kind is still ``FREE``."""
        new_id = self._free_ids.pop() if self._free_ids else self._extend_ids(1)
        self._id_of[block_hash] = new_id
        self._hash[new_id] = block_hash
        return new_id

    def _release_id(self, old_id: int) -> None:
        """Return an id without holders, children or parent link to the free list."""
        del self._id_of[self._hash[old_id]]
        self._hash[old_id] = 0
        self._parent[old_id] = NULL_ID
        self._kind[old_id] = FREE
        self._stamp[old_id] = UNSTAMPED
        self._free_ids.append(old_id)

    def _touch(self, entry_id: int) -> None:
        """Move an entry to the most recent end of the eviction order."""
        log = self._log
        self._stamp[entry_id] = len(log)
        log.append(entry_id)

    def _compact_log(self) -> None:
        """Drop stale records from the eviction log, and stamp every entry with its record's new position (O(log
        length), vectorized: a few numpy passes over ``log``, ``stamp`` and ``kind``)."""
        if not self._log:
            return
        ids = np.frombuffer(self._log, dtype=np.int64)
        stamp = np.frombuffer(self._stamp, dtype=np.int64)  # a view: the writes below go to ``self._stamp``
        stamps = stamp[ids]
        is_live = (stamps == np.arange(len(ids))) | (stamps == UNSTAMPED)
        is_live &= (np.frombuffer(self._kind, dtype=np.uint8)[ids] & 1).astype(bool)
        live = ids[is_live]
        stamp[live] = np.arange(len(live))
        self._log = array("q", live.tobytes())
        del ids, stamp  # release the buffers: the arrays must stay resizable

    def _is_entry_run(self, first: int, num_ids: int) -> bool:
        """Whether ids ``first .. first + num_ids - 1`` are all entries."""
        run = self._kind[first : first + num_ids]
        return FREE_BYTE not in run and (not self._num_dangling or DANGLING_BYTE not in run)

    def _parent_id(self, block_hash: int) -> int:
        """Id of a parent hash: its entry, or its dangling key (created when unknown)."""
        parent_id = self._id_of.get(block_hash)
        if parent_id is None:
            parent_id = self._take_id(block_hash)
            self._kind[parent_id] = DANGLING
            self._num_dangling += 1
        return parent_id

    def _is_entry_hash(self, block_hash: int) -> bool:
        entry_id = self._id_of.get(block_hash)
        return entry_id is not None and bool(self._kind[entry_id] & 1)

    def _entry_id(self, block_hash: int) -> int | None:
        """Id of an entry, or ``None`` when ``block_hash`` is not one."""
        entry_id = self._id_of.get(block_hash)
        if entry_id is None or not self._kind[entry_id] & 1:
            return None
        return entry_id

    # ------------------------------------------------------------------ entries

    def _iter_children(self, up: int) -> Iterator[int]:
        nxt = up + 1
        if nxt < self._num_ids and self._parent[nxt] == up:
            yield nxt
        extra = self._extra_children.get(up)
        if extra is None:
            return
        if type(extra) is int:
            yield extra
        else:
            assert isinstance(extra, list)
            yield from extra

    def _has_children(self, up: int) -> bool:
        nxt = up + 1
        return (nxt < self._num_ids and self._parent[nxt] == up) or up in self._extra_children

    def _add_child(self, up: int, child: int) -> None:
        """Record ``child`` under ``up`` (``parent[child] == up`` is already set)."""
        if child == up + 1:
            return  # implicit
        extra = self._extra_children
        value = extra.get(up)
        if value is None:
            extra[up] = child
        elif type(value) is int:
            extra[up] = [value, child]
        else:
            assert isinstance(value, list)
            value.append(child)

    def _remove_child(self, up: int, child: int) -> None:
        """Forget ``child`` under ``up`` (its parent link is reset by the caller); frees a childless dangling key."""
        if child != up + 1:
            extra = self._extra_children
            value = extra.get(up)
            if type(value) is int:
                del extra[up]
            elif isinstance(value, list):
                value.remove(child)
                if len(value) == 1:
                    extra[up] = value[0]
        if self._kind[up] == DANGLING and not self._has_children(up):
            self._num_dangling -= 1
            self._release_id(up)

    def _create_chain(
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
        parent = self._parent
        kind = self._kind
        log = self._log
        first = ids[0]
        if first == self._num_ids:
            self._num_ids = first + num_blocks
            self._hash.extend(hashes)
            fresh = self._iota_slice(first, num_blocks)
            parent.append(up)
            parent.extend(fresh[:-1])
            kind.append(ROOTED if is_rooted else ENTRY)
            kind += ENTRY_BYTES * (num_blocks - 1)
            self._stamp.frombytes(UNSTAMPED_BYTES * num_blocks)
            log.extend(fresh)
            for other in self._lanes.values():
                other.extend(repeat(mask if other is lane else 0, num_blocks))
            if not is_rooted and first != up + 1:
                self._add_child(up, first)
        elif ids[-1] - first == num_blocks - 1 and array("q", ids) == self._iota_slice(first, num_blocks):
            # Reused ids that form one ascending run (a chain freed leaf first): slice writes, implicit links.
            del self._free_ids[-num_blocks:]
            end = first + num_blocks
            self._hash[first:end] = hashes
            parent[first] = up
            parent[first + 1 : end] = self._iota_slice(first, num_blocks - 1)
            kind[first:end] = ENTRY_BYTES * num_blocks
            if is_rooted:
                kind[first] = ROOTED
            lane[first:end] = repeat(mask, num_blocks)
            self._stamp[first:end] = self._iota_slice(len(log), num_blocks)
            log.extend(self._iota_slice(first, num_blocks))
            if not is_rooted and first != up + 1:
                self._add_child(up, first)
        else:
            del self._free_ids[-num_blocks:]
            block_hash_of = self._hash
            stamp = self._stamp
            prev = up
            for entry_id, block_hash in zip(ids, hashes, strict=True):
                block_hash_of[entry_id] = block_hash
                parent[entry_id] = prev
                kind[entry_id] = ENTRY
                lane[entry_id] = mask
                stamp[entry_id] = len(log)
                log.append(entry_id)
                if prev != NULL_ID:
                    self._add_child(prev, entry_id)
                prev = entry_id
            if is_rooted:
                kind[first] = ROOTED
        self._num_entries += num_blocks

    def _link(self, hashes: Sequence[int], first_parent: int, is_rooted: bool) -> tuple[list[int], bool, bool]:
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
        id_of = self._id_of
        olds: list[int | None] = list(map(id_of.get, hashes))
        kind = self._kind
        parent = self._parent
        if None not in olds and not (self._num_dangling and any(kind[i] == DANGLING for i in olds if i is not None)):
            # Every block was an entry (a second holder storing the same chain).
            entry_ids = cast(list[int], olds)
            self._touch(entry_ids[-1])
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
                entry_id = self._take_id(block_hash) if known is None else known
                if kind[entry_id] == DANGLING:
                    self._num_dangling -= 1
                    is_all_new = False  # its children stay: a holder of one may lose a gap
                if not kind[entry_id] & 1:
                    if is_rooted and not position:
                        kind[entry_id] = ROOTED
                    else:
                        up = prev if position else self._parent_id(first_parent)
                        kind[entry_id] = ENTRY
                        parent[entry_id] = up
                        self._add_child(up, entry_id)
                    self._num_entries += 1
                    self._touch(entry_id)
            ids.append(entry_id)
            prev = entry_id
        last = olds[-1]
        if last is not None and kind[last] & 1 and self._stamp[last] != len(self._log) - 1:
            self._touch(last)
        return ids, is_all_new, is_consistent

    def _unlink(self, entry_id: int) -> int:
        """Delete an entry (no holders, no children); returns its parent id (``NULL_ID`` when rooted)."""
        up = self._parent[entry_id]
        is_rooted = self._kind[entry_id] == ROOTED
        self._num_entries -= 1
        self._release_id(entry_id)
        if not is_rooted:
            self._remove_child(up, entry_id)
        return up

    def _maybe_delete_entry(self, entry_id: int) -> None:
        """Delete a childless, holderless entry and cascade to its parent."""
        kind = self._kind
        while kind[entry_id] & 1 and not self._has_children(entry_id) and not self._is_held(entry_id):
            entry_id = self._unlink(entry_id)
            if entry_id == NULL_ID:
                return

    def _is_held(self, entry_id: int) -> bool:
        return any(lane[entry_id] for lane in self._lanes.values())

    def _slot_holds(self, slot: Slot, entry_id: int) -> bool:
        mask = slot.mask
        return any(lane[entry_id] & mask for lane in self._lanes.values())

    def _slot_holds_hash(self, slot: Slot, block_hash: int) -> bool:
        entry_id = self._id_of.get(block_hash, NULL_ID)
        mask = slot.mask
        return any(lane[entry_id] & mask for lane in self._lanes.values())

    def holder_mask(self, block_hash: int, lane_key: LaneKey = GPU0) -> int:
        """Slot bits holding a block on one lane (0 when unknown); for tests and debugging."""
        lane = self._lanes.get(lane_key)
        return lane[self._id_of.get(block_hash, NULL_ID)] if lane is not None else 0

    # ------------------------------------------------------------------ gaps (group 0, GPU)

    def _add_gaps(self, slot: Slot, delta: int) -> None:
        slot.num_gaps += delta
        if slot.num_gaps:
            self._dirty_mask |= slot.mask
        else:
            self._dirty_mask &= ~slot.mask

    def _reset_gaps(self, slot: Slot) -> None:
        slot.num_gaps = 0
        self._dirty_mask &= ~slot.mask

    def _is_gap(self, mask: int, entry_id: int) -> bool:
        """Whether an entry held by the slot of ``mask`` on GPU is a gap (its parent is not held there)."""
        if self._kind[entry_id] == ROOTED:
            return False
        return not self._gpu0[self._parent[entry_id]] & mask

    def _num_held_children(self, mask: int, entry_id: int, skip: set[int] | None = None) -> int:
        gpu = self._gpu0
        return sum(
            1
            for child in self._iter_children(entry_id)
            if gpu[child] & mask and (skip is None or child not in skip)
        )

    def _gaps_after_chain_hold(
        self, slot: Slot, ids: Sequence[int], olds: list[int], is_consistent: bool
    ) -> None:
        """Account gaps after the slot's bit was set on every block of a chain (``olds``: masks before)."""
        mask = slot.mask
        if is_consistent and not slot.num_gaps:  # only the first block can be a new gap
            if not olds[0] & mask and self._is_gap(mask, ids[0]):
                self._add_gaps(slot, 1)
            return
        newly = list(dict.fromkeys(i for i, old in zip(ids, olds, strict=True) if not old & mask))
        if not newly:
            return
        if is_consistent:
            delta = int(not olds[0] & mask and self._is_gap(mask, ids[0]))
        else:
            delta = sum(1 for i in newly if self._is_gap(mask, i))
        if slot.num_gaps:
            skip = set(newly)
            delta -= sum(self._num_held_children(mask, i, skip) for i in newly)
        if delta:
            self._add_gaps(slot, delta)

    def _gaps_after_hold_one(self, slot: Slot, entry_id: int) -> None:
        mask = slot.mask
        delta = int(self._is_gap(mask, entry_id))
        if slot.num_gaps:
            delta -= self._num_held_children(mask, entry_id)
        if delta:
            self._add_gaps(slot, delta)

    def _gaps_after_drop(self, slot: Slot, entry_id: int) -> None:
        """Account gaps after the slot's GPU bit of an entry was cleared (before the entry may go)."""
        mask = slot.mask
        delta = self._num_held_children(mask, entry_id) - int(self._is_gap(mask, entry_id))
        if delta:
            self._add_gaps(slot, delta)

    # ------------------------------------------------------------------ holdings

    def _hold(self, slot: Slot, lane_key: LaneKey, hashes: list[int], first_parent: int, is_rooted: bool) -> None:
        """Add the slot as holder of a chain on one lane (with copy counting and approximate confirmation)."""
        lane = self._lanes.get(lane_key) or self._lane(lane_key)
        mask = slot.mask
        num_blocks = len(hashes)
        id_of = self._id_of
        up = NULL_ID if is_rooted else id_of.get(first_parent, NULL_ID)
        if is_rooted or up != NULL_ID:
            first = id_of.get(hashes[0], NULL_ID)
            if (
                first != NULL_ID
                and self._hash[first : first + num_blocks] == hashes
                and self._is_entry_run(first, num_blocks)
            ):
                # Blocks already indexed under consecutive ids (another worker storing the same chain): the
                # first probe is the only random access.
                self._hold_entries(slot, lane_key, lane, range(first, first + num_blocks))
                return
            # One probe per block: new blocks get candidate ids, blocks already indexed give theirs.
            free_ids = self._free_ids
            base = self._num_ids
            # Reused ids are taken in reverse: a chain freed leaf first lies in ``free_ids`` as a descending run.
            candidates: Sequence[int] = (
                free_ids[: -num_blocks - 1 : -1] if len(free_ids) >= num_blocks else range(base, base + num_blocks)
            )
            num_before = len(id_of)
            ids = list(map(id_of.setdefault, hashes, candidates))
            num_new = len(id_of) - num_before
            if num_new == num_blocks:  # all new (a growing conversation): bulk inserts at C speed
                self._create_chain(hashes, candidates, up, is_rooted, lane, mask)
                slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
                self._lane_sizes[lane_key] += num_blocks
                if lane_key == GPU0 and not is_rooted and not self._gpu0[up] & mask:
                    self._add_gaps(slot, 1)
                return
            if not num_new and not (self._num_dangling and any(self._kind[i] == DANGLING for i in ids)):
                # Every block an entry (another worker storing the same chain).
                self._hold_entries(slot, lane_key, lane, ids)
                return
            for block_hash, entry_id, candidate in zip(hashes, ids, candidates, strict=True):
                if entry_id == candidate:  # undo; the general path below creates the entries
                    del id_of[block_hash]
        ids, is_all_new, is_consistent = self._link(hashes, first_parent, is_rooted)
        if is_all_new:  # new entries are held nowhere yet and have no children
            for entry_id in ids:
                lane[entry_id] = mask
            slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
            self._lane_sizes[lane_key] += num_blocks
            if lane_key == GPU0 and not is_rooted and not self._gpu0[self._parent[ids[0]]] & mask:
                self._add_gaps(slot, 1)
            return
        self._hold_entries(slot, lane_key, lane, ids, is_consistent, is_touched=True)

    def _hold_entries(
        self,
        slot: Slot,
        lane_key: LaneKey,
        lane: list[int],
        ids: Sequence[int],
        is_consistent: bool | None = None,
        *,
        is_touched: bool = False,
    ) -> None:
        """Set the slot's bit on entries of a chain (``[n]`` ids, root-most first; a ``range`` for consecutive
        ids), with copies and gaps.

        ``is_consistent`` (every ``ids[i]`` has parent ``ids[i - 1]``) is computed when ``None``; the last
        block moves to the most recent end of the eviction order unless ``is_touched``.
        """
        mask = slot.mask
        num_blocks = len(ids)
        first = ids[0]
        is_run = type(ids) is range or (
            ids[-1] - first == num_blocks - 1 and list(ids) == list(range(first, first + num_blocks))
        )
        if is_consistent is None:
            parent = self._parent
            if is_run:
                is_consistent = parent[first + 1 : first + num_blocks] == self._iota_slice(first, num_blocks - 1)
            else:
                is_consistent = list(map(parent.__getitem__, ids[1:])) == list(ids[:-1])
        if not is_touched:
            log = self._log
            self._stamp[ids[-1]] = len(log)
            log.append(ids[-1])
        olds = lane[first : first + num_blocks] if is_run else list(map(lane.__getitem__, ids))
        old = olds[0]
        if is_run and not old & mask and olds.count(old) == num_blocks:
            # One holder set over the whole run (the common case): one new mask object, shared.
            lane[first : first + num_blocks] = [old | mask] * num_blocks
            slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
            if not old:
                self._lane_sizes[lane_key] += num_blocks
            if lane_key == GPU0:
                self._gaps_after_chain_hold(slot, ids, olds, is_consistent)
            return
        news = list(map(or_, olds, repeat(mask)))
        if is_run:
            lane[first : first + num_blocks] = news
        else:
            for entry_id, new in zip(ids, news, strict=True):
                lane[entry_id] = new
        dups = [i for i, old in zip(ids, olds, strict=True) if old & mask] if any(map(and_, olds, repeat(mask))) else []
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks - len(dups)
        self._lane_sizes[lane_key] += olds.count(0)
        if lane_key == GPU0:
            self._gaps_after_chain_hold(slot, ids, olds, is_consistent)
        for entry_id in dups:
            self._add_copy(slot, lane_key, entry_id)

    def _hold_one(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> None:
        lane = self._lane(lane_key)
        self._touch(entry_id)
        old = lane[entry_id]
        if old & slot.mask:
            self._add_copy(slot, lane_key, entry_id)
            return
        lane[entry_id] = old | slot.mask
        if not old:
            self._lane_sizes[lane_key] += 1
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + 1
        if lane_key == GPU0:
            self._gaps_after_hold_one(slot, entry_id)

    def _add_copy(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> None:
        block_hash = self._hash[entry_id]
        if lane_key == GPU0 and slot.approx.pop(block_hash, None) is not None:
            self._num_approx -= 1
            self._counters["num_approx_blocks_confirmed"] += 1
            return
        key = (lane_key, block_hash)
        slot.copies[key] = slot.copies.get(key, 0) + 1
        self._counters["num_extra_copies_stored"] += 1

    def _drop(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> bool:
        """Remove one holding (one copy) of an entry; returns whether the slot held it on that lane."""
        block_hash = self._hash[entry_id]
        key = (lane_key, block_hash)
        if slot.copies:
            extra = slot.copies.get(key)
            if extra:
                if extra == 1:
                    del slot.copies[key]
                else:
                    slot.copies[key] = extra - 1
                return True
        lane = self._lanes.get(lane_key)
        if lane is None:
            return False
        mask = lane[entry_id]
        if not mask & slot.mask:
            return False
        mask &= ~slot.mask
        lane[entry_id] = mask
        slot.num_held[lane_key] -= 1
        if lane_key == GPU0:
            self._gaps_after_drop(slot, entry_id)
            if slot.approx and slot.approx.pop(block_hash, None) is not None:
                self._num_approx -= 1
        if slot.span_held:
            slot.span_held.discard(key)
        if not mask:
            self._lane_sizes[lane_key] -= 1
            self._maybe_delete_entry(entry_id)
        return True

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recompute the derived structures from scratch and compare (for tests and debugging; O(index)).

        Raises:
            RuntimeError: the id tables, children, dangling keys, the eviction log, ``num_held`` or the gap
                counts disagree with the parent links and the lanes.
        """
        num_ids = self._num_ids
        kind = self._kind
        parent = self._parent
        tables = (self._hash, parent, kind, self._stamp, *self._lanes.values())
        if any(len(table) != num_ids for table in tables):
            raise RuntimeError("per-id tables differ in length")
        if kind[NULL_ID] != FREE or any(lane[NULL_ID] for lane in self._lanes.values()):
            raise RuntimeError("the null id is in use")
        for block_hash, entry_id in self._id_of.items():
            if self._hash[entry_id] != block_hash or kind[entry_id] == FREE:
                raise RuntimeError(f"id_of[{block_hash}] = {entry_id} disagrees with the id tables")
        free = [i for i in range(1, num_ids) if kind[i] == FREE]
        if len(self._id_of) + len(free) != num_ids - 1 or sorted(free) != sorted(self._free_ids):
            raise RuntimeError("free ids disagree with the kinds")
        entries = [i for i in range(1, num_ids) if kind[i] & 1]
        if len(entries) != self._num_entries:
            raise RuntimeError(f"{self._num_entries} entries counted, {len(entries)} real")
        expected: dict[int, list[int]] = {}
        for child in entries:
            if kind[child] == ENTRY:
                up = parent[child]
                if not (kind[up] & 1 or kind[up] == DANGLING):
                    raise RuntimeError(f"entry {child} has a free parent id {up}")
                expected.setdefault(up, []).append(child)
            elif parent[child] != NULL_ID:
                raise RuntimeError(f"rooted entry {child} has a parent")
        actual = {up: sorted(self._iter_children(up)) for up in range(1, num_ids)}
        if {up: c for up, c in actual.items() if c} != {up: sorted(c) for up, c in expected.items()}:
            raise RuntimeError("children disagree with parent links")
        dangling = [i for i in range(1, num_ids) if kind[i] == DANGLING]
        if len(dangling) != self._num_dangling or any(i not in expected for i in dangling):
            raise RuntimeError("dangling keys disagree")
        log = self._log
        num_records = Counter(log)
        for entry_id in entries:
            pos = self._stamp[entry_id]
            if pos == UNSTAMPED and num_records[entry_id] == 1:
                continue
            if not 0 <= pos < len(log) or log[pos] != entry_id:
                raise RuntimeError(f"entry {entry_id} has no valid eviction record")
            if not self._is_held(entry_id) and entry_id not in expected:
                raise RuntimeError(f"entry {entry_id} has neither holders nor children")
        for lane_key, lane in self._lanes.items():
            if any(lane[i] and not kind[i] & 1 for i in range(num_ids)):
                raise RuntimeError(f"a block held on {lane_key} is not an entry")
            if self._lane_sizes[lane_key] != sum(1 for m in lane if m):
                raise RuntimeError(f"size of lane {lane_key} is off")
        dirty = 0
        gpu = self._gpu0
        for slot in self._slots.values():
            mask = slot.mask
            for lane_key, lane in self._lanes.items():
                if slot.num_held.get(lane_key, 0) != sum(1 for m in lane if m & mask):
                    raise RuntimeError(f"num_held of {slot.worker_id}/{slot.dp_rank} on {lane_key} is off")
            num_gaps = sum(1 for i in range(num_ids) if gpu[i] & mask and self._is_gap(mask, i))
            if num_gaps != slot.num_gaps:
                raise RuntimeError(f"{slot.worker_id}/{slot.dp_rank}: {slot.num_gaps} gaps counted, {num_gaps} real")
            if num_gaps:
                dirty |= mask
        if dirty != self._dirty_mask:
            raise RuntimeError("dirty mask disagrees with the gap counts")
