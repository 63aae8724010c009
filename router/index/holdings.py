"""Holdings of the prefix index: setting and clearing a slot's bit on entries, with copies, approximate
confirmation and the gap accounting of ``router.index.state``.

A holding is one bit of one lane (``lanes[(group, medium)][id]``); a slot holding a block twice on one lane
keeps the extra copies in ``slot.copies``. Every change of a GPU holding bit of group 0 updates the slot's gap
count (``slot.num_gaps``, O(children) per block); a chain of new blocks held in one go costs a look at its first
block only.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import and_, or_

from router.index.slots import LaneKey, Slot
from router.index.state import DANGLING, GPU0, NULL_ID, IndexState


class Holdings:
    """Holding and dropping blocks for slots, on the tables of ``state``.

    Args:
        state: the index tables it changes.
    """

    def __init__(self, state: IndexState) -> None:
        self.state = state

    def gaps_after_chain_hold(
        self, slot: Slot, ids: Sequence[int], olds: list[int], is_consistent: bool
    ) -> None:
        """Account gaps after the slot's bit was set on every block of a chain (``olds``: masks before)."""
        mask = slot.mask
        if is_consistent and not slot.num_gaps:  # only the first block can be a new gap
            if not olds[0] & mask and self.state.is_gap(mask, ids[0]):
                self.state.add_gaps(slot, 1)
            return
        newly = list(dict.fromkeys(i for i, old in zip(ids, olds, strict=True) if not old & mask))
        if not newly:
            return
        if is_consistent:
            delta = int(not olds[0] & mask and self.state.is_gap(mask, ids[0]))
        else:
            delta = sum(1 for i in newly if self.state.is_gap(mask, i))
        if slot.num_gaps:
            skip = set(newly)
            delta -= sum(self.state.num_held_children(mask, i, skip) for i in newly)
        if delta:
            self.state.add_gaps(slot, delta)

    def gaps_after_hold_one(self, slot: Slot, entry_id: int) -> None:
        mask = slot.mask
        delta = int(self.state.is_gap(mask, entry_id))
        if slot.num_gaps:
            delta -= self.state.num_held_children(mask, entry_id)
        if delta:
            self.state.add_gaps(slot, delta)

    def gaps_after_drop(self, slot: Slot, entry_id: int) -> None:
        """Account gaps after the slot's GPU bit of an entry was cleared (before the entry may go)."""
        mask = slot.mask
        delta = self.state.num_held_children(mask, entry_id) - int(self.state.is_gap(mask, entry_id))
        if delta:
            self.state.add_gaps(slot, delta)

    def hold(self, slot: Slot, lane_key: LaneKey, hashes: list[int], first_parent: int, is_rooted: bool) -> None:
        """Add the slot as holder of a chain on one lane (with copy counting and approximate confirmation)."""
        lane = self.state.lanes.get(lane_key) or self.state.lane(lane_key)
        mask = slot.mask
        num_blocks = len(hashes)
        id_of = self.state.id_of
        up = NULL_ID if is_rooted else id_of.get(first_parent, NULL_ID)
        if is_rooted or up != NULL_ID:
            first = id_of.get(hashes[0], NULL_ID)
            if (
                first != NULL_ID
                and self.state.hash_of[first : first + num_blocks] == hashes
                and self.state.is_entry_run(first, num_blocks)
            ):
                # Blocks already indexed under consecutive ids (another worker storing the same chain): the
                # first probe is the only random access.
                self.hold_entries(slot, lane_key, lane, range(first, first + num_blocks))
                return
            # One probe per block: new blocks get candidate ids, blocks already indexed give theirs.
            free_ids = self.state.free_ids
            base = self.state.num_ids
            # Reused ids are taken in reverse: a chain freed leaf first lies in ``free_ids`` as a descending run.
            candidates: Sequence[int] = (
                free_ids[: -num_blocks - 1 : -1] if len(free_ids) >= num_blocks else range(base, base + num_blocks)
            )
            num_before = len(id_of)
            ids = list(map(id_of.setdefault, hashes, candidates))
            num_new = len(id_of) - num_before
            if num_new == num_blocks:  # all new (a growing conversation): bulk inserts at C speed
                self.state.create_chain(hashes, candidates, up, is_rooted, lane, mask)
                slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
                self.state.lane_sizes[lane_key] += num_blocks
                if lane_key == GPU0 and not is_rooted and not self.state.gpu0[up] & mask:
                    self.state.add_gaps(slot, 1)
                return
            if not num_new and not (self.state.num_dangling and any(self.state.kind[i] == DANGLING for i in ids)):
                # Every block an entry (another worker storing the same chain).
                self.hold_entries(slot, lane_key, lane, ids)
                return
            for block_hash, entry_id, candidate in zip(hashes, ids, candidates, strict=True):
                if entry_id == candidate:  # undo; the general path below creates the entries
                    del id_of[block_hash]
        ids, is_all_new, is_consistent = self.state.link(hashes, first_parent, is_rooted)
        if is_all_new:  # new entries are held nowhere yet and have no children
            for entry_id in ids:
                lane[entry_id] = mask
            slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
            self.state.lane_sizes[lane_key] += num_blocks
            if lane_key == GPU0 and not is_rooted and not self.state.gpu0[self.state.parent[ids[0]]] & mask:
                self.state.add_gaps(slot, 1)
            return
        self.hold_entries(slot, lane_key, lane, ids, is_consistent, is_touched=True)

    def hold_entries(
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
            parent = self.state.parent
            if is_run:
                is_consistent = parent[first + 1 : first + num_blocks] == self.state.iota_slice(first, num_blocks - 1)
            else:
                is_consistent = list(map(parent.__getitem__, ids[1:])) == list(ids[:-1])
        if not is_touched:
            log = self.state.log
            self.state.stamp[ids[-1]] = len(log)
            log.append(ids[-1])
        olds = lane[first : first + num_blocks] if is_run else list(map(lane.__getitem__, ids))
        old = olds[0]
        if is_run and not old & mask and olds.count(old) == num_blocks:
            # One holder set over the whole run (the common case): one new mask object, shared.
            lane[first : first + num_blocks] = [old | mask] * num_blocks
            slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks
            if not old:
                self.state.lane_sizes[lane_key] += num_blocks
            if lane_key == GPU0:
                self.gaps_after_chain_hold(slot, ids, olds, is_consistent)
            return
        news = list(map(or_, olds, repeat(mask)))
        if is_run:
            lane[first : first + num_blocks] = news
        else:
            for entry_id, new in zip(ids, news, strict=True):
                lane[entry_id] = new
        dups = [i for i, old in zip(ids, olds, strict=True) if old & mask] if any(map(and_, olds, repeat(mask))) else []
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks - len(dups)
        self.state.lane_sizes[lane_key] += olds.count(0)
        if lane_key == GPU0:
            self.gaps_after_chain_hold(slot, ids, olds, is_consistent)
        for entry_id in dups:
            self.add_copy(slot, lane_key, entry_id)

    def hold_one(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> None:
        lane = self.state.lane(lane_key)
        self.state.touch(entry_id)
        old = lane[entry_id]
        if old & slot.mask:
            self.add_copy(slot, lane_key, entry_id)
            return
        lane[entry_id] = old | slot.mask
        if not old:
            self.state.lane_sizes[lane_key] += 1
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + 1
        if lane_key == GPU0:
            self.gaps_after_hold_one(slot, entry_id)

    def add_copy(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> None:
        block_hash = self.state.hash_of[entry_id]
        if lane_key == GPU0 and slot.approx.pop(block_hash, None) is not None:
            self.state.num_approx -= 1
            self.state.counters["num_approx_blocks_confirmed"] += 1
            self.state.journal_seq += 1
            slot.note_confirmed(block_hash, self.state.journal_seq)
            return
        key = (lane_key, block_hash)
        slot.copies[key] = slot.copies.get(key, 0) + 1
        self.state.counters["num_extra_copies_stored"] += 1

    def drop(self, slot: Slot, lane_key: LaneKey, entry_id: int) -> bool:
        """Remove one holding (one copy) of an entry; returns whether the slot held it on that lane."""
        block_hash = self.state.hash_of[entry_id]
        key = (lane_key, block_hash)
        if slot.copies:
            extra = slot.copies.get(key)
            if extra:
                if extra == 1:
                    del slot.copies[key]
                else:
                    slot.copies[key] = extra - 1
                return True
        lane = self.state.lanes.get(lane_key)
        if lane is None:
            return False
        mask = lane[entry_id]
        if not mask & slot.mask:
            return False
        mask &= ~slot.mask
        lane[entry_id] = mask
        slot.num_held[lane_key] -= 1
        if lane_key == GPU0:
            self.gaps_after_drop(slot, entry_id)
            if slot.approx and slot.approx.pop(block_hash, None) is not None:
                self.state.num_approx -= 1
        if slot.span_held:
            slot.span_held.discard(key)
        if not mask:
            self.state.lane_sizes[lane_key] -= 1
            self.state.maybe_delete_entry(entry_id)
        return True
