"""Approximate mode of the prefix index: blocks a routing decision sent to a worker (a worker without events, or
the pending blocks of a routed request until the worker's events confirm them), held until they expire, an event
confirms them, or the request is withdrawn.

Records. The approximate blocks of a slot are owned by ``ApproxRecord`` s: ``slot.approx[h]`` is the record that
owns block ``h`` (group 0, GPU lane). A record covers a chain of block hashes (root-most first) and owns some of
its blocks at positions ``start`` and later; it expires at ``expiry_s``, and ``up`` is the record that owned the
block before ``start`` when it was made (``None`` when that block was not approximate). Records form a tree
along the chains::

    system prompt           conversation A's turns
    [0 ........ p)  ◄─up──  [p .................... a)      record A, extended in place every turn of A
         ▲
         └──────up───────  [p ............ b)               record B

Invariant: ``up.expiry_s >= expiry_s`` (a parent record never expires before its child), so expiry never leaves
a held block below a block that is no longer held.

Insertion of a chain ``c[0..n)`` for a slot with expiry ``e`` (``Approximate.insert``):

1. ``k``: how far the slot already holds ``c`` from the root (binary search over positions when the slot has no
   gaps, ``router.index.state``: O(log n); one C-speed scan otherwise);
2. the record owning ``c[k - 1]`` is refreshed: its expiry and its ancestors' are raised to ``e`` (O(depth of the
   record tree)); a record that covers positions past ``k - 1`` (a shorter prompt than the one that made it) is
   first split at ``k`` (O(blocks moved)), so a refresh never lengthens blocks the prompt does not contain;
3. ``c[k..n)`` is linked and held in bulk, owned by that record extended in place when the chain ends at ``k``
   and has no child record (the next turn of a conversation: one record per conversation), else by a new child.

So a following turn of a long conversation costs O(new blocks + log n), not O(n): its prefix is matched, not
re-linked. Expiry drops a record's blocks leaf first in slices (``max_blocks``), cutting its chain to what is
left; the request path drains a bounded slice, the gateway's expiry loop the rest. Withdrawal (the request was
refused or served elsewhere) drops the blocks the insertion added and gives its record back its previous expiry,
unless a later insertion refreshed the record since (another request still pending); the ancestors keep their
refresh.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

from router.index.holdings import Holdings
from router.index.slots import ApproxRecord, Slot
from router.index.state import GPU0, NULL_ID, IndexState

REQUEST_PATH_EXPIRY_BLOCKS = 256
"""Positions an insertion examines at most when it first drops expired approximate blocks (the rest wait for
the next call or the gateway's expiry loop), so one request never pays for a whole conversation's expiry: about
6-9 us a dropped block on a busy 2-core host, so 1.5-2.5 ms of the event loop (1,024 took 6-9 ms there, more than
the request path's 5 ms; every slice of a ``router.sliced_insert`` insertion pays it)."""


class ApproxInsert(NamedTuple):
    """One ``insert_approximate`` call, to withdraw it (``withdraw_approximate``).

    Attributes:
        slot: the worker rank the blocks were inserted for.
        block_hashes: the chain inserted, root-most first.
        expiry_s: the expiry it gave (identifies this insertion's holdings while its record still has it).
        record: the record owning the blocks it added (``None`` when it added none).
        start: the first position it added; ``end``: one past the last.
        prev_expiry_s: its record's expiry before (``None`` for a record it made).
    """

    slot: Slot
    block_hashes: tuple[int, ...]
    expiry_s: float
    record: ApproxRecord | None = None
    start: int = 0
    end: int = 0
    prev_expiry_s: float | None = None


def join_inserts(parts: Sequence[ApproxInsert]) -> list[ApproxInsert]:
    """The withdrawals that undo ``parts``, successive insertions of one growing chain for one slot (the slices of
    ``router.sliced_insert``), in the order to make them.

    When every part that added blocks extended the same record, each from where the one before ended, with one
    expiry, that is one insertion from the first's ``start`` to the last's ``end`` with the first's
    ``prev_expiry_s``: what one insertion of the whole chain would have returned. Otherwise (another insertion made
    a child record between two parts) the parts that added blocks, leaf-most first."""
    added = [p for p in parts if p.record is not None]
    if not added:
        return []
    first, last = added[0], added[-1]
    if all(p.record is first.record and p.expiry_s == first.expiry_s and p.start == before.end
           for before, p in zip(added, added[1:], strict=False)):
        return [ApproxInsert(last.slot, last.block_hashes, last.expiry_s, last.record, first.start, last.end,
                             first.prev_expiry_s)]
    return added[::-1]


def held_depth(state: IndexState, slot: Slot, hashes: Sequence[int]) -> int:
    """How many leading positions of the chain ``hashes`` the slot holds on GPU (group 0) without a break.

    O(log n) lookups for a slot without gaps (its holdings along a chain are a prefix), one scan otherwise."""
    get = state.id_of.get
    gpu = state.gpu0
    mask = slot.mask
    n = len(hashes)
    if not n or not gpu[get(hashes[0], NULL_ID)] & mask:
        return 0
    if slot.num_gaps:
        depth = 0
        for held in map(gpu.__getitem__, map(get, hashes, repeat(NULL_ID))):
            if not held & mask:
                break
            depth += 1
        return depth
    if gpu[get(hashes[n - 1], NULL_ID)] & mask:
        return n
    lo, hi = 0, n - 1  # held at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if gpu[get(hashes[mid], NULL_ID)] & mask:
            lo = mid
        else:
            hi = mid
    return hi


class Approximate:
    """Approximate blocks of ``PrefixIndex`` (module docstring).

    Args:
        state: the index tables.
        holdings: holding and dropping blocks on them.
    """

    def __init__(self, state: IndexState, holdings: Holdings) -> None:
        self.state = state
        self.holdings = holdings

    def _push(self, record: ApproxRecord) -> None:
        state = self.state
        state.approx_seq += 1
        heapq.heappush(state.approx_queue, (record.expiry_s, state.approx_seq, record))

    def _refresh(self, record: ApproxRecord | None, expiry_s: float) -> None:
        """Raise ``record``'s expiry and its ancestors' to ``expiry_s`` (child first, so equal expiries pop child
        first)."""
        while record is not None and record.expiry_s < expiry_s:
            record.expiry_s = expiry_s
            self._push(record)
            record = record.up

    def _split(self, record: ApproxRecord, k: int) -> ApproxRecord:
        """Move ``record``'s blocks before position ``k`` to a new parent record (same expiry); returns it."""
        lower = ApproxRecord(record.slot, record.hashes[:k], record.start, record.expiry_s, record.up)
        lower.num_children = 1
        approx = record.slot.approx
        for block_hash in record.hashes[record.start : k]:
            if approx.get(block_hash) is record:
                approx[block_hash] = lower
        record.start = k
        record.up = lower
        self._push(lower)
        return lower

    def insert(self, slot: Slot, block_hashes: Sequence[int], now_s: float, ttl_s: float,
               max_new_blocks: int | None = None) -> ApproxInsert:
        """Hold ``block_hashes`` (our hashes from the root, group 0, GPU) for ``slot`` until ``now_s + ttl_s``
        (module docstring, steps 1-3); ``block_hashes`` is non-empty. With ``max_new_blocks``, a slot without gaps
        is given only the chain up to that many blocks past what it holds (``k + max_new_blocks`` positions; the
        insertion's ``end`` says how far): a long chain inserted root-first in slices (``router.sliced_insert``)."""
        state = self.state
        hashes = tuple(block_hashes)
        n = len(hashes)
        expiry_s = now_s + ttl_s
        approx = slot.approx
        if slot.num_gaps:
            return self._insert_scan(slot, hashes, expiry_s)
        k = held_depth(state, slot, hashes)
        if max_new_blocks is not None and n - k > max_new_blocks:
            n = k + max_new_blocks
            hashes = hashes[:n]
        tip = approx.get(hashes[k - 1]) if k else None
        if tip is not None and (len(tip.hashes) < k or tip.hashes[k - 1] != hashes[k - 1]):
            tip = None  # not this chain (a hash collision): no refresh
        if tip is not None and len(tip.hashes) > k:
            tip = self._split(tip, k)
        prev_expiry_s = tip.expiry_s if tip is not None else None
        if k == n:  # nothing new: a refresh (and the chain's last block is the most recent)
            self._refresh(tip, expiry_s)
            state.touch(state.id_of[hashes[-1]])
            return ApproxInsert(slot, hashes, expiry_s)
        if tip is not None and not tip.num_children:
            record = tip
            record.hashes = hashes
        else:
            record = ApproxRecord(slot, hashes, k, expiry_s, tip)
            prev_expiry_s = None
            if tip is not None:
                tip.num_children += 1
            self._push(record)
        new = list(hashes[k:])
        self.holdings.hold(slot, GPU0, new, hashes[k - 1] if k else 0, not k)
        approx.update(zip(new, repeat(record)))
        self._refresh(tip, expiry_s)  # the extended record itself, or the new record's parent
        num_new = n - k
        state.num_approx += num_new
        state.counters["num_approx_blocks_inserted"] += num_new
        return ApproxInsert(slot, hashes, expiry_s, record, k, n, prev_expiry_s)

    def _insert_scan(self, slot: Slot, hashes: tuple[int, ...], expiry_s: float) -> ApproxInsert:
        """``insert`` for a slot with gaps: every position is linked and looked at (O(n)); one new record owns
        the blocks it adds and the approximate ones it refreshes."""
        state = self.state
        ids, _, is_consistent = state.link(list(hashes), 0, True)
        record = ApproxRecord(slot, hashes, 0, expiry_s, None)
        lane = state.gpu0
        mask = slot.mask
        approx = slot.approx
        num_new = 0
        num_filled = 0
        olds = list(map(lane.__getitem__, ids))
        for entry_id, block_hash, old in zip(ids, hashes, olds, strict=True):
            if old & mask:
                owner = approx.get(block_hash)
                if owner is not None and owner.expiry_s <= expiry_s:  # never shortens an ancestor's life
                    approx[block_hash] = record
                continue
            lane[entry_id] = old | mask
            approx[block_hash] = record
            num_new += 1
            num_filled += not old
        state.lane_sizes[GPU0] += num_filled
        slot.num_held[GPU0] = slot.num_held.get(GPU0, 0) + num_new
        self.holdings.gaps_after_chain_hold(slot, ids, olds, is_consistent)
        state.num_approx += num_new
        state.counters["num_approx_blocks_inserted"] += num_new
        self._push(record)
        return ApproxInsert(slot, hashes, expiry_s, record, 0, len(hashes), None)

    def withdraw(self, inserted: ApproxInsert) -> int:
        """Undo one insertion (module docstring); returns how many blocks went."""
        record = inserted.record
        if record is None or record.expiry_s != inserted.expiry_s or not record.slot.is_live:
            return 0
        num_dropped = self._drop(record, max(inserted.start, record.start), inserted.end)
        if record.hashes is inserted.block_hashes and inserted.start >= record.start:
            record.hashes = record.hashes[: inserted.start]
        if inserted.prev_expiry_s is not None:
            record.expiry_s = inserted.prev_expiry_s
            self._push(record)
        self.state.counters["num_approx_blocks_withdrawn"] += num_dropped
        return num_dropped

    def _drop(self, record: ApproxRecord, start: int, end: int) -> int:
        """Drop the record's blocks at positions ``[start, end)``, leaf first; returns how many went."""
        slot = record.slot
        approx = slot.approx
        find = self.state.find_entry
        drop = self.holdings.drop
        hashes = record.hashes
        num_dropped = 0
        for i in range(min(end, len(hashes)) - 1, start - 1, -1):
            block_hash = hashes[i]
            if approx.get(block_hash) is record:
                entry_id = find(block_hash)
                if entry_id is not None and drop(slot, GPU0, entry_id):
                    num_dropped += 1
                if approx.pop(block_hash, None) is not None:  # not held any more (a broken chain): forget it
                    self.state.num_approx -= 1
        return num_dropped

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Drop approximate blocks whose expiry is at or before ``now_s``, examining at most ``max_blocks``
        positions (``None``: all that are due); returns how many went."""
        queue = self.state.approx_queue
        budget = max_blocks if max_blocks is not None else -1
        num_expired = 0
        while queue and queue[0][0] <= now_s and budget != 0:
            expiry_s, seq, record = heapq.heappop(queue)
            if record.expiry_s != expiry_s or not record.slot.is_live:
                continue  # refreshed or restored since (a newer entry stands for it), or the slot is gone
            end = len(record.hashes)
            start = record.start
            if budget > 0 and end - start > budget:
                start = end - budget
                heapq.heappush(queue, (expiry_s, seq, record))  # the rest, next time
            budget = max(0, budget - (end - start)) if budget > 0 else budget
            num_expired += self._drop(record, start, end)
            if start > record.start:
                record.hashes = record.hashes[:start]  # what is left; a refresh extends it again
        self.state.counters["num_approx_blocks_expired"] += num_expired
        return num_expired

    def evict_over_cap(self) -> None:
        """Above ``approx_max_blocks``, drop the soonest-expiring records down to the pruning target."""
        state = self.state
        config = state.config
        if state.num_approx <= config.approx_max_blocks:
            return
        target = int(config.approx_max_blocks * config.prune_target_ratio)
        queue = state.approx_queue
        while state.num_approx > target and queue:
            expiry_s, _, record = heapq.heappop(queue)
            if record.expiry_s != expiry_s or not record.slot.is_live:
                continue
            state.counters["num_approx_blocks_expired"] += self._drop(record, record.start, len(record.hashes))
