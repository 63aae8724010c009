"""Queries of the prefix index: ``match`` and introspection (sizes, dumps).

``match`` for group 0 on GPU (the routing hot path) reads the holder masks of the prompt's blocks in the GPU
lane. Slots without gaps (``router.index.state``) hold a prefix of the prompt's positions and nothing after it,
so their depths come from a binary search over positions (``match.jump_levels``: 2 probes when every holder
holds the whole prompt, about ``2 log2 n`` more per distinct depth); slots with gaps are walked position by
position until the last of them stops (``match.prefix_levels``). This relies on ``block_hashes`` being a hash
chain (``router.block_hash``: each hash determines its whole prefix); for a sequence that is not one, a slot
without gaps may be credited with positions it does not hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat

from events.types import Medium
from router.index.errors import UnknownWorkerError
from router.index.match import (
    deepest_first,
    hybrid_prefix_len,
    jump_levels,
    levels_of,
    position_bitsets,
    prefix_levels,
    walk_levels,
)
from router.index.result import ChainDump, HolderMatches, IndexStats, Levels, MatchResult
from router.index.state import GPU0, NULL_ID, OWN_LOWER_MEDIA, POOL_MEDIA, IndexState

PoolHolding = tuple[str, int, int, int, int]
"""``(worker_id, dp_rank, group_idx, engine_hash, block_hash)`` of one pool-tier holding (``pool_holdings``)."""


class Query:
    """``match`` and introspection of ``PrefixIndex``.

    Args:
        state: the index tables it reads (never changes).
    """

    def __init__(self, state: IndexState) -> None:
        self.state = state

    def match(self, block_hashes: Sequence[int]) -> MatchResult:
        """How far each worker holds the prompt's prefix, per tier.

        Args:
            block_hashes: ``[n]`` the prompt's block hashes, root-most first: a hash chain as
                ``router.block_hash`` computes it (see the module docstring).

        Returns:
            Per worker with a non-empty match: GPU depth, then the CPU/disk continuation, then the shared pool
            continuation (``WorkerMatch``); for a worker with several dp ranks, the rank with the longest one.
            ``workers`` is a ``HolderMatches``: depths as levels of slot masks, resolved per worker on demand
            (no object per holder is built unless asked for).
        """
        state = self.state
        num_blocks = len(block_hashes)
        if not num_blocks or not state.slots:
            return MatchResult({}, num_blocks)
        if state.is_hybrid:
            return self._match_hybrid(block_hashes)
        sizes = state.lane_sizes
        if len(sizes) == 1 or sum(sizes.values()) == sizes[GPU0]:  # every lane but GPU0 is empty (no lower tier)
            levels = self._gpu_levels(block_hashes)
            if not levels:
                return MatchResult({}, num_blocks)
            return MatchResult(HolderMatches(levels, None, None, state.slots_by_bit, state.slots_of_worker),
                               num_blocks)
        lower = [
            lane
            for (g, medium), lane in self.state.lanes.items()
            if g == 0 and medium in OWN_LOWER_MEDIA and sizes[(g, medium)]
        ]
        pools = [
            (lane, self.state.pool_masks.get(medium, 0))
            for (g, medium), lane in self.state.lanes.items()
            if g == 0 and medium in POOL_MEDIA and sizes[(g, medium)]
        ]
        if not lower and not pools:
            return self._result(self._gpu_levels(block_hashes), None, None, num_blocks)
        pool_levels, max_depth = prefix_levels(self._level_masks(block_hashes, lower, pools))
        if not max_depth:
            return MatchResult({}, num_blocks)
        prefix = block_hashes[:max_depth]
        own_levels = prefix_levels(self._level_masks(prefix, lower, []))[0] if pools else pool_levels
        return self._result(
            deepest_first(pool_levels),
            self._gpu_levels(prefix),
            deepest_first(own_levels),
            num_blocks,
        )

    def _gpu_levels(self, hashes: Sequence[int]) -> Levels:
        """Contiguous GPU depths (group 0) of the slots holding ``hashes[0]``, as levels deepest first: jump search
        for slots without gaps, a walk with early exit for the others. ``hashes`` is non-empty. When every holder
        of the first block is without gaps and holds the last one too (a repeated prompt), two lookups."""
        state = self.state
        get = state.id_of.get
        gpu = state.gpu0
        first = gpu[get(hashes[0], NULL_ID)]
        if not first:
            return ()
        dirty = first & state.dirty_mask
        if not dirty:
            if gpu[get(hashes[-1], NULL_ID)] & first == first:
                return ((len(hashes), first),)
            return deepest_first(jump_levels(get, gpu, hashes, first))
        levels = jump_levels(get, gpu, hashes, first ^ dirty) if first ^ dirty else {}
        for depth, holders in walk_levels(get, state.hash_of, gpu, hashes, dirty).items():
            levels[depth] = levels.get(depth, 0) | holders
        return deepest_first(levels)

    def _level_masks(
        self,
        hashes: Sequence[int],
        lower: list[list[int]],
        pools: list[tuple[list[int], int]],
        group: int = 0,
    ) -> Iterator[int]:
        """Per position, the slots holding the block on GPU, on their own lower tiers, or through a pool."""
        ids = map(self.state.id_of.get, hashes, repeat(NULL_ID))
        gpu = self.state.lanes.get((group, Medium.GPU))
        if not lower and not pools:
            return map(gpu.__getitem__, ids) if gpu is not None else iter([0] * len(hashes))
        own = lower if gpu is None else [gpu, *lower]

        def level(entry_id: int) -> int:
            holders = 0
            for lane in own:
                holders |= lane[entry_id]
            for lane, members in pools:
                pooled = lane[entry_id]
                holders |= pooled | members if pooled & members else pooled
            return holders

        return map(level, ids)

    def _result(self, total: Levels, gpu: Levels | None, own: Levels | None, num_blocks: int) -> MatchResult:
        if not total:
            return MatchResult({}, num_blocks)
        state = self.state
        return MatchResult(HolderMatches(total, gpu, own, state.slots_by_bit, state.slots_of_worker), num_blocks)

    def _match_hybrid(self, block_hashes: Sequence[int]) -> MatchResult:
        num_blocks = len(block_hashes)
        groups = sorted(self.state.groups)
        specs = [self.state.groups[g] for g in groups]
        per_level: list[dict[int, int]] = []
        for level in range(3):
            bitsets_by_group = []
            for group in groups:
                lower = [
                    lane
                    for (g, m), lane in self.state.lanes.items()
                    if g == group and m in OWN_LOWER_MEDIA and level >= 1
                ]
                pools = [
                    (lane, self.state.pool_masks.get(m, 0))
                    for (g, m), lane in self.state.lanes.items()
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
                            [b.get(bit, 0) for b in bitsets_by_group], specs, num_blocks, self.state.block_size
                        )
                    )
                }
            )
        return self._result(
            deepest_first(levels_of(per_level[2])),
            deepest_first(levels_of(per_level[0])),
            deepest_first(levels_of(per_level[1])),
            num_blocks,
        )

    # ------------------------------------------------------------------ introspection

    def stats(self) -> IndexStats:
        """Sizes per worker and tier, and the counters."""
        by_worker: dict[str, dict[str, int]] = {}
        by_group: dict[str, dict[str, dict[str, int]]] = {str(g): {} for g in sorted(self.state.groups)}
        for slot in self.state.slots.values():
            sizes = by_worker.setdefault(slot.worker_id, {})
            for (group, medium), count in slot.num_held.items():
                sizes[medium.value] = sizes.get(medium.value, 0) + count
                group_sizes = by_group.setdefault(str(group), {}).setdefault(slot.worker_id, {})
                group_sizes[medium.value] = group_sizes.get(medium.value, 0) + count
        counters = dict(self.state.counters)
        counters["num_parked_events"] = sum(len(w) for s in self.state.slots.values() for w in s.parked.values())
        return IndexStats(self.state.num_entries, self.state.num_approx, by_worker, counters, by_group)

    @property
    def is_hybrid(self) -> bool:
        """Whether the index applies a hybrid hit rule (more than one cache group, or group 0 not full attention)."""
        return self.state.is_hybrid

    def dump_worker(self, worker_id: str) -> list[ChainDump]:
        """A worker's chains (group 0), each from its first held block to a held leaf, sorted.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        slots = self.state.worker_slots(worker_id)
        if not slots:
            raise UnknownWorkerError(worker_id)
        group0 = [(medium, lane) for (g, medium), lane in self.state.lanes.items() if g == 0]
        chains: list[ChainDump] = []
        parent = self.state.parent
        block_hash_of = self.state.hash_of
        for slot in sorted(slots, key=lambda s: s.dp_rank):
            mask = slot.mask
            candidates = set(slot.engine.values()) | {h for _, h in slot.span_held} | set(slot.approx)
            candidate_ids = {i for i in map(self.state.find_entry, candidates) if i is not None}
            held = {i for i in candidate_ids if any(lane[i] & mask for _, lane in group0)}
            parents = {parent[i] for i in held}
            for leaf in held - parents:
                chain = [leaf]
                while (up := parent[chain[-1]]) in held:
                    chain.append(up)
                chain.reverse()
                media = tuple(tuple(medium.value for medium, lane in group0 if lane[i] & mask) for i in chain)
                chains.append(ChainDump(slot.dp_rank, tuple(block_hash_of[i] for i in chain), media))
        chains.sort(key=lambda c: (c.dp_rank, c.block_hashes))
        return chains

    def pool_holdings(self, medium: Medium) -> list[PoolHolding]:
        """Every block a slot holds on a pool tier's lanes, as its engine hash (what the pool's key names):
        ``(worker_id, dp_rank, group_idx, engine_hash, block_hash)``, in no particular order. O(the pool members'
        engine hashes)."""
        lanes = [(g, lane) for (g, m), lane in self.state.lanes.items() if m is medium]
        if not lanes:
            return []
        members = self.state.pool_members.get(medium, frozenset())
        id_of = self.state.id_of
        out: list[PoolHolding] = []
        for slot in self.state.slots.values():
            if slot.worker_id not in members or not any(slot.num_held.get((g, medium)) for g, _ in lanes):
                continue
            mask = slot.mask
            for engine_hash, block_hash in slot.engine.items():
                entry_id = id_of.get(block_hash, NULL_ID)
                for g, lane in lanes:
                    if lane[entry_id] & mask:
                        out.append((slot.worker_id, slot.dp_rank, g, engine_hash, block_hash))
        return out

