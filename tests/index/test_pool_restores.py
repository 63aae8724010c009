"""The pool-store journal (``router.index.pool_restores``): a pool member's put of the first block it did not serve,
after the decision, makes the miss a forecast miss (``"evicted"``); any other store leaves it to the other journals."""

from __future__ import annotations

import pytest

from events.types import BlockStored, EngineBlockHash, EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex
from router.index.pool_restores import restored_since

pytestmark = pytest.mark.unit

BS = 4
TOKENS = list(range(100, 100 + 4 * BS))  # 4 blocks
HASHES = hash_token_blocks(TOKENS, BS)
ENGINE = tuple(EngineBlockHash(0xE000 + i) for i in range(4))


def stored(first: int, end: int, medium: Medium, *, with_tokens: bool = True) -> BlockStored:
    """Blocks ``first .. end - 1`` of ``TOKENS`` (their engine hashes ``ENGINE``) stored on ``medium``."""
    return BlockStored(
        block_hashes=ENGINE[first:end],
        parent_block_hash=ENGINE[first - 1] if first else None,
        token_ids=tuple(TOKENS[first * BS : end * BS]) if with_tokens else (),
        block_size=BS,
        medium=medium,
    )


def apply(index: PrefixIndex, worker_id: str, *events: BlockStored) -> None:
    index.apply(EventBatch(worker_id, 0, 0, 1.0, events))


def pooled() -> PrefixIndex:
    """``a`` put the 4 blocks to the pool (``a``, ``b`` members; ``c`` is not one)."""
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
    apply(index, "a", stored(0, 4, Medium.MOONCAKE))
    assert index.match(HASHES).get("b").num_pool_blocks == 4
    return index


def test_the_serving_worker_putting_its_first_missed_block_back_after_the_decision_is_a_forecast_miss():
    index = pooled()
    stamp = index.open_journal_window()  # the decision: b priced the 4 blocks in the pool
    assert index.miss_cause("b", HASHES, 2, 4, stamp) is None  # nothing yet: a wrong index so far
    # b served blocks 0-1 from the pool, computed 2-3 (the master had evicted them) and put them back.
    apply(index, "b", stored(0, 2, Medium.GPU), stored(2, 4, Medium.GPU), stored(2, 4, Medium.MOONCAKE))
    assert index.miss_cause("b", HASHES, 2, 4, stamp) == "evicted"
    assert [restored_since(index.state, "b", h, stamp) for h in HASHES] == [False, False, True, True]
    assert index.state.worker_slots("b")[0].pool_stored == {HASHES[2]: index.journal_seq, HASHES[3]: index.journal_seq}
    # A put before the decision's stamp does not count: a later decision reads nothing.
    later = index.open_journal_window()
    assert index.miss_cause("b", HASHES, 2, 4, later) is None
    index.close_journal_window(stamp)
    index.close_journal_window(later)


def test_a_token_less_pool_store_resolved_through_the_gpu_blocks_is_journaled_too():
    index = pooled()
    apply(index, "b", stored(0, 4, Medium.GPU))
    stamp = index.open_journal_window()
    apply(index, "b", stored(1, 4, Medium.MOONCAKE, with_tokens=False))  # as a kvgate worker announces a put
    assert index.miss_cause("b", HASHES, 1, 4, stamp) == "evicted"
    assert index.miss_cause("b", HASHES, 0, 4, stamp) is None  # its first missed block 0 was not put again
    index.close_journal_window(stamp)


def test_puts_by_another_member_to_other_media_by_a_non_member_or_of_later_blocks_explain_nothing():
    index = pooled()
    stamp = index.open_journal_window()
    apply(index, "a", stored(0, 4, Medium.MOONCAKE))  # another member's put (a copy of what it holds)
    apply(index, "b", stored(0, 4, Medium.CPU))  # the serving worker's own tier, not the pool
    apply(index, "c", stored(0, 4, Medium.MOONCAKE))  # not a member of the pool
    apply(index, "b", stored(0, 3, Medium.GPU), stored(3, 4, Medium.MOONCAKE, with_tokens=False))  # block 3 only
    assert index.miss_cause("b", HASHES, 2, 4, stamp) is None  # its first missed block, 2, was not put by b
    assert index.miss_cause("c", HASHES, 0, 4, stamp) is None
    assert index.miss_cause("b", HASHES, 3, 4, stamp) == "evicted"
    assert [len(index.state.worker_slots(w)[0].pool_stored) for w in ("a", "b", "c")] == [4, 1, 0]
    index.close_journal_window(stamp)
