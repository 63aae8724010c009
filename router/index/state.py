"""State of the prefix index and its primitive operations: entries (the chain structure) and holdings.

Layout (plain dicts of ints, no object per block)::

    lanes[(group, medium)] : {block_hash -> holder mask}      one bit per slot (worker, dp_rank)
    parent                 : {block_hash -> parent hash}      one entry per block; insertion order = eviction order
    children               : {block_hash -> child | [child]}  the entries whose parent pointer is the key
    rooted                 : {block_hash}                     entries starting a chain at a namespace seed
    slot.num_gaps          : int                              per slot, see "Gaps" below

Invariants:
  * A block is an entry (``block_hash in parent``) while some lane holds it or it has children.
  * ``c`` is in ``children[parent[c]]`` for every entry ``c`` not in ``rooted``, also while ``parent[c]`` is not
    (or no longer) an entry; such a key is listed in ``dangling`` until it becomes an entry or loses its
    children. A single child is stored as the int itself, two or more as a list.
  * Copy counts: a slot holding a block twice on one lane needs as many removals before its bit clears.

Eviction order: ``parent``'s insertion order, oldest first. A new entry goes to the most recent end; a store
of blocks already indexed moves only its last block there (one dict move per store, not one per block); an
offload store without tokens moves each block it marks.
Pruning takes leaves only, so a block's ancestors never go before it: an ancestor's own position matters only
once every descendant is gone, and then it ranks by its creation or its last store as the last block of a chain.

Gaps (group 0, GPU lane only): a *gap* of slot ``s`` is a block ``h`` that ``s`` holds on GPU with ``h`` not in
``rooted`` and ``parent[h]`` not held by ``s`` on GPU. ``slot.num_gaps`` equals the number of gaps of the slot,
kept incrementally on every change of a GPU holding bit (a hold or drop of ``h`` looks at ``parent[h]`` and at
``children[h]``: O(children) per block, nothing on the bulk path of a new chain beyond its first block).
``dirty_mask`` has the bits of the slots with gaps. A slot without gaps holds every ancestor of each block it
holds, so along a chain of block hashes its holder bit is set on a prefix of positions and then never again:
``router.index.query`` binary-searches where each such bit leaves instead of reading every position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import repeat
from operator import and_, or_

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
    "num_pruned_blocks",
    "num_approx_blocks_inserted",
    "num_approx_blocks_expired",
    "num_approx_blocks_confirmed",
    "num_worker_clears",
    "num_resyncs",
)


def iter_children(value: int | list[int] | None) -> Iterable[int]:
    """The children stored under one ``children`` key (an int, a list, or ``None`` for none)."""
    if value is None:
        return ()
    if type(value) is int:
        return (value,)
    assert isinstance(value, list)
    return value


class IndexState:
    """Everything a ``PrefixIndex`` stores, with the operations on entries and holdings; see the module docstring.

    Args:
        config: sizes, caps and TTLs.
        pool_members: pool medium -> ids of the workers attached to that pool.
        groups: cache group index -> spec, for hybrid models (group 0 is full attention unless given).

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
        self._gpu0: dict[int, int] = {}
        self._lanes: dict[LaneKey, dict[int, int]] = {GPU0: self._gpu0}
        self._parent: dict[int, int] = {}
        self._children: dict[int, int | list[int]] = {}
        self._rooted: set[int] = set()
        self._dangling: set[int] = set()
        self._dirty_mask = 0
        self._slots: dict[tuple[str, int], Slot] = {}
        self._slots_by_bit: dict[int, Slot] = {}
        self._free_bits: list[int] = []
        self._pool_members: dict[Medium, frozenset[str]] = {}
        self._pool_masks: dict[Medium, int] = {}
        self._groups: dict[int, GroupSpec] = {0: GroupSpec()}
        self._approx_queue: list[tuple[float, int, Slot, tuple[int, ...]]] = []  # heap by expiry
        self._approx_seq = 0
        self._num_approx = 0
        self._counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        for medium, workers in (pool_members or {}).items():
            self.set_pool_members(medium, workers)
        for group_idx, spec in (groups or {}).items():
            self.set_group_spec(group_idx, spec)

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
        """Declare the kind of a cache group (hybrid models).

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

    # ------------------------------------------------------------------ entries

    def _add_child(self, up: int, child: int) -> None:
        children = self._children
        value = children.get(up)
        if value is None:
            children[up] = child
            if up not in self._parent:
                self._dangling.add(up)
        elif type(value) is int:
            children[up] = [value, child]
        else:
            assert isinstance(value, list)
            value.append(child)

    def _remove_child(self, up: int, child: int) -> None:
        children = self._children
        value = children.get(up)
        if type(value) is int:
            del children[up]
            if self._dangling:
                self._dangling.discard(up)
        elif isinstance(value, list):
            value.remove(child)
            if len(value) == 1:
                children[up] = value[0]

    def _link(self, hashes: list[int], first_parent: int, is_rooted: bool) -> tuple[bool, bool]:
        """Create the missing entries of a chain, root-most first, and touch its last block (LRU).

        Only the last block moves to the most recent end of ``parent``: pruning takes leaves only, so its
        ancestors cannot go before it (see "Eviction order" in the module docstring).

        Args:
            hashes: ``[n]`` our block hashes of the chain.
            first_parent: parent of ``hashes[0]`` (a block hash, or a namespace seed when ``is_rooted``).
            is_rooted: the chain starts at a namespace seed.

        Returns:
            ``(is_all_new, is_consistent)``: no block was an entry before; every entry ``hashes[i]`` for
            ``i >= 1`` has ``parent == hashes[i - 1]`` (true unless two chains collide).
        """
        parent = self._parent
        if parent.keys().isdisjoint(hashes) and (not self._dangling or self._dangling.isdisjoint(hashes)):
            # All new (the common case of a growing conversation): bulk inserts at C speed.
            parent.update(zip(hashes, [first_parent, *hashes[:-1]], strict=True))
            if len(hashes) > 1:
                self._children.update(zip(hashes[:-1], hashes[1:], strict=True))
            if is_rooted:
                self._rooted.add(hashes[0])
            else:
                self._add_child(first_parent, hashes[0])
            return True, True
        olds = list(map(parent.get, hashes))
        last = hashes[-1]
        if None not in olds:  # every block was an entry (a second holder storing the same chain)
            parent[last] = parent.pop(last)
            return False, olds[1:] == hashes[:-1]
        is_consistent = True
        prev = first_parent
        for position, (block_hash, old) in enumerate(zip(hashes, olds, strict=True)):
            if old is not None:
                if old != prev and position:
                    is_consistent = False
            elif block_hash not in parent:  # (a block repeated in the chain was inserted already)
                parent[block_hash] = prev
                if is_rooted and not position:
                    self._rooted.add(block_hash)
                else:
                    self._add_child(prev, block_hash)
                if self._dangling:
                    self._dangling.discard(block_hash)
            prev = block_hash
        if olds[-1] is not None:
            parent[last] = parent.pop(last)
        return False, is_consistent

    def _unlink(self, block_hash: int) -> int:
        """Delete an entry (no holders, no children); returns its parent hash."""
        up = self._parent.pop(block_hash)
        if block_hash in self._rooted:
            self._rooted.discard(block_hash)
        else:
            self._remove_child(up, block_hash)
        return up

    def _maybe_delete_entry(self, block_hash: int) -> None:
        """Delete a childless, holderless entry and cascade to its parent."""
        parent = self._parent
        children = self._children
        while block_hash in parent and block_hash not in children and not self._is_held(block_hash):
            is_rooted = block_hash in self._rooted
            block_hash = self._unlink(block_hash)
            if is_rooted:
                return

    def _is_held(self, block_hash: int) -> bool:
        return any(block_hash in lane for lane in self._lanes.values())

    def _slot_holds(self, slot: Slot, block_hash: int) -> bool:
        mask = slot.mask
        return any(lane.get(block_hash, 0) & mask for lane in self._lanes.values())

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

    def _is_gap(self, mask: int, block_hash: int) -> bool:
        """Whether a block held by the slot of ``mask`` on GPU is a gap (its parent is not held there)."""
        if block_hash in self._rooted:
            return False
        return not self._gpu0.get(self._parent[block_hash], 0) & mask

    def _num_held_children(self, mask: int, block_hash: int, skip: set[int] | None = None) -> int:
        gpu = self._gpu0
        return sum(
            1
            for child in iter_children(self._children.get(block_hash))
            if gpu.get(child, 0) & mask and (skip is None or child not in skip)
        )

    def _gaps_after_chain_hold(self, slot: Slot, hashes: list[int], olds: list[int], is_consistent: bool) -> None:
        """Account gaps after the slot's bit was set on every block of a chain (``olds``: masks before)."""
        mask = slot.mask
        if is_consistent and not slot.num_gaps:  # only the first block can be a new gap
            if not olds[0] & mask and self._is_gap(mask, hashes[0]):
                self._add_gaps(slot, 1)
            return
        newly = list(dict.fromkeys(h for h, old in zip(hashes, olds, strict=True) if not old & mask))
        if not newly:
            return
        if is_consistent:
            delta = int(not olds[0] & mask and self._is_gap(mask, hashes[0]))
        else:
            delta = sum(1 for h in newly if self._is_gap(mask, h))
        if slot.num_gaps:
            skip = set(newly)
            delta -= sum(self._num_held_children(mask, h, skip) for h in newly if h in self._children)
        if delta:
            self._add_gaps(slot, delta)

    def _gaps_after_hold_one(self, slot: Slot, block_hash: int) -> None:
        mask = slot.mask
        delta = int(self._is_gap(mask, block_hash))
        if slot.num_gaps:
            delta -= self._num_held_children(mask, block_hash)
        if delta:
            self._add_gaps(slot, delta)

    def _gaps_after_drop(self, slot: Slot, block_hash: int) -> None:
        """Account gaps after the slot's GPU bit of an entry was cleared (before the entry may go)."""
        mask = slot.mask
        delta = self._num_held_children(mask, block_hash) - int(self._is_gap(mask, block_hash))
        if delta:
            self._add_gaps(slot, delta)

    # ------------------------------------------------------------------ holdings

    def _hold(self, slot: Slot, lane_key: LaneKey, hashes: list[int], first_parent: int, is_rooted: bool) -> None:
        """Add the slot as holder of a chain on one lane (with copy counting and approximate confirmation)."""
        is_all_new, is_consistent = self._link(hashes, first_parent, is_rooted)
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._lanes[lane_key] = {}
        mask = slot.mask
        if is_all_new:  # new entries are held nowhere yet
            lane.update(zip(hashes, repeat(mask)))
            slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + len(hashes)
            if lane_key == GPU0 and not is_rooted and not self._gpu0.get(first_parent, 0) & mask:
                self._add_gaps(slot, 1)
            return
        olds = list(map(lane.get, hashes, repeat(0)))
        lane.update(zip(hashes, map(or_, olds, repeat(mask)), strict=True))
        dups = (
            [h for h, old in zip(hashes, olds, strict=True) if old & mask] if any(map(and_, olds, repeat(mask))) else []
        )
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + len(hashes) - len(dups)
        if lane_key == GPU0:
            self._gaps_after_chain_hold(slot, hashes, olds, is_consistent)
        for block_hash in dups:
            self._add_copy(slot, lane_key, block_hash)

    def _hold_one(self, slot: Slot, lane_key: LaneKey, block_hash: int) -> None:
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._lanes[lane_key] = {}
        self._parent[block_hash] = self._parent.pop(block_hash)
        old = lane.get(block_hash, 0)
        if old & slot.mask:
            self._add_copy(slot, lane_key, block_hash)
            return
        lane[block_hash] = old | slot.mask
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + 1
        if lane_key == GPU0:
            self._gaps_after_hold_one(slot, block_hash)

    def _add_copy(self, slot: Slot, lane_key: LaneKey, block_hash: int) -> None:
        if lane_key == GPU0 and slot.approx.pop(block_hash, None) is not None:
            self._num_approx -= 1
            self._counters["num_approx_blocks_confirmed"] += 1
            return
        key = (lane_key, block_hash)
        slot.copies[key] = slot.copies.get(key, 0) + 1
        self._counters["num_extra_copies_stored"] += 1

    def _drop(self, slot: Slot, lane_key: LaneKey, block_hash: int) -> bool:
        """Remove one holding (one copy) of a block; returns whether the slot held it on that lane."""
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
        mask = lane.get(block_hash, 0) if lane is not None else 0
        if lane is None or not mask & slot.mask:
            return False
        mask &= ~slot.mask
        if mask:
            lane[block_hash] = mask
        else:
            del lane[block_hash]
        slot.num_held[lane_key] -= 1
        if lane_key == GPU0:
            self._gaps_after_drop(slot, block_hash)
            if slot.approx and slot.approx.pop(block_hash, None) is not None:
                self._num_approx -= 1
        if slot.span_held:
            slot.span_held.discard(key)
        if not mask:
            self._maybe_delete_entry(block_hash)
        return True

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recompute the derived structures from scratch and compare (for tests and debugging; O(index)).

        Raises:
            RuntimeError: ``children``, ``rooted``, ``dangling``, ``num_held`` or the gap counts disagree with
                ``parent`` and the lanes.
        """
        parent = self._parent
        expected: dict[int, list[int]] = {}
        for child, up in parent.items():
            if child not in self._rooted:
                expected.setdefault(up, []).append(child)
        actual = {up: sorted(iter_children(value)) for up, value in self._children.items()}
        if actual != {up: sorted(c) for up, c in expected.items()}:
            raise RuntimeError("children disagree with parent pointers")
        if not self._rooted <= parent.keys():
            raise RuntimeError("a rooted block is not an entry")
        if self._dangling != {up for up in self._children if up not in parent}:
            raise RuntimeError("dangling keys disagree")
        for lane in self._lanes.values():
            if not lane.keys() <= parent.keys():
                raise RuntimeError("a held block is not an entry")
        dirty = 0
        for slot in self._slots.values():
            mask = slot.mask
            for lane_key, lane in self._lanes.items():
                if slot.num_held.get(lane_key, 0) != sum(1 for m in lane.values() if m & mask):
                    raise RuntimeError(f"num_held of {slot.worker_id}/{slot.dp_rank} on {lane_key} is off")
            num_gaps = sum(1 for h, m in self._gpu0.items() if m & mask and self._is_gap(mask, h))
            if num_gaps != slot.num_gaps:
                raise RuntimeError(f"{slot.worker_id}/{slot.dp_rank}: {slot.num_gaps} gaps counted, {num_gaps} real")
            if num_gaps:
                dirty |= mask
        if dirty != self._dirty_mask:
            raise RuntimeError("dirty mask disagrees with the gap counts")
