"""Applying normalized KV events to the prefix index: stores, removals, clears, resyncs.

Child before parent: a ``BlockStored`` whose ``parent_block_hash`` is not (yet) known for the same worker and
dp_rank is never attached anywhere: our hash of its blocks depends on the parent's, which we do not have. It is
parked per slot (bounded, oldest dropped and counted) and applied as soon as a store maps that engine hash;
a clear of the slot drops it. Removals of blocks never stored are counted and skipped. A store or removal in a
cache group the index does not declare (``router.index.config``) is refused before anything is created or parked,
counted as ``num_unknown_group_events`` and logged (a warning once per slot).

Engine hashes are opaque but must each name one block of a slot: a store that maps an engine hash already naming
another block the slot holds is cut before that block (``num_engine_hash_reuse_blocks``), so every held block
stays reachable from ``slot.engine`` and a clear of the slot is complete.

Hybrid models: each cache group holds blocks on its own lanes ``(group_idx, medium)`` of the same entries (one
chain of our content hash; vLLM publishes the same plain digest for a block in every group that keeps it, so the
group, never the hash, tells holdings apart: one group's removal clears only its own lane, and a group's store may
name a parent only another group stored). A store of a sparse group (``events.types.BlockStored``: tokens of the
whole range, hashes of its last blocks) hashes every token block to keep the chain and holds only the named ones.

Offload stores without tokens (vLLM's CPU connector) are resolved through ``slot.engine``; an offloaded block
covering ``k`` index blocks (``block_size = k * index block_size``) is the engine hash of the last of them, and
marks that block and its ``k - 1`` ancestors that the slot knows.

Ingest cost: a store of ``n`` new blocks is one token conversion, ``n`` xxh3 calls, one ``setdefault`` probe
per block into ``id_of`` (the only random access of the index tables), list extends of the per-id tables, and
the ``slot.engine`` update. A store of blocks already indexed under consecutive ids (another worker storing the
same chain) is one probe of its first block, slice compares of ``block_hash`` and ``parent``, and a slice
update of the lane; the last block moves in the eviction order. Copies and gaps are looked at per block only
when the slot already holds some of the blocks or has gaps. Figures in ``benchmarks.index``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat
from typing import cast

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Resync
from router.block_hash import (
    DEFAULT_NAMESPACE,
    BlockHash,
    hash_block_bytes,
    make_namespace,
    split_extra_keys,
    tokens_to_bytes,
)
from router.index.holdings import Holdings
from router.index.pool_restores import note_pool_stores
from router.index.slots import LaneKey, Slot
from router.index.state import GPU0, NULL_ID, ROOTED, IndexState
from router.index.upkeep import Upkeep

logger = logging.getLogger(__name__)


class Ingest:
    """Event application of ``PrefixIndex``.

    Args:
        state: the index tables.
        holdings: holding and dropping blocks on them.
        upkeep: clearing slots and pruning at the block cap.
    """

    def __init__(self, state: IndexState, holdings: Holdings, upkeep: Upkeep) -> None:
        self.state = state
        self.holdings = holdings
        self.upkeep = upkeep

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of a worker's events, in order. Never raises for bad events: they are counted."""
        slot = self.state.slot(batch.worker_id, batch.dp_rank)
        counters = self.state.counters
        counters["num_batches"] += 1
        counters["num_events"] += len(batch.events)
        groups = self.state.groups
        for event in batch.events:
            try:
                if type(event) is BlockStored:
                    if event.group_idx in groups:
                        self._store_with_parked(slot, event)
                    else:
                        self._refuse_group(slot, event.group_idx, len(event.block_hashes))
                elif type(event) is BlockRemoved:
                    if event.group_idx in groups:
                        self._remove(slot, event)
                    else:
                        self._refuse_group(slot, event.group_idx, len(event.block_hashes))
                elif type(event) is AllBlocksCleared:
                    self.upkeep.clear_slot(slot, event.medium, include_pool=False)
                else:
                    self._refuse(slot, "num_malformed_events", f"an event of type {type(event).__name__}")
            except (ValueError, TypeError, OverflowError) as exc:
                self._refuse(slot, "num_malformed_events", f"a malformed event ({exc})")
        if self.state.num_entries > self.state.config.max_blocks:
            self.upkeep.prune()
        elif len(self.state.log) > 2 * self.state.num_entries + 65536:
            self.state.compact_log()

    def apply_resync(self, resync: Resync) -> None:
        """Forget what is known about a worker's own tiers: the resynced dp rank's, or every rank's when
        ``resync.dp_rank`` is ``None`` (pool-tier holdings stay)."""
        self.state.counters["num_resyncs"] += 1
        rank = resync.dp_rank
        logger.info("resync of worker %s (%s, %s): clearing its index entries", resync.worker_id, resync.reason,
                    "every dp rank" if rank is None else f"dp rank {rank}")
        for slot in self.state.worker_slots(resync.worker_id):
            if rank is None or slot.dp_rank == rank:
                self.upkeep.clear_slot(slot, None, include_pool=False)

    def _refuse(self, slot: Slot, counter: str, detail: str, num: int = 1) -> None:
        """Add ``num`` to ``counter`` for one refused event (or part of one) and log it: a warning the first time
        per slot and counter, debug after (a worker repeating a bad event cannot flood the log)."""
        self.state.counters[counter] += num
        if counter in slot.warned:
            logger.debug("kv events of worker %s rank %d: refused %s", slot.worker_id, slot.dp_rank, detail)
            return
        slot.warned.add(counter)
        logger.warning(
            "kv events of worker %s rank %d: refused %s (counted as %s; further ones are logged at debug)",
            slot.worker_id,
            slot.dp_rank,
            detail,
            counter,
        )

    def _refuse_group(self, slot: Slot, group_idx: int, num_blocks: int) -> None:
        """Count an event of a cache group the index does not declare; it creates nothing."""
        self._refuse(
            slot,
            "num_unknown_group_events",
            f"an event of {num_blocks} blocks in cache group {group_idx}, not declared for this model "
            f"(groups {sorted(self.state.groups)}; declare hybrid groups in the index config)",
        )

    def _store_with_parked(self, slot: Slot, event: BlockStored) -> None:
        mapped = self._store(slot, event)
        if not slot.parked or not mapped:
            return
        stack: list[BlockStored] = []
        while True:
            if slot.parked:
                for engine_hash in mapped:
                    waiting = slot.parked.pop(engine_hash, None)
                    if waiting:
                        self.state.counters["num_parked_blocks_applied"] += sum(len(e.block_hashes) for e in waiting)
                        stack.extend(waiting)
            if not stack:
                return
            mapped = self._store(slot, stack.pop())

    def _store(self, slot: Slot, event: BlockStored) -> Sequence[int]:
        """Apply one store; returns the engine hashes it mapped (to release parked children)."""
        counters = self.state.counters
        num_event_blocks = len(event.block_hashes)
        if num_event_blocks == 0:
            return ()
        lane_key: LaneKey = (event.group_idx, event.medium)
        event_block_size = event.block_size or self.state.block_size
        if event_block_size < 0 or event_block_size % self.state.block_size:
            counters["num_block_size_mismatch_blocks"] += num_event_blocks
            logger.debug("block size %d is not a multiple of %d", event.block_size, self.state.block_size)
            return ()
        factor = event_block_size // self.state.block_size
        if not event.token_ids:
            return self._store_by_engine_hash(slot, event, lane_key, factor)
        num_skipped = event.num_skipped_blocks if event_block_size == event.block_size else 0
        if len(event.token_ids) != event_block_size * (num_event_blocks + num_skipped):
            raise ValueError(f"{len(event.token_ids)} tokens for {num_event_blocks} blocks of {event_block_size}")
        parent_hash: int | None = None
        if event.parent_block_hash is not None:
            parent_hash = slot.engine.get(event.parent_block_hash)
            if parent_hash is None:
                self._park(slot, event)
                return ()
        if event.extra_keys is None:
            salt, num_ok = None, num_event_blocks
        else:
            salt, num_ok = split_extra_keys(event.extra_keys, event.lora_name, num_event_blocks)
        if (parent_hash is not None or num_skipped) and salt is not None:
            num_ok = 0  # a salt only ever starts a request's chain
        if num_ok < num_event_blocks:
            counters["num_unsupported_extra_key_blocks"] += num_event_blocks - num_ok
            if num_ok == 0:
                return ()
        namespace = (
            make_namespace(event.lora_name, salt)
            if parent_hash is None and (salt is not None or event.lora_name is not None)
            else DEFAULT_NAMESPACE
        )
        if num_ok == num_event_blocks:
            token_ids = event.token_ids
            engine_hashes = event.block_hashes
        else:
            token_ids = event.token_ids[: (num_skipped + num_ok) * event_block_size]
            engine_hashes = event.block_hashes[:num_ok]
        ours: list[int] = cast(
            list[int],
            hash_block_bytes(
                tokens_to_bytes(token_ids),
                self.state.block_size,
                namespace,
                BlockHash(parent_hash) if parent_hash is not None else None,
            ),
        )
        first_parent: int = namespace if parent_hash is None else parent_hash
        if num_skipped:
            # A sparse group's store (sliding window, Mamba): the hashes name the last blocks of the token range;
            # the skipped ones only link the chain (``events.types.BlockStored``).
            first_parent = ours[num_skipped * factor - 1]
            del ours[: num_skipped * factor]
        engine = slot.engine
        if not engine.keys().isdisjoint(engine_hashes):
            num_kept = self._num_without_reuse(slot, engine_hashes, ours if factor == 1 else ours[factor - 1 :: factor])
            if num_kept < len(engine_hashes):
                num_refused = len(engine_hashes) - num_kept
                self._refuse(
                    slot,
                    "num_engine_hash_reuse_blocks",
                    f"{num_refused} blocks from engine hash {engine_hashes[num_kept]}, which already names another "
                    "block the worker holds (an engine hash must identify one block)",
                    num_refused,
                )
                if not num_kept:
                    return ()
                engine_hashes = engine_hashes[:num_kept]
                ours = ours[: num_kept * factor]
        self.holdings.hold(slot, lane_key, ours, first_parent, parent_hash is None and not num_skipped)
        if factor == 1:
            engine.update(zip(engine_hashes, ours, strict=True))
        else:
            engine.update(zip(engine_hashes, ours[factor - 1 :: factor], strict=True))
            slot.spans.update(zip(zip(repeat(event.medium), engine_hashes), repeat(factor)))
            slot.span_held.update((lane_key, h) for i, h in enumerate(ours) if i % factor != factor - 1)
        counters["num_blocks_stored"] += len(ours)
        if event.medium in self.state.pool_members:
            note_pool_stores(self.state, slot, event.medium, event.group_idx, ours)
        return engine_hashes

    def _num_without_reuse(self, slot: Slot, engine_hashes: Sequence[int], targets: Sequence[int]) -> int:
        """How many leading blocks of a store keep every engine hash naming one block of the slot.

        A block is reused when its engine hash already maps to another of our block hashes that the slot still
        holds (SGLang's oldest publisher hashed each page alone, so equal pages shared a hash). Remapping it would
        leave the held block without an engine hash, beyond the reach of removals and clears; the store is cut
        before the first such block.
        """
        engine = slot.engine
        for position, (engine_hash, block_hash) in enumerate(zip(engine_hashes, targets, strict=True)):
            known = engine.get(engine_hash)
            if known is not None and known != block_hash and self.state.slot_holds_hash(slot, known):
                return position
        return len(engine_hashes)

    def _store_by_engine_hash(self, slot: Slot, event: BlockStored, lane_key: LaneKey, factor: int) -> Sequence[int]:
        targets: list[int] = []
        span_marked: list[int] = []
        parent = self.state.parent
        kind = self.state.kind
        for engine_hash in event.block_hashes:
            block_hash = slot.engine.get(engine_hash)
            entry_id = self.state.find_entry(block_hash) if block_hash is not None else None
            if entry_id is None:
                self.state.counters["num_unresolved_offload_blocks"] += factor
                continue
            targets.append(entry_id)
            if factor > 1:
                slot.spans[(event.medium, engine_hash)] = factor
                ancestor = entry_id
                for _ in range(factor - 1):
                    ancestor = parent[ancestor]
                    if not kind[ancestor] & 1 or not self.state.slot_holds(slot, ancestor):
                        self.state.counters["num_unresolved_offload_blocks"] += 1
                        break
                    span_marked.append(ancestor)
        for entry_id in targets:
            self.holdings.hold_one(slot, lane_key, entry_id)
        for entry_id in span_marked:
            self.holdings.hold_one(slot, lane_key, entry_id)
            slot.span_held.add((lane_key, self.state.hash_of[entry_id]))
        self.state.counters["num_blocks_stored"] += len(targets) + len(span_marked)
        if event.medium in self.state.pool_members and (targets or span_marked):
            hashes = [self.state.hash_of[i] for i in targets + span_marked]
            note_pool_stores(self.state, slot, event.medium, event.group_idx, hashes)
        return ()

    def _park(self, slot: Slot, event: BlockStored) -> None:
        num_blocks = len(event.block_hashes)
        self.state.counters["num_orphan_blocks"] += num_blocks
        cap = self.state.config.max_parked_events_per_worker
        if cap == 0 or event.parent_block_hash is None:
            self.state.counters["num_parked_blocks_dropped"] += num_blocks
            return
        slot.parked.setdefault(event.parent_block_hash, []).append(event)
        slot.parked_order.append((event.parent_block_hash, event))
        while len(slot.parked_order) > cap:
            engine_hash, old = slot.parked_order.popleft()
            waiting = slot.parked.get(engine_hash)
            if waiting is None or not any(e is old for e in waiting):
                continue  # already applied
            waiting.remove(old)
            if not waiting:
                del slot.parked[engine_hash]
            self.state.counters["num_parked_blocks_dropped"] += len(old.block_hashes)

    def _remove(self, slot: Slot, event: BlockRemoved) -> None:
        lane_key: LaneKey = (event.group_idx, event.medium)
        if (
            lane_key == GPU0
            and self.holdings.bulk_paths
            and len(self.state.lanes) == 1
            and not (slot.spans or slot.approx or slot.span_held)
        ):
            self._remove_gpu_only(slot, event.block_hashes)
            self.upkeep.maybe_sweep_engine(slot)
            return
        counters = self.state.counters
        parent = self.state.parent
        block_hash_of = self.state.hash_of
        id_of = self.state.id_of
        for engine_hash in event.block_hashes:
            block_hash = slot.engine.get(engine_hash)
            if block_hash is None:
                holder = self._pool_holder(slot, lane_key, engine_hash)
                if holder is None:
                    counters["num_unknown_removals"] += 1
                else:  # a member found the pool lost a block another member stored: applied as the holder's
                    self._remove(holder, BlockRemoved(block_hashes=(engine_hash,), medium=event.medium,
                                                      group_idx=event.group_idx))  # fmt: skip
                continue
            entry_id = self.state.find_entry(block_hash)
            targets = [] if entry_id is None else [(entry_id, block_hash)]
            factor = slot.spans.get((event.medium, engine_hash), 1) if slot.spans else 1
            for _ in range(factor - 1 if targets else 0):
                ancestor = parent[targets[-1][0]]
                if not self.state.kind[ancestor] & 1 or (lane_key, block_hash_of[ancestor]) not in slot.span_held:
                    break
                targets.append((ancestor, block_hash_of[ancestor]))
            dropped = False
            for target, target_hash in targets:
                if id_of.get(target_hash) == target:  # (still the same entry)
                    dropped = self.holdings.drop(slot, lane_key, target) or dropped
            if dropped:
                counters["num_blocks_removed"] += 1
                if lane_key == GPU0:
                    self.state.journal_seq += 1
                    slot.note_evicted(block_hash, self.state.journal_seq, self.state.journal_floor)
                elif lane_key[0] == 0 and event.medium in self.state.pool_members:
                    state = self.state
                    state.journal_seq += 1
                    state.pool_evicted[event.medium].note(block_hash, state.journal_seq, state.journal_floor)
            else:
                counters["num_removals_not_held"] += 1
            if not self.state.slot_holds_hash(slot, block_hash):
                del slot.engine[engine_hash]
                if factor > 1:
                    del slot.spans[(event.medium, engine_hash)]
        self.upkeep.maybe_sweep_engine(slot)

    def _pool_holder(self, slot: Slot, lane_key: LaneKey, engine_hash: int) -> Slot | None:
        """Another pool member's slot holding ``engine_hash`` on the pool lane ``lane_key``, when ``slot`` is a
        member of that pool that does not know the hash (a worker reporting a pool block gone that another member
        stored), else ``None``. O(the pool members' slots)."""
        state = self.state
        members = state.pool_members.get(lane_key[1])
        lane = state.lanes.get(lane_key)
        if members is None or lane is None or slot.worker_id not in members:
            return None
        for worker_id in members:
            for other in state.worker_slots(worker_id):
                block_hash = other.engine.get(engine_hash)
                if block_hash is not None and lane[state.id_of.get(block_hash, NULL_ID)] & other.mask:
                    return other
        return None

    def _remove_gpu_only(self, slot: Slot, engine_hashes: Sequence[int]) -> None:
        """``_remove`` on the GPU lane of group 0 when it is the index's only lane and the slot has no offload
        spans or approximate blocks (an engine with events and no lower tier: the common case): the same changes as
        ``Holdings.drop`` per block (an extra copy, else the bit, ``num_held``, gaps, the entry's deletion; the
        eviction journal, the engine-hash mapping), inlined in one loop over the event's hashes."""
        state = self.state
        engine = slot.engine
        id_of = state.id_of
        kind = state.kind
        parent = state.parent
        gpu = state.gpu0
        extra_children = state.extra_children
        mask = slot.mask
        copies = slot.copies
        num_unknown = num_not_held = num_dropped = num_dropped_copies = 0
        num_emptied = 0
        gaps = 0
        for engine_hash in engine_hashes:
            block_hash = engine.get(engine_hash)
            if block_hash is None:
                num_unknown += 1
                continue
            entry_id = id_of.get(block_hash, NULL_ID)
            holders = gpu[entry_id]  # 0 for an unknown hash (the null id) and for dangling keys
            if copies:
                key = (GPU0, block_hash)
                num_copies = copies.get(key)
                if num_copies:  # one copy of several goes: the block stays held, its engine hash mapped
                    if num_copies == 1:
                        del copies[key]
                    else:
                        copies[key] = num_copies - 1
                    num_dropped_copies += 1
                    state.journal_seq += 1
                    slot.note_evicted(block_hash, state.journal_seq, state.journal_floor)
                    continue
            if not holders & mask:
                num_not_held += 1
                del engine[engine_hash]
                continue
            holders ^= mask
            gpu[entry_id] = holders
            num_dropped += 1
            # Gaps: the block's held children become gaps; the block was one if its parent is not held.
            nxt = entry_id + 1
            if nxt < state.num_ids and parent[nxt] == entry_id and gpu[nxt] & mask:
                gaps += 1
            extra = extra_children.get(entry_id)
            if extra is not None:
                if type(extra) is int:
                    gaps += 1 if gpu[extra] & mask else 0
                else:
                    assert isinstance(extra, list)
                    gaps += sum(1 for child in extra if gpu[child] & mask)
            if kind[entry_id] != ROOTED and not gpu[parent[entry_id]] & mask:
                gaps -= 1
            state.journal_seq += 1
            slot.note_evicted(block_hash, state.journal_seq, state.journal_floor)
            del engine[engine_hash]
            if not holders:
                num_emptied += 1
                state.maybe_delete_entry(entry_id)
        if num_dropped:
            slot.num_held[GPU0] -= num_dropped
            state.lane_sizes[GPU0] -= num_emptied
        if gaps:
            state.add_gaps(slot, gaps)
        counters = state.counters
        counters["num_unknown_removals"] += num_unknown
        counters["num_removals_not_held"] += num_not_held
        counters["num_blocks_removed"] += num_dropped + num_dropped_copies
