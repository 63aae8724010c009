"""The prefix index: which worker holds which prefix, on which tier.

Layout (all plain dicts of ints, no object per block)::

    lanes[(group, medium)] : {block_hash -> holder mask}   one bit per slot (worker, dp_rank)
    parent                 : {block_hash -> parent hash}   one entry per block, insertion order = LRU order
    num_children           : {block_hash -> n}             only for blocks that have children in the index
    slot.engine            : {engine hash -> block_hash}   per slot, resolves BlockRemoved and offload stores

``block_hash`` is our own chained hash (``router.block_hash``), so a hash identifies a whole prefix and the
"radix tree" needs no child tables: a prompt's hashes are probed position by position and the holder masks are
AND-accumulated until no slot continues (``router.index.match``). One entry per block regardless of how many
workers hold it; a holding is one bit.

Invariants:
  * A block is an entry (``block_hash in parent``) while some lane holds it or it has children.
  * ``num_children[h]`` counts entries whose parent is ``h`` (absent when 0).
  * Eviction order for the block cap: oldest stored (or re-stored) first, leaves only; a parent becomes a leaf
    when its last child goes and is pruned next if it was older than that child.
  * Copy counts: a slot holding a block twice on one lane (two physical copies, or two engine hashes with one
    content) needs as many removals before its bit clears.

Child before parent: a ``BlockStored`` whose ``parent_block_hash`` is not (yet) known for the same worker and
dp_rank is never attached anywhere: our hash of its blocks depends on the parent's, which we do not have. It is
parked per slot (bounded, oldest dropped and counted) and applied as soon as a store maps that engine hash;
a clear of the slot drops it. Removals of blocks never stored are counted and skipped.

Offload stores without tokens (vLLM's CPU connector) are resolved through ``slot.engine``; an offloaded block
covering ``k`` index blocks (``block_size = k * index block_size``) is the engine hash of the last of them, and
marks that block and its ``k - 1`` ancestors that the slot knows.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import and_, or_

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Medium, Resync
from router.block_hash import (
    DEFAULT_NAMESPACE,
    BlockHash,
    hash_block_bytes,
    make_namespace,
    split_extra_keys,
    tokens_to_bytes,
)
from router.index.config import GroupKind, GroupSpec, IndexConfig, group_spec_from_event
from router.index.errors import IndexConfigError, UnknownWorkerError
from router.index.match import (
    hybrid_prefix_len,
    iter_bits,
    position_bitsets,
    prefix_depths,
    prefix_depths_u64,
)
from router.index.result import ChainDump, IndexStats, MatchResult, WorkerMatch
from router.index.slots import LaneKey, Slot

logger = logging.getLogger(__name__)

POOL_MEDIA: frozenset[Medium] = frozenset({Medium.MOONCAKE})
"""Tiers shared by several workers; membership comes from ``set_pool_members``."""
OWN_LOWER_MEDIA: tuple[Medium, ...] = (Medium.CPU, Medium.DISK)
"""A worker's own tiers below the GPU."""
GPU0: LaneKey = (0, Medium.GPU)

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


