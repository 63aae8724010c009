"""Upkeep of the prefix index: clearing workers and tiers, the block cap (LRU pruning), approximate mode.

Eviction order for the block cap: oldest entry first (``log`` order: creation, or the last store that ended at
the block, ``router.index.state``), leaves only; a parent becomes a leaf when its last child goes
and is pruned next if it was older than that child. A parent no worker holds goes with its last child even once
the target is reached: an entry without holders or children is never kept.

Pruning is amortized: it runs when a store takes the index over ``max_blocks`` and brings it down to
``max_blocks * prune_target_ratio`` in one pass, so each stored block pays for at most one eviction. The pass
first walks ``log`` and decides what goes (reading the tables only), as runs of consecutive ids evicted leaf
first (a chain stored in one go); then it deletes each run by slice writes of the per-id tables and of each lane
(one holder set over the run: the common case) and ``log`` is compacted with numpy. The result, down to the
order in which ids are freed, is that of evicting one entry at a time. Ingest at the cap (pruning all along) runs
at about 0.8x the rate below it in ``python -m router.index.bench`` (the "ingest at the cap" row).
Approximate mode (records of inserted chains, refreshed and expired in expiry order) is
``router.index.approximate``; ``ApproxInsert`` is re-exported here.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections.abc import Sequence
from itertools import repeat

from events.types import Medium
from router.index.approximate import REQUEST_PATH_EXPIRY_BLOCKS, Approximate, ApproxInsert
from router.index.errors import UnknownWorkerError
from router.index.holdings import Holdings
from router.index.match import iter_bits
from router.index.slots import LaneKey, Slot
from router.index.state import GPU0, NULL_ID, POOL_MEDIA, ROOTED, UNSTAMPED, UNSTAMPED_BYTES, IndexState

logger = logging.getLogger(__name__)

__all__ = ["ApproxInsert", "Upkeep"]

SHRINK_MIN_IDS = 4096
"""An empty index whose tables have more ids than this resets them (``Upkeep.shrink_if_empty``)."""


class Upkeep:
    """Clearing, pruning and approximate mode of ``PrefixIndex``.

    Args:
        state: the index tables.
        holdings: holding and dropping blocks on them.
    """

    def __init__(self, state: IndexState, holdings: Holdings) -> None:
        self.state = state
        self.holdings = holdings
        self.approximate = Approximate(state, holdings)

    # ------------------------------------------------------------------ clearing

    def clear_slot(self, slot: Slot, medium: Medium | None, *, include_pool: bool) -> None:
        """Drop a slot's holdings on one medium, or on all its own media (and the pool ones if asked).

        Visits ``slot.engine.values()``, ``slot.span_held`` and ``slot.approx`` only: O(the slot's blocks). A pool
        lane's blocks of a pool member (a watcher's clear: the master restarted, or went unconfirmed past its TTL)
        are journaled as lost to the pool (``IndexState.pool_evicted``), so a decision that priced them reads its
        miss as ``evicted``, as after a pool ``BlockRemoved``.
        """
        self.state.counters["num_worker_clears"] += 1
        lane_keys = [
            key
            for key in self.state.lanes
            if (key[1] == medium if medium is not None else include_pool or key[1] not in POOL_MEDIA)
        ]
        candidates = set(slot.engine.values())
        candidates.update(h for _, h in slot.span_held)
        candidates.update(slot.approx)
        candidate_ids = [i for i in map(self.state.id_of.get, candidates) if i is not None]
        mask = slot.mask
        keep = ~mask
        freed: list[int] = []
        for lane_key in lane_keys:
            if not slot.num_held.get(lane_key):
                continue
            lane = self.state.lanes[lane_key]
            num_emptied = 0
            num_cleared = 0
            lost: list[int] | None = None
            if lane_key[0] == 0 and slot.worker_id in self.state.pool_members.get(lane_key[1], ()):
                lost = []
            for entry_id in candidate_ids:
                holders = lane[entry_id]
                if holders & mask:
                    holders &= keep
                    lane[entry_id] = holders
                    num_cleared += 1
                    if lost is not None:
                        lost.append(entry_id)
                    if not holders:
                        freed.append(entry_id)
                        num_emptied += 1
            if lost:
                self.state.journal_seq += 1
                lost_journal = self.state.pool_evicted[lane_key[1]]
                hash_of = self.state.hash_of
                floor = self.state.journal_floor
                for entry_id in lost:
                    lost_journal.note(hash_of[entry_id], self.state.journal_seq, floor)
            if num_cleared < slot.num_held[lane_key]:
                # A held block no engine hash names (a broken ``Slot`` invariant): a clear must still be complete.
                logger.error(
                    "index: %d blocks of %s/%d on %s were not reachable from its engine hashes; cleared by a scan",
                    slot.num_held[lane_key] - num_cleared,
                    slot.worker_id,
                    slot.dp_rank,
                    lane_key,
                )
                for entry_id, holders in enumerate(lane):
                    if holders & mask:
                        holders &= keep
                        lane[entry_id] = holders
                        if not holders:
                            freed.append(entry_id)
                            num_emptied += 1
            self.state.lane_sizes[lane_key] -= num_emptied
            slot.num_held[lane_key] = 0
        cleared = set(lane_keys)
        if slot.copies:
            slot.copies = {key: n for key, n in slot.copies.items() if key[0] not in cleared}
        if slot.span_held:
            slot.span_held = {key for key in slot.span_held if key[0] not in cleared}
        if GPU0 in cleared:
            self.state.num_approx -= len(slot.approx)
            slot.approx.clear()
            self.drop_approx_records(slot)
            self.state.reset_gaps(slot)
        if medium is None:
            slot.parked.clear()
            slot.parked_order.clear()
        if medium is None and include_pool:
            slot.engine.clear()
            slot.spans.clear()
        else:
            mapped_hashes = {h for h in candidates if self.state.slot_holds_hash(slot, h)}
            slot.engine = {eh: h for eh, h in slot.engine.items() if h in mapped_hashes}
            slot.spans = {key: k for key, k in slot.spans.items() if key[1] in slot.engine}
        for entry_id in freed:
            self.state.maybe_delete_entry(entry_id)
        self.shrink_if_empty()

    def drop_approx_records(self, slot: Slot) -> None:
        """Take ``slot``'s records out of the expiry queue (its approximate blocks were just cleared): each record
        holds its chain's block hashes and the slot itself, so a record left queued kept a cleared slot's hashes,
        and a removed slot with its engine map and journals, alive until its expiry (``approx_ttl_s``, 120 s by
        default). O(queue length); a clear or a removal is rare."""
        queue = self.state.approx_queue
        kept = [item for item in queue if item[2].slot is not slot]
        if len(kept) != len(queue):
            heapq.heapify(kept)
            queue[:] = kept

    def shrink_if_empty(self) -> None:
        """Give the tables' memory back once no entry is left (every worker cleared or removed): the id tables and
        lanes keep the length of the most entries ever held (``SHRINK_MIN_IDS`` ids and more), which would stay
        allocated however empty the index is. O(1) unless it resets."""
        state = self.state
        if state.num_entries == 0 and state.num_ids > SHRINK_MIN_IDS:
            state.reset_tables(state.lanes)

    def clear_worker(self, worker_id: str, medium: Medium | None = None) -> None:
        """Drop a worker's holdings (all dp ranks) on one medium, or on every medium including pools.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        slots = self.state.worker_slots(worker_id)
        if not slots:
            raise UnknownWorkerError(worker_id)
        for slot in slots:
            self.clear_slot(slot, medium, include_pool=True)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (removed from the fleet); a no-op for an unknown worker."""
        for slot in self.state.worker_slots(worker_id):
            self.clear_slot(slot, None, include_pool=True)
            slot.is_live = False
            del self.state.slots[(slot.worker_id, slot.dp_rank)]
            self.state.free_bits.append(slot.bit)
        self.state.set_roster()
        self.state.recompute_pool_masks()

    def clear(self) -> None:
        """Drop every block of every worker (workers, pools and groups stay configured)."""
        self.state.reset_tables(self.state.lanes)
        self.state.dirty_mask = 0
        for slot in self.state.slots.values():
            slot.is_live = False
            fresh = Slot(slot.worker_id, slot.dp_rank, slot.bit)
            self.state.slots[(slot.worker_id, slot.dp_rank)] = fresh
        self.state.set_roster()
        self.state.approx_queue.clear()
        self.state.num_approx = 0

    def maybe_sweep_engine(self, slot: Slot) -> None:
        """Drop engine-hash mappings of blocks the slot no longer holds once they outnumber its holdings."""
        if len(slot.engine) <= 2 * sum(slot.num_held.values()) + 4096:
            return
        lanes = list(self.state.lanes.values())
        get = self.state.id_of.get
        mask = slot.mask
        if len(lanes) == 1:  # inlined ``_slot_holds_hash`` (a sweep visits every mapping of the slot)
            lane = lanes[0]
            stale = [eh for eh, h in slot.engine.items() if not lane[get(h, NULL_ID)] & mask]
        else:
            stale = [eh for eh, h in slot.engine.items() if not any(lane[get(h, NULL_ID)] & mask for lane in lanes)]
        for engine_hash in stale:
            del slot.engine[engine_hash]
        if slot.spans:
            slot.spans = {key: k for key, k in slot.spans.items() if key[1] in slot.engine}

    # ------------------------------------------------------------------ the block cap

    def prune(self) -> None:
        """Evict least recently stored leaves (``log`` order) down to the target size, then compact ``log``.

        An evicted leaf's ancestors that are left without holders and children go with it (possibly below the
        target), so pruning never leaves an entry that nothing would delete again.

        Two passes: the first walks ``log`` and decides what goes (reading the tables only, with the evicted ids in
        a set), as runs of consecutive ids linked child to parent (a chain evicted leaf first); the second deletes
        each run with slice writes of the per-id tables and of each lane (one holder set over the run: the common
        case), so a pass costs a few C-level operations per block instead of a Python call per block and holder.
        """
        config = self.state.config
        runs = self._select_prune_runs(self.state.num_entries - int(config.max_blocks * config.prune_target_ratio))
        touched: set[Slot] = set()
        for hi, lo in runs:
            self._evict_run(lo, hi, touched)
        self.state.compact_log()
        for slot in touched:
            self.maybe_sweep_engine(slot)

    def _select_prune_runs(self, excess: int) -> list[tuple[int, int]]:
        """The entries pruning deletes, in deletion order, as runs ``(hi, lo)``: ids ``hi, hi - 1, ..., lo``, each
        the parent of the one before (``parent[i] == i - 1``). Reads the tables only.

        The walk visits ``log`` oldest first: a record of an entry with children marks it skipped (older than its
        children); a leaf goes, then its parent while that is a leaf without holders, or a held leaf older than
        the child (skipped) with the target not reached yet.
        """
        kind = self.state.kind
        stamp = self.state.stamp
        parent = self.state.parent
        extra = self.state.extra_children
        lanes = list(self.state.lanes.values())
        only = lanes[0] if len(lanes) == 1 else None
        num_ids = self.state.num_ids
        gone = bytearray(num_ids)  # 1 for an entry this pass deletes (flags per id: cheaper than sets here)
        skipped = bytearray(num_ids)  # 1 for an entry whose record came with children (older than them)
        runs: list[tuple[int, int]] = []
        unstamped = UNSTAMPED
        for pos, entry_id in enumerate(self.state.log):
            if excess <= 0:
                break
            if gone[entry_id] or not kind[entry_id] & 1:
                continue  # gone since
            record_pos = stamp[entry_id]
            if record_pos != pos and record_pos != unstamped:
                continue  # a stale record
            nxt = entry_id + 1
            if (nxt < num_ids and parent[nxt] == entry_id and not gone[nxt]) or (
                entry_id in extra and self._has_live_extra_child(entry_id, gone)
            ):
                skipped[entry_id] = 1
                continue
            hi = current = entry_id
            gone[current] = 1
            excess -= 1
            while True:  # ``current`` goes; walk up
                up = parent[current]
                if not kind[up] & 1:  # rooted (the null id) or a dangling key
                    break
                nxt = up + 1
                if (nxt != current and nxt < num_ids and parent[nxt] == up and not gone[nxt]) or (
                    up in extra and self._has_live_extra_child(up, gone)
                ):
                    break
                # The parent is a leaf now. Without holders it goes too, past the target if need be (an entry is
                # kept only while held or while it has children); a held one goes only above the target, and only
                # if it is older than the child (skipped).
                if (excess <= 0 or not skipped[up]) and (
                    only[up] if only is not None else any(lane[up] for lane in lanes)
                ):
                    break
                if up != current - 1:
                    runs.append((hi, current))
                    hi = up
                current = up
                gone[current] = 1
                excess -= 1
            runs.append((hi, current))
        return runs

    def _has_live_extra_child(self, up: int, gone: bytearray) -> bool:
        value = self.state.extra_children[up]
        if type(value) is int:
            return not gone[value]
        assert isinstance(value, list)
        return any(not gone[child] for child in value)

    def _evict_run(self, lo: int, hi: int, touched: set[Slot]) -> None:
        """Delete entries ``hi, hi - 1, ..., lo`` (leaf first, ``parent[i] == i - 1`` inside the run; ``hi`` has no
        children) with all their holdings, as the same number of single evictions would, by slice writes."""
        num = hi - lo + 1
        end = hi + 1
        block_hash_of = self.state.hash_of
        parent = self.state.parent
        kind = self.state.kind
        up = parent[lo]
        is_rooted = kind[lo] == ROOTED
        hashes = block_hash_of[lo:end]
        gpu0 = self.state.gpu0
        for lane_key, lane in self.state.lanes.items():
            olds = lane[lo:end]
            num_empty = olds.count(0)
            if num_empty == num:
                continue
            lane[lo:end] = repeat(0, num)
            self.state.lane_sizes[lane_key] -= num - num_empty
            is_gpu0 = lane is gpu0
            first = olds[0]
            if olds.count(first) == num:  # one holder set over the run
                for bit in iter_bits(first):
                    slot = self.state.slots_by_bit[bit]
                    touched.add(slot)
                    slot.num_held[lane_key] -= num
                    self._drop_side_tables(slot, lane_key, hashes, is_gpu0)
                    # Inside the run every parent has the same holders: only ``lo`` can be a gap.
                    if is_gpu0 and not is_rooted and not gpu0[up] & slot.mask:
                        self.state.add_gaps(slot, -1)
                continue
            by_bit: dict[int, list[int]] = {}
            for offset, holders in enumerate(olds):
                for bit in iter_bits(holders):
                    by_bit.setdefault(bit, []).append(offset)
            for bit, offsets in by_bit.items():
                slot = self.state.slots_by_bit[bit]
                touched.add(slot)
                slot.num_held[lane_key] -= len(offsets)
                self._drop_side_tables(slot, lane_key, [hashes[i] for i in offsets], is_gpu0)
                if is_gpu0:
                    mask = slot.mask
                    # A gap: the block's parent was not held by the slot (inside the run: before this run's writes).
                    num_gaps = sum(
                        1
                        for i in offsets
                        if (not olds[i - 1] & mask if i else not is_rooted and not gpu0[up] & mask)
                    )
                    if num_gaps:
                        self.state.add_gaps(slot, -num_gaps)
        id_of = self.state.id_of
        for block_hash in hashes:
            del id_of[block_hash]
        block_hash_of[lo:end] = repeat(0, num)
        parent[lo:end] = array("q", bytes(8 * num))
        kind[lo:end] = bytes(num)
        self.state.stamp[lo:end] = array("q", UNSTAMPED_BYTES * num)
        self.state.free_ids.extend(range(hi, lo - 1, -1))
        self.state.num_entries -= num
        self.state.counters["num_pruned_blocks"] += num
        if not is_rooted:
            self.state.remove_child(up, lo)

    def _drop_side_tables(self, slot: Slot, lane_key: LaneKey, hashes: list[int], is_gpu0: bool) -> None:
        """Forget the slot's extra copies, offload-span marks and approximate records of evicted blocks."""
        if slot.copies:
            for block_hash in hashes:
                slot.copies.pop((lane_key, block_hash), None)
        if slot.span_held:
            for block_hash in hashes:
                slot.span_held.discard((lane_key, block_hash))
        if is_gpu0 and slot.approx:
            approx = slot.approx
            for block_hash in hashes:
                if approx.pop(block_hash, None) is not None:
                    self.state.num_approx -= 1

    # ------------------------------------------------------------------ approximate mode

    def insert_approximate(
        self, worker_id: str, block_hashes: Sequence[int], now_s: float, dp_rank: int = 0, ttl_s: float | None = None,
        max_new_blocks: int | None = None,
    ) -> ApproxInsert | None:
        """Record that a routing decision sent these blocks to a worker (no events, or not yet confirmed).

        The blocks (our hashes from the root, group 0, GPU) expire ``ttl_s`` (default ``approx_ttl_s``) after
        ``now_s`` unless an event of the worker stores them first (then they are the event's and stop expiring).
        Re-inserting refreshes the expiry (never shortens it), of the blocks the slot already held too; only the
        blocks past what the slot holds are linked (``router.index.approximate``: O(new blocks + log n)).
        Blocks beyond ``approx_max_blocks`` evict the soonest-expiring approximate ones. Records of different
        TTLs expire in expiry order (a heap); expired blocks are dropped first, a bounded slice of them.

        Args:
            worker_id: the chosen worker.
            block_hashes: the request's block hashes, root-most first.
            now_s: monotonic time in seconds.
            dp_rank: the worker's rank, if known.
            ttl_s: lifetime in seconds of these blocks, or ``None`` for ``approx_ttl_s``.
            max_new_blocks: link at most this many blocks past what the slot holds of the chain (``None``: all);
                the insertion's ``end`` is one past the last position inserted (``Approximate.insert``).

        Returns:
            The insertion, for ``withdraw_approximate``; ``None`` for no blocks.

        Raises:
            ValueError: ``ttl_s`` or ``max_new_blocks`` is not positive.
        """
        if ttl_s is not None and ttl_s <= 0.0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_new_blocks is not None and max_new_blocks <= 0:
            raise ValueError(f"max_new_blocks must be positive, got {max_new_blocks}")
        self.approximate.expire(now_s, REQUEST_PATH_EXPIRY_BLOCKS)
        if not block_hashes:
            return None
        config = self.state.config
        inserted = self.approximate.insert(self.state.slot(worker_id, dp_rank), block_hashes, now_s,
                                           config.approx_ttl_s if ttl_s is None else ttl_s, max_new_blocks)
        self.approximate.evict_over_cap()
        if self.state.num_entries > config.max_blocks:
            self.prune()
        return inserted

    def withdraw_approximate(self, inserted: ApproxInsert) -> int:
        """Undo one ``insert_approximate`` (the request it stood for was refused or went elsewhere): drop the
        blocks it added, unless an event has confirmed them since or a later insertion refreshed them (another
        request still pending). Returns how many blocks went."""
        return self.approximate.withdraw(inserted)

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Drop approximate blocks whose TTL ended at or before ``now_s``, looking at no more than ``max_blocks``
        positions (``None``: all that are due); returns how many went."""
        return self.approximate.expire(now_s, max_blocks)
