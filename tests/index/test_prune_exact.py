"""Pruning at the block cap: exactly which blocks go, in which order, the ids they free, and the invariants after.

Eviction order (``router.index.upkeep``): oldest ``log`` record first, leaves only; a parent left as a leaf goes
next when it has no holders, or when it is older than the child (its record came first) and the target is not
reached yet. Pruning deletes whole chains by slice writes, so these cases cover a chain with one holder set, a
chain whose blocks have different holders (and a gap), and a walk stopped by a younger parent or by the target.
"""

from __future__ import annotations

import pytest

from events.types import BlockRemoved, BlockStored, EventBatch
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex

pytestmark = pytest.mark.unit

BS = 4
TOKENS = tuple(range(100, 124))  # chain A: 6 blocks of 4
HASHES = hash_token_blocks(list(TOKENS), BS)
OTHER = tuple(range(500, 516))  # chain B (3 blocks) and chain C (1 block)
B_HASHES = hash_token_blocks(list(OTHER[:12]), BS)
C_HASHES = hash_token_blocks(list(OTHER[12:]), BS)


def stored(first: int, last: int) -> BlockStored:
    """Blocks ``first..last-1`` of chain A, engine hashes 1000 + i."""
    return BlockStored(
        block_hashes=tuple(1000 + i for i in range(first, last)),
        parent_block_hash=(1000 + first - 1) if first else None,
        token_ids=TOKENS[first * BS : last * BS],
        block_size=BS,
    )


def batch(worker: str, event: BlockStored | BlockRemoved) -> EventBatch:
    return EventBatch(worker, 0, 0, 0.0, (event,))


def depths(index: PrefixIndex, hashes) -> dict[str, int]:
    return {w: m.num_gpu_blocks for w, m in index.match(hashes).workers.items()}


def ids(index: PrefixIndex, hashes) -> list[int | None]:
    return [index.state.id_of.get(h) for h in hashes]


def store_b_and_c(index: PrefixIndex) -> None:
    index.apply(batch("w2", BlockStored((50, 51, 52), None, OTHER[:12], BS)))
    index.apply(batch("w3", BlockStored((60,), None, OTHER[12:], BS)))


def test_a_chain_with_mixed_holders_and_a_gap_goes_whole_leaf_first():
    index = PrefixIndex(IndexConfig(block_size=BS, max_blocks=9, prune_target_ratio=0.5))  # prune to 4
    index.apply(batch("w1", stored(0, 3)))  # ids 1..3
    index.apply(batch("w0", stored(0, 6)))  # ids 4..6 new; 1..3 held by w0 and w1
    index.apply(batch("w0", BlockRemoved((1001,))))  # w0 drops block 1: a gap at block 2 (w1 still holds 1)
    assert ids(index, HASHES) == [1, 2, 3, 4, 5, 6]
    assert index.state.slots[("w0", 0)].num_gaps == 1
    store_b_and_c(index)  # ids 7..9, then 10: 10 entries > 9
    assert index.stats().counters["num_pruned_blocks"] == 6
    # Chain A is the oldest: its records come first, its leaf (block 5) goes and the walk takes every parent.
    assert ids(index, HASHES) == [None] * 6
    assert ids(index, B_HASHES) == [7, 8, 9] and ids(index, C_HASHES) == [10]
    assert index.num_blocks() == 4 and index.state.free_ids == [6, 5, 4, 3, 2, 1]
    assert index.state.slots[("w0", 0)].num_gaps == 0 and index.state.dirty_mask == 0
    assert index.stats().num_blocks_by_worker == {
        "w0": {"GPU": 0}, "w1": {"GPU": 0}, "w2": {"GPU": 3}, "w3": {"GPU": 1}
    }
    index.check_invariants()
    # Freed leaf first, the ids are reused as one ascending run.
    index.apply(batch("w4", stored(0, 2)))
    assert ids(index, HASHES[:2]) == [1, 2] and index.state.free_ids == [6, 5, 4, 3]
    assert depths(index, HASHES) == {"w4": 2}
    index.check_invariants()


def test_a_younger_parent_stops_the_walk_until_its_own_record():
    index = PrefixIndex(IndexConfig(block_size=BS, max_blocks=9, prune_target_ratio=0.5))  # prune to 4
    index.apply(batch("w0", stored(0, 6)))  # ids 1..6
    index.apply(batch("w1", stored(0, 2)))  # blocks 0..1 stored again: block 1 (id 2) becomes the most recent
    store_b_and_c(index)
    # Leaf 5 goes with 4, 3, 2 (older parents), then the walk stops at block 1 (id 2, younger than its child); its
    # own record, after chain A's, makes it a leaf to evict, then block 0: 6 blocks, freed in that order.
    assert index.stats().counters["num_pruned_blocks"] == 6
    assert index.state.free_ids == [6, 5, 4, 3, 2, 1]
    assert depths(index, HASHES) == {}
    assert depths(index, B_HASHES) == {"w2": 3} and depths(index, C_HASHES) == {"w3": 1}
    index.check_invariants()


def test_the_target_stops_the_walk_inside_a_chain():
    index = PrefixIndex(IndexConfig(block_size=BS, max_blocks=9, prune_target_ratio=0.8))  # prune to 7
    index.apply(batch("w0", stored(0, 6)))
    index.apply(batch("w1", stored(0, 2)))
    store_b_and_c(index)
    # 3 blocks over the target: leaf 5, then 4 and 3; block 2 stays (the target is reached) as the new leaf.
    assert index.stats().counters["num_pruned_blocks"] == 3
    assert ids(index, HASHES) == [1, 2, 3, None, None, None] and index.state.free_ids == [6, 5, 4]
    assert depths(index, HASHES) == {"w0": 3, "w1": 2}
    assert index.num_blocks() == 7
    index.check_invariants()
    # The next pass starts from the oldest record again: block 2 (id 3) is now chain A's oldest leaf.
    index.apply(batch("w5", BlockStored((70, 71, 72), None, tuple(range(700, 712)), BS)))  # 10 > 9: prune to 7
    assert index.stats().counters["num_pruned_blocks"] == 6
    assert ids(index, HASHES) == [None, None, None, None, None, None]
    assert ids(index, hash_token_blocks(list(range(700, 712)), BS)) == [4, 5, 6]  # the ids the first pass freed
    assert index.state.free_ids == [3, 2, 1]
    assert depths(index, B_HASHES) == {"w2": 3}
    index.check_invariants()