class PrefixIndex:
    """Per-block holders across workers and tiers, fed by normalized KV events; see the module docstring.

    Not thread-safe: the gateway calls it from one event loop (event sinks and the request path alike).
    Every method runs in time proportional to its input (a batch, a prompt, one worker's blocks), except
    pruning, which is amortized over the stores that triggered it.

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
        self._num_children: dict[int, int] = {}
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

    # ------------------------------------------------------------------ events

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of a worker's events, in order. Never raises for bad events: they are counted."""
        slot = self._slot(batch.worker_id, batch.dp_rank)
        counters = self._counters
        counters["num_batches"] += 1
        counters["num_events"] += len(batch.events)
        for event in batch.events:
            try:
                if type(event) is BlockStored:
                    self._store_with_parked(slot, event)
                elif type(event) is BlockRemoved:
                    self._remove(slot, event)
                elif type(event) is AllBlocksCleared:
                    self._clear_slot(slot, event.medium, include_pool=False)
                else:
                    counters["num_malformed_events"] += 1
            except (ValueError, TypeError, OverflowError) as exc:
                counters["num_malformed_events"] += 1
                logger.debug("skipped a malformed event of %s/%d: %s", batch.worker_id, batch.dp_rank, exc)
        if len(self._parent) > self.config.max_blocks:
            self._prune()

    def apply_resync(self, resync: Resync) -> None:
        """Forget what is known about a worker's own tiers, all dp ranks (its pool-tier holdings stay)."""
        self._counters["num_resyncs"] += 1
        logger.info("resync of worker %s (%s): clearing its index entries", resync.worker_id, resync.reason)
        for slot in self._worker_slots(resync.worker_id):
            self._clear_slot(slot, None, include_pool=False)

    def _store_with_parked(self, slot: Slot, event: BlockStored) -> None:
        stack = [event]
        while stack:
            mapped = self._store(slot, stack.pop())
            if slot.parked and mapped:
                for engine_hash in mapped:
                    waiting = slot.parked.pop(engine_hash, None)
                    if waiting:
                        self._counters["num_parked_blocks_applied"] += sum(len(e.block_hashes) for e in waiting)
                        stack.extend(waiting)

    def _store(self, slot: Slot, event: BlockStored) -> Sequence[int]:
        """Apply one store; returns the engine hashes it mapped (to release parked children)."""
        counters = self._counters
        num_event_blocks = len(event.block_hashes)
        if num_event_blocks == 0:
            return ()
        group = event.group_idx
        if group not in self._groups:
            spec = group_spec_from_event(event.kv_cache_spec_kind, event.sliding_window_tokens)
            self._groups[group] = spec if spec is not None else GroupSpec(GroupKind.FULL)
        lane_key: LaneKey = (group, event.medium)
        event_block_size = event.block_size or self._block_size
        if event_block_size < 0 or event_block_size % self._block_size:
            counters["num_block_size_mismatch_blocks"] += num_event_blocks
            logger.debug("block size %d is not a multiple of %d", event.block_size, self._block_size)
            return ()
        factor = event_block_size // self._block_size
        if not event.token_ids:
            return self._store_by_engine_hash(slot, event, lane_key, factor)
        if len(event.token_ids) != event_block_size * num_event_blocks:
            raise ValueError(f"{len(event.token_ids)} tokens for {num_event_blocks} blocks of {event_block_size}")
        parent_hash: int | None = None
        if event.parent_block_hash is not None:
            parent_hash = slot.engine.get(event.parent_block_hash)
            if parent_hash is None:
                self._park(slot, event)
                return ()
        salt, num_ok = split_extra_keys(event.extra_keys, event.lora_name, num_event_blocks)
        if parent_hash is not None and salt is not None:
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
        token_ids = event.token_ids if num_ok == num_event_blocks else event.token_ids[: num_ok * event_block_size]
        data = tokens_to_bytes(token_ids)
        ours: list[int] = list(
            hash_block_bytes(
                data, self._block_size, namespace, BlockHash(parent_hash) if parent_hash is not None else None
            )
        )
        first_parent = namespace if parent_hash is None else parent_hash
        self._hold(slot, lane_key, ours, first_parent)
        engine_hashes = event.block_hashes[:num_ok]
        if factor == 1:
            slot.engine.update(zip(engine_hashes, ours, strict=True))
        else:
            slot.engine.update(zip(engine_hashes, ours[factor - 1 :: factor], strict=True))
            slot.spans.update(zip(zip(repeat(event.medium), engine_hashes), repeat(factor)))
            slot.span_held.update((lane_key, h) for i, h in enumerate(ours) if i % factor != factor - 1)
        counters["num_blocks_stored"] += len(ours)
        return engine_hashes

    def _store_by_engine_hash(self, slot: Slot, event: BlockStored, lane_key: LaneKey, factor: int) -> Sequence[int]:
        targets: list[int] = []
        span_marked: list[int] = []
        parent = self._parent
        for engine_hash in event.block_hashes:
            block_hash = slot.engine.get(engine_hash)
            if block_hash is None or block_hash not in parent:
                self._counters["num_unresolved_offload_blocks"] += factor
                continue
            targets.append(block_hash)
            if factor > 1:
                slot.spans[(event.medium, engine_hash)] = factor
                ancestor = block_hash
                for _ in range(factor - 1):
                    ancestor = parent.get(ancestor, -1)
                    if ancestor not in parent or not self._slot_holds(slot, ancestor):
                        self._counters["num_unresolved_offload_blocks"] += 1
                        break
                    span_marked.append(ancestor)
        for block_hash in targets:
            self._hold_one(slot, lane_key, block_hash)
        for block_hash in span_marked:
            self._hold_one(slot, lane_key, block_hash)
            slot.span_held.add((lane_key, block_hash))
        self._counters["num_blocks_stored"] += len(targets) + len(span_marked)
        return ()

    def _park(self, slot: Slot, event: BlockStored) -> None:
        num_blocks = len(event.block_hashes)
        self._counters["num_orphan_blocks"] += num_blocks
        cap = self.config.max_parked_events_per_worker
        if cap == 0 or event.parent_block_hash is None:
            self._counters["num_parked_blocks_dropped"] += num_blocks
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
            self._counters["num_parked_blocks_dropped"] += len(old.block_hashes)

    def _link(self, hashes: list[int], first_parent: int) -> None:
        """Create or touch (move to most recent) the entries of a chain, root-most first."""
        parent = self._parent
        num_children = self._num_children
        if not any(map(parent.__contains__, hashes)):
            # All new (the common case of a growing conversation): bulk inserts at C speed.
            parent.update(zip(hashes, [first_parent, *hashes[:-1]], strict=True))
            num_children.update(zip(hashes[:-1], repeat(1)))
            if first_parent in parent:
                num_children[first_parent] = num_children.get(first_parent, 0) + 1
            return
        prev = first_parent
        for block_hash in hashes:
            if block_hash in parent:
                parent[block_hash] = parent.pop(block_hash)
            else:
                parent[block_hash] = prev
                if prev in parent:
                    num_children[prev] = num_children.get(prev, 0) + 1
            prev = block_hash

    def _hold(self, slot: Slot, lane_key: LaneKey, hashes: list[int], first_parent: int) -> None:
        """Add the slot as holder of a chain on one lane (with copy counting and approximate confirmation)."""
        self._link(hashes, first_parent)
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._lanes[lane_key] = {}
        mask = slot.mask
        olds = list(map(lane.get, hashes, repeat(0)))
        lane.update(zip(hashes, map(or_, olds, repeat(mask)), strict=True))
        dups = (
            [h for h, old in zip(hashes, olds, strict=True) if old & mask] if any(map(and_, olds, repeat(mask))) else []
        )
        slot.num_held[lane_key] = slot.num_held.get(lane_key, 0) + len(hashes) - len(dups)
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

    def _add_copy(self, slot: Slot, lane_key: LaneKey, block_hash: int) -> None:
        if lane_key == GPU0 and slot.approx.pop(block_hash, None) is not None:
            self._num_approx -= 1
            self._counters["num_approx_blocks_confirmed"] += 1
            return
        key = (lane_key, block_hash)
        slot.copies[key] = slot.copies.get(key, 0) + 1
        self._counters["num_extra_copies_stored"] += 1

    def _remove(self, slot: Slot, event: BlockRemoved) -> None:
        lane_key: LaneKey = (event.group_idx, event.medium)
        counters = self._counters
        for engine_hash in event.block_hashes:
            block_hash = slot.engine.get(engine_hash)
            if block_hash is None:
                counters["num_unknown_removals"] += 1
                continue
            targets = [block_hash]
            factor = slot.spans.get((event.medium, engine_hash), 1) if slot.spans else 1
            for _ in range(factor - 1):
                ancestor = self._parent.get(targets[-1])
                if ancestor is None or (lane_key, ancestor) not in slot.span_held:
                    break
                targets.append(ancestor)
            dropped = False
            for target in targets:
                dropped = self._drop(slot, lane_key, target) or dropped
            if dropped:
                counters["num_blocks_removed"] += 1
            else:
                counters["num_removals_not_held"] += 1
            if not self._slot_holds(slot, block_hash):
                del slot.engine[engine_hash]
                if factor > 1:
                    del slot.spans[(event.medium, engine_hash)]
        self._maybe_sweep_engine(slot)

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
        if lane_key == GPU0 and slot.approx and slot.approx.pop(block_hash, None) is not None:
            self._num_approx -= 1
        if slot.span_held:
            slot.span_held.discard(key)
        if not mask:
            self._maybe_delete_entry(block_hash)
        return True

    def _slot_holds(self, slot: Slot, block_hash: int) -> bool:
        mask = slot.mask
        return any(lane.get(block_hash, 0) & mask for lane in self._lanes.values())

    def _is_held(self, block_hash: int) -> bool:
        return any(block_hash in lane for lane in self._lanes.values())

    def _maybe_delete_entry(self, block_hash: int) -> None:
        """Delete a childless, holderless entry and cascade to its parent."""
        parent = self._parent
        num_children = self._num_children
        while block_hash in parent and block_hash not in num_children and not self._is_held(block_hash):
            up = parent.pop(block_hash)
            count = num_children.get(up)
            if count is None:
                return
            if count > 1:
                num_children[up] = count - 1
                return
            del num_children[up]
            block_hash = up

    def _maybe_sweep_engine(self, slot: Slot) -> None:
        """Drop engine-hash mappings of blocks the slot no longer holds once they outnumber its holdings."""
        if len(slot.engine) <= 2 * sum(slot.num_held.values()) + 4096:
            return
        stale = [eh for eh, h in slot.engine.items() if not self._slot_holds(slot, h)]
        for engine_hash in stale:
            del slot.engine[engine_hash]
        if slot.spans:
            slot.spans = {key: k for key, k in slot.spans.items() if key[1] in slot.engine}

    # ------------------------------------------------------------------ clearing

    def _clear_slot(self, slot: Slot, medium: Medium | None, *, include_pool: bool) -> None:
        """Drop a slot's holdings on one medium, or on all its own media (and the pool ones if asked)."""
        self._counters["num_worker_clears"] += 1
        lane_keys = [
            key
            for key in self._lanes
            if (key[1] == medium if medium is not None else include_pool or key[1] not in POOL_MEDIA)
        ]
        candidates = set(slot.engine.values())
        candidates.update(h for _, h in slot.span_held)
        candidates.update(slot.approx)
        mask = slot.mask
        keep = ~mask
        freed: list[int] = []
        for lane_key in lane_keys:
            if not slot.num_held.get(lane_key):
                continue
            lane = self._lanes[lane_key]
            for block_hash in candidates:
                holders = lane.get(block_hash, 0)
                if holders & mask:
                    holders &= keep
                    if holders:
                        lane[block_hash] = holders
                    else:
                        del lane[block_hash]
                        freed.append(block_hash)
            slot.num_held[lane_key] = 0
        cleared = set(lane_keys)
        if slot.copies:
            slot.copies = {key: n for key, n in slot.copies.items() if key[0] not in cleared}
        if slot.span_held:
            slot.span_held = {key for key in slot.span_held if key[0] not in cleared}
        if GPU0 in cleared:
            self._num_approx -= len(slot.approx)
            slot.approx.clear()
        if medium is None:
            slot.parked.clear()
            slot.parked_order.clear()
        if medium is None and include_pool:
            slot.engine.clear()
            slot.spans.clear()
        else:
            mapped_hashes = {h for h in candidates if self._slot_holds(slot, h)}
            slot.engine = {eh: h for eh, h in slot.engine.items() if h in mapped_hashes}
            slot.spans = {key: k for key, k in slot.spans.items() if key[1] in slot.engine}
        for block_hash in freed:
            self._maybe_delete_entry(block_hash)

    def clear_worker(self, worker_id: str, medium: Medium | None = None) -> None:
        """Drop a worker's holdings (all dp ranks) on one medium, or on every medium including pools.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        slots = self._worker_slots(worker_id)
        if not slots:
            raise UnknownWorkerError(worker_id)
        for slot in slots:
            self._clear_slot(slot, medium, include_pool=True)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (removed from the fleet); a no-op for an unknown worker."""
        for slot in self._worker_slots(worker_id):
            self._clear_slot(slot, None, include_pool=True)
            slot.is_live = False
            del self._slots[(slot.worker_id, slot.dp_rank)]
            del self._slots_by_bit[slot.bit]
            self._free_bits.append(slot.bit)
        self._recompute_pool_masks()

    def clear(self) -> None:
        """Drop every block of every worker (workers, pools and groups stay configured)."""
        for lane in self._lanes.values():
            lane.clear()
        self._parent.clear()
        self._num_children.clear()
        for slot in self._slots.values():
            slot.is_live = False
            fresh = Slot(slot.worker_id, slot.dp_rank, slot.bit)
            self._slots[(slot.worker_id, slot.dp_rank)] = fresh
            self._slots_by_bit[slot.bit] = fresh
        self._approx_queue.clear()
        self._num_approx = 0

    # ------------------------------------------------------------------ the block cap

    def _prune(self) -> None:
        parent = self._parent
        num_children = self._num_children
        excess = len(parent) - int(self.config.max_blocks * self.config.prune_target_ratio)
        skipped: set[int] = set()
        touched: set[Slot] = set()
        for block_hash in list(parent):
            if excess <= 0:
                break
            if block_hash not in parent:
                continue
            if block_hash in num_children:
                skipped.add(block_hash)
                continue
            current = block_hash
            while True:
                up = self._evict_entry(current, touched)
                excess -= 1
                if excess <= 0 or up not in skipped or up in num_children or up not in parent:
                    break
                current = up
        for slot in touched:
            self._maybe_sweep_engine(slot)

    def _evict_entry(self, block_hash: int, touched: set[Slot]) -> int:
        for lane_key, lane in self._lanes.items():
            holders = lane.pop(block_hash, 0)
            for bit in iter_bits(holders):
                slot = self._slots_by_bit[bit]
                touched.add(slot)
                slot.num_held[lane_key] -= 1
                if slot.copies:
                    slot.copies.pop((lane_key, block_hash), None)
                if slot.span_held:
                    slot.span_held.discard((lane_key, block_hash))
                if lane_key == GPU0 and slot.approx.pop(block_hash, None) is not None:
                    self._num_approx -= 1
        up = self._parent.pop(block_hash)
        count = self._num_children.get(up)
        if count is not None:
            if count > 1:
                self._num_children[up] = count - 1
            else:
                del self._num_children[up]
        self._counters["num_pruned_blocks"] += 1
        return up

    # ------------------------------------------------------------------ approximate mode

    def insert_approximate(
        self, worker_id: str, block_hashes: Sequence[int], now_s: float, dp_rank: int = 0, ttl_s: float | None = None
    ) -> None:
        """Record that a routing decision sent these blocks to a worker (no events, or not yet confirmed).

        The blocks (our hashes from the root, group 0, GPU) expire ``ttl_s`` (default ``approx_ttl_s``) after
        ``now_s`` unless an event of the worker stores them first (then they are the event's and stop expiring).
        Re-inserting refreshes the expiry. Blocks beyond ``approx_max_blocks`` evict the soonest-expiring
        approximate ones. Records of different TTLs expire in expiry order (a heap).

        Args:
            worker_id: the chosen worker.
            block_hashes: the request's block hashes, root-most first.
            now_s: monotonic time in seconds.
            dp_rank: the worker's rank, if known.
            ttl_s: lifetime in seconds of these blocks, or ``None`` for ``approx_ttl_s``.

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """
        if ttl_s is not None and ttl_s <= 0.0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.expire(now_s)
        if not block_hashes:
            return
        slot = self._slot(worker_id, dp_rank)
        hashes = list(block_hashes)
        self._link(hashes, 0)
        expiry = now_s + (self.config.approx_ttl_s if ttl_s is None else ttl_s)
        lane = self._gpu0
        mask = slot.mask
        approx = slot.approx
        num_new = 0
        for block_hash, old in zip(hashes, list(map(lane.get, hashes, repeat(0))), strict=True):
            if old & mask:
                if block_hash in approx:
                    approx[block_hash] = expiry
                continue
            lane[block_hash] = old | mask
            approx[block_hash] = expiry
            num_new += 1
        slot.num_held[GPU0] = slot.num_held.get(GPU0, 0) + num_new
        self._num_approx += num_new
        self._counters["num_approx_blocks_inserted"] += num_new
        self._approx_seq += 1
        heapq.heappush(self._approx_queue, (expiry, self._approx_seq, slot, tuple(hashes)))
        if self._num_approx > self.config.approx_max_blocks:
            target = int(self.config.approx_max_blocks * self.config.prune_target_ratio)
            while self._num_approx > target and self._approx_queue:
                self._expire_record(*heapq.heappop(self._approx_queue))
        if len(self._parent) > self.config.max_blocks:
            self._prune()

    def expire(self, now_s: float) -> int:
        """Drop approximate blocks whose TTL ended at or before ``now_s``; returns how many went."""
        queue = self._approx_queue
        num_expired = 0
        while queue and queue[0][0] <= now_s:
            num_expired += self._expire_record(*heapq.heappop(queue))
        return num_expired

    def _expire_record(self, expiry: float, seq: int, slot: Slot, hashes: tuple[int, ...]) -> int:
        if not slot.is_live:
            return 0
        num_expired = 0
        for block_hash in hashes:
            if slot.approx.get(block_hash) == expiry and self._drop(slot, GPU0, block_hash):
                num_expired += 1
        self._counters["num_approx_blocks_expired"] += num_expired
        return num_expired

    # ------------------------------------------------------------------ queries

    def match(self, block_hashes: Sequence[int]) -> MatchResult:
        """How far each worker holds the prompt's prefix, per tier.

        Args:
            block_hashes: the prompt's block hashes (``router.block_hash``), root-most first.

        Returns:
            Per worker with a non-empty match: GPU depth, then the CPU/disk continuation, then the shared pool
            continuation (``WorkerMatch``); for a worker with several dp ranks, the rank with the longest one.
        """
        num_blocks = len(block_hashes)
        if not num_blocks or not self._slots:
            return MatchResult({}, num_blocks)
        if len(self._groups) > 1 or self._groups[0].kind is not GroupKind.FULL:
            return self._match_hybrid(block_hashes)
        gpu = self._gpu0
        lower = [lane for (g, medium), lane in self._lanes.items() if g == 0 and medium in OWN_LOWER_MEDIA and lane]
        pools = [
            (lane, self._pool_masks.get(medium, 0))
            for (g, medium), lane in self._lanes.items()
            if g == 0 and medium in POOL_MEDIA and lane
        ]
        if not lower and not pools:
            if len(self._slots_by_bit) + len(self._free_bits) <= 64:
                gpu_depths, _ = prefix_depths_u64(gpu.get, block_hashes)
            else:
                gpu_depths, _ = prefix_depths(map(gpu.get, block_hashes, repeat(0)))
            return self._result(gpu_depths, gpu_depths, gpu_depths, num_blocks)
        pool_depths, max_depth = prefix_depths(self._level_masks(block_hashes, lower, pools))
        if not max_depth:
            return MatchResult({}, num_blocks)
        prefix = block_hashes[:max_depth]
        own_depths = prefix_depths(self._level_masks(prefix, lower, []))[0] if pools else pool_depths
        if len(self._slots_by_bit) + len(self._free_bits) <= 64:
            gpu_depths = prefix_depths_u64(gpu.get, prefix)[0]
        else:
            gpu_depths = prefix_depths(map(gpu.get, prefix, repeat(0)))[0]
        return self._result(gpu_depths, own_depths, pool_depths, num_blocks)

    def _level_masks(
        self,
        hashes: Sequence[int],
        lower: list[dict[int, int]],
        pools: list[tuple[dict[int, int], int]],
        group: int = 0,
    ) -> Iterator[int]:
        it: Iterator[int] = map(self._lanes.get((group, Medium.GPU), {}).get, hashes, repeat(0))
        for lane in lower:
            it = map(or_, it, map(lane.get, hashes, repeat(0)))
        for lane, members in pools:

            def expand(holders: int, members: int = members) -> int:
                return holders | members if holders & members else holders

            it = map(or_, it, map(expand, map(lane.get, hashes, repeat(0))))
        return it

    def _result(self, gpu: dict[int, int], own: dict[int, int], pool: dict[int, int], num_blocks: int) -> MatchResult:
        best: dict[str, WorkerMatch] = {}
        for bit, total in pool.items():
            slot = self._slots_by_bit.get(bit)
            if slot is None:
                continue
            num_gpu = gpu.get(bit, 0)
            num_own = own.get(bit, 0)
            found = WorkerMatch(slot.worker_id, slot.dp_rank, num_gpu, num_own - num_gpu, total - num_own)
            current = best.get(slot.worker_id)
            if current is None or (found.num_blocks, num_gpu, -slot.dp_rank) > (
                current.num_blocks,
                current.num_gpu_blocks,
                -current.dp_rank,
            ):
                best[slot.worker_id] = found
        return MatchResult(best, num_blocks)

    def _match_hybrid(self, block_hashes: Sequence[int]) -> MatchResult:
        num_blocks = len(block_hashes)
        groups = sorted(self._groups)
        specs = [self._groups[g] for g in groups]
        per_level: list[dict[int, int]] = []
        for level in range(3):
            bitsets_by_group = []
            for group in groups:
                lower = [
                    lane for (g, m), lane in self._lanes.items() if g == group and m in OWN_LOWER_MEDIA and level >= 1
                ]
                pools = [
                    (lane, self._pool_masks.get(m, 0))
                    for (g, m), lane in self._lanes.items()
                    if g == group and m in POOL_MEDIA and level >= 2
                ]
                masks = list(self._level_masks(block_hashes, lower, pools, group))
                bitsets_by_group.append(position_bitsets(masks))
            bits = set().union(*bitsets_by_group)
            per_level.append(
                {
                    bit: length
                    for bit in bits
                    if (
                        length := hybrid_prefix_len(
                            [b.get(bit, 0) for b in bitsets_by_group], specs, num_blocks, self._block_size
                        )
                    )
                }
            )
        return self._result(per_level[0], per_level[1], per_level[2], num_blocks)

    # ------------------------------------------------------------------ introspection

    def num_blocks(self) -> int:
        """Indexed blocks (entries)."""
        return len(self._parent)

    def stats(self) -> IndexStats:
        """Sizes per worker and tier, and the counters."""
        by_worker: dict[str, dict[str, int]] = {}
        for slot in self._slots.values():
            sizes = by_worker.setdefault(slot.worker_id, {})
            for (_, medium), count in slot.num_held.items():
                sizes[medium.value] = sizes.get(medium.value, 0) + count
        counters = dict(self._counters)
        counters["num_parked_events"] = sum(len(w) for s in self._slots.values() for w in s.parked.values())
        return IndexStats(len(self._parent), self._num_approx, by_worker, counters)

    def dump_worker(self, worker_id: str) -> list[ChainDump]:
        """A worker's chains (group 0), each from its first held block to a held leaf, sorted.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        slots = self._worker_slots(worker_id)
        if not slots:
            raise UnknownWorkerError(worker_id)
        group0 = [(medium, lane) for (g, medium), lane in self._lanes.items() if g == 0]
        chains: list[ChainDump] = []
        for slot in sorted(slots, key=lambda s: s.dp_rank):
            mask = slot.mask
            candidates = set(slot.engine.values()) | {h for _, h in slot.span_held} | set(slot.approx)
            held = {h for h in candidates if any(lane.get(h, 0) & mask for _, lane in group0)}
            parents = {self._parent.get(h) for h in held}
            for leaf in held - parents:
                chain = [leaf]
                while (up := self._parent.get(chain[-1])) in held and up is not None:
                    chain.append(up)
                chain.reverse()
                media = tuple(tuple(medium.value for medium, lane in group0 if lane.get(h, 0) & mask) for h in chain)
                chains.append(ChainDump(slot.dp_rank, tuple(chain), media))
        chains.sort(key=lambda c: (c.dp_rank, c.block_hashes))
        return chains
