"""Holdings of the prefix index: setting and clearing a slot's bit on entries, with copies, approximate
confirmation and the gap accounting of ``router.index.state``.

A holding is one bit of one lane (``lanes[(group, medium)][id]``); a slot holding a block twice on one lane
keeps the extra copies in ``slot.copies``. Every change of a GPU holding bit of group 0 updates the slot's gap
count (``slot.num_gaps``, O(children) per block); a chain of new blocks held in one go costs a look at its first
block only.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, count, islice, repeat
from operator import add, and_, lt, ne, or_

from router.index.slots import LaneKey, Slot
from router.index.state import DANGLING, GPU0, NULL_ID, IndexState


class Holdings:
    """Holding and dropping blocks for slots, on the tables of ``state``.

    Args:
        state: the index tables it changes.

    Attributes:
        bulk_paths: take the bulk paths (runs of ids written by slices, a removal event applied in one loop);
            ``False`` applies every store block by block through ``IndexState.link`` and every removal through
            ``drop``, the reference the tests compare the bulk paths' full state with.
    """

    def __init__(self, state: IndexState) -> None:
        self.state = state
        self.bulk_paths = True

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
        if (is_rooted or up != NULL_ID) and self.bulk_paths:
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
            free_ids = self.state.free_ids
            base = self.state.num_ids
            # Reused ids are taken in reverse: a chain freed leaf first lies in ``free_ids`` as a descending run.
            candidates: Sequence[int] = (
                free_ids[: -num_blocks - 1 : -1] if len(free_ids) >= num_blocks else range(base, base + num_blocks)
            )
            known = self._known_runs(hashes) if first != NULL_ID else None
            if known is not None:
                # Blocks indexed already as a few runs of consecutive ids (chains other workers stored), then none
                # or only new blocks: one probe per run instead of one per block.
                if len(known) == num_blocks:
                    self.hold_entries(slot, lane_key, lane, known)
                    return
                if id_of.keys().isdisjoint(hashes[len(known) :]):
                    self._hold_known_then_new(slot, lane_key, lane, hashes, known, candidates)
                    return
            # One probe per block: new blocks get candidate ids, blocks already indexed give theirs.
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
            num_known = num_blocks - num_new
            if ids[num_known:] == list(candidates[num_known:]) and not (
                self.state.num_dangling and any(self.state.kind[i] == DANGLING for i in ids[:num_known])
            ):
                # Blocks others hold, then new ones (a conversation continued on another worker): the known run as
                # above, the new run as a new chain under its last block, in bulk.
                self._hold_known_then_new(slot, lane_key, lane, hashes, ids[:num_known], candidates)
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

    def _known_runs(self, hashes: list[int], max_runs: int = 16) -> list[int] | None:
        """Ids of the leading blocks of ``hashes`` that are entries, found run by run: the id of a run's first
        block by one probe, its length by comparing ``hash_of`` from there with the chain (a C-level loop that
        stops at the first difference). Stops at the first block not in ``id_of``. ``None`` when a run holds an id
        that is not an entry (a dangling key) or after ``max_runs`` runs (scattered ids: one probe per block is
        cheaper)."""
        id_of = self.state.id_of
        hash_of = self.state.hash_of
        num_blocks = len(hashes)
        ids: list[int] = []
        pos = 0
        for _ in range(max_runs):
            entry_id = id_of.get(hashes[pos])
            if entry_id is None:
                return ids
            window = hash_of[entry_id : entry_id + num_blocks - pos]
            length = next(compress(count(), map(ne, window, hashes[pos:])), len(window))
            if not self.state.is_entry_run(entry_id, length):
                return None
            ids.extend(range(entry_id, entry_id + length))
            pos += length
            if pos == num_blocks:
                return ids
        return None

    def _hold_known_then_new(
        self, slot: Slot, lane_key: LaneKey, lane: list[int], hashes: list[int], known: list[int],
        candidates: Sequence[int],
    ) -> None:
        """Hold a chain whose first ``len(known)`` blocks are entries (ids ``known``) and whose others are new and
        mapped to ``candidates[len(known):]``: as ``link`` then ``hold_entries`` would (same tables, same eviction
        records), with the new blocks remapped to the first free candidates and created by ``create_chain``."""
        num_known = len(known)
        num_new = len(hashes) - num_known
        state = self.state
        if type(candidates) is range:
            new_ids: Sequence[int] = range(candidates.start, candidates.start + num_new)
        else:
            new_ids = state.free_ids[: -num_new - 1 : -1]
        new_hashes = hashes[num_known:]
        state.id_of.update(zip(new_hashes, new_ids, strict=True))
        # The known run first: its gap accounting must not see the new blocks held yet (they are never gaps).
        self.hold_entries(slot, lane_key, lane, known, is_touched=True)
        state.create_chain(new_hashes, new_ids, known[-1], False, lane, slot.mask)
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_new
        state.lane_sizes[lane_key] += num_new

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
        if self.bulk_paths and self._hold_pieces(slot, lane_key, lane, ids, olds, is_consistent):
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

    def _hold_pieces(
        self, slot: Slot, lane_key: LaneKey, lane: list[int], ids: Sequence[int], olds: list[int], is_consistent: bool
    ) -> bool:
        """``hold_entries`` past its one-holder-set case, by pieces: the chain cut where its ids stop being
        consecutive or its holder set changes (a few pieces: a shared prefix, then blocks fewer workers hold), each
        written as one slice of one shared new mask (an object per piece, not per block: 1,000-bit masks are
        about 160 bytes each). Gaps of a consistent chain are counted per piece. Returns ``False``, having changed
        nothing, for ids that are not strictly increasing (a chain that repeats a block): the caller's per-block
        path handles those."""
        num_blocks = len(ids)
        nexts = ids[1:]
        if not all(map(lt, ids, nexts)):
            return False
        mask = slot.mask
        # Positions where the ids stop being consecutive, and where the holder set changes (C-level loops).
        id_cuts = list(compress(range(1, num_blocks), map(ne, nexts, map(add, ids, repeat(1)))))
        holder_cuts = compress(range(1, num_blocks), map(ne, islice(olds, 1, None), olds))
        cuts = sorted({*id_cuts, *holder_cuts})
        news: dict[int, int] = {}
        pieces: list[tuple[int, int, bool]] = []  # (start position, end position, newly held)
        num_dups = num_filled = 0
        dups: list[int] = []
        start = 0
        for end in (*cuts, num_blocks):
            old = olds[start]
            first = ids[start]
            length = end - start
            if old & mask:
                dups.extend(range(first, first + length))
                num_dups += length
                pieces.append((start, end, False))
            else:
                new = news.get(old)
                if new is None:
                    new = news[old] = old | mask
                lane[first : first + length] = repeat(new, length)
                if not old:
                    num_filled += length
                pieces.append((start, end, True))
            start = end
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + num_blocks - num_dups
        self.state.lane_sizes[lane_key] += num_filled
        if lane_key == GPU0:
            if is_consistent and slot.num_gaps:
                self._gaps_after_pieces(slot, ids, pieces, id_cuts)
            else:
                self.gaps_after_chain_hold(slot, ids, olds, is_consistent)
        for entry_id in dups:
            self.add_copy(slot, lane_key, entry_id)
        return True

    def _gaps_after_pieces(self, slot: Slot, ids: Sequence[int], pieces: list[tuple[int, int, bool]],
                           id_cuts: list[int]) -> None:
        """``gaps_after_chain_hold`` for a consistent chain (each block the parent of the next) with strictly
        increasing ids, held by pieces, for a slot with gaps: the first block may become a gap; a newly held block
        closes the gap of each child the slot held already: the next block of the chain when its piece was held
        before, the block after the last of an id run (its implicit child when not the chain's next), and extra
        children (a branch point), looked up only for the newly held blocks that have some."""
        state = self.state
        mask = slot.mask
        gpu = state.gpu0
        parent = state.parent
        delta = 0
        if pieces[0][2] and state.is_gap(mask, ids[0]):
            delta += 1
        newly: set[int] = set()
        for (start, end, is_new), nxt in zip(pieces, (*pieces[1:], None), strict=True):
            if is_new:
                newly.update(range(ids[start], ids[start] + end - start))
                if nxt is not None and not nxt[2]:
                    delta -= 1  # the chain's next block, held before
        num_blocks = len(ids)
        for end in (*id_cuts, num_blocks):
            last = ids[end - 1]
            child = last + 1
            if (
                last in newly
                and child < state.num_ids
                and (end == num_blocks or ids[end] != child)
                and parent[child] == last
                and gpu[child] & mask
                and child not in newly
            ):
                delta -= 1
        extra = state.extra_children
        if extra:
            next_of = dict(zip(ids, ids[1:], strict=False))
            for up in extra.keys() & newly:
                value = extra[up]
                for child in (value,) if type(value) is int else value:  # type: ignore[union-attr]
                    if child != next_of.get(up) and gpu[child] & mask and child not in newly:
                        delta -= 1
        if delta:
            state.add_gaps(slot, delta)

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
            slot.note_confirmed(block_hash, self.state.journal_seq, self.state.journal_floor)
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
