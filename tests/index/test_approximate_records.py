"""Approximate mode by records (``router.index.approximate``): a following turn adds only its new blocks and
refreshes its prefix through the record tree; shared prefixes split; withdrawal restores; expiry in slices."""

from __future__ import annotations

import pytest

from events.types import BlockStored, EventBatch
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex
from router.index.approximate import REQUEST_PATH_EXPIRY_BLOCKS

pytestmark = pytest.mark.unit

BS = 2


def chain(*parts: range) -> tuple[int, ...]:
    """Block hashes of the concatenated token ranges (each a whole number of blocks)."""
    tokens = [t for part in parts for t in part]
    return tuple(hash_token_blocks(tokens, BS))


def gpu_depth(index: PrefixIndex, hashes: tuple[int, ...], worker: str = "a") -> int:
    m = index.match(hashes).workers.get(worker)
    return m.num_gpu_blocks if m is not None else 0


def test_following_turn_adds_only_its_new_blocks_and_refreshes_the_whole_prefix() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    turn0 = chain(range(0, 8))  # 4 blocks
    turn1 = chain(range(0, 12))  # the same 4, then 2 more
    index.insert_approximate("a", turn0, now_s=0.0)
    inserted = index.insert_approximate("a", turn1, now_s=8.0)
    assert inserted is not None and (inserted.start, inserted.end) == (4, 6)
    assert inserted.record is not None and inserted.record.start == 0  # one record: extended in place
    assert index.stats().counters["num_approx_blocks_inserted"] == 6
    assert index.stats().num_approx_blocks == 6
    assert index.expire(10.0) == 0  # turn 0's blocks were refreshed to 18 by turn 1
    assert gpu_depth(index, turn1) == 6
    assert index.expire(18.0) == 6
    assert gpu_depth(index, turn1) == 0 and index.num_blocks() == 0
    index.check_invariants()


def test_a_prefix_confirmed_by_events_gets_a_record_for_the_new_blocks_only() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    tokens = tuple(range(0, 8))
    index.apply(EventBatch("a", 0, 0, 0.0, (BlockStored((1, 2, 3, 4), None, tokens, BS),)))
    inserted = index.insert_approximate("a", chain(range(0, 12)), now_s=0.0)
    assert inserted is not None and (inserted.start, inserted.end) == (4, 6)
    assert inserted.record is not None and inserted.record.up is None
    assert index.stats().num_approx_blocks == 2
    assert index.expire(10.0) == 2
    assert gpu_depth(index, chain(range(0, 12))) == 4  # the stored blocks stay
    index.check_invariants()


def test_a_shared_prefix_lives_while_either_conversation_does() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    a = chain(range(0, 4), range(100, 108))  # system prompt (2 blocks), then A's 4
    b = chain(range(0, 4), range(200, 204))  # the same system prompt, then B's 2
    index.insert_approximate("a", a, now_s=0.0)
    inserted = index.insert_approximate("a", b, now_s=5.0)
    assert inserted is not None and inserted.record is not None
    shared = inserted.record.up
    assert shared is not None and shared.hashes == a[:2] and shared.expiry_s == 15.0  # split off A's record
    assert index.expire(10.0) == 4  # A's own blocks go at A's expiry; the shared prefix was refreshed by B
    assert gpu_depth(index, a) == 2 and gpu_depth(index, b) == 4
    assert index.expire(15.0) == 4
    assert index.num_blocks() == 0
    index.check_invariants()


def test_a_shorter_prompt_refreshes_only_its_own_blocks() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    long = chain(range(0, 12))
    index.insert_approximate("a", long, now_s=0.0)
    assert index.insert_approximate("a", long[:2], now_s=5.0) is not None  # held already: a refresh
    assert index.expire(10.0) == 4  # blocks 2..5 at their own expiry, leaf first
    assert gpu_depth(index, long) == 2
    assert index.expire(15.0) == 2
    index.check_invariants()


def test_withdrawing_an_extension_drops_its_blocks_and_restores_the_expiry() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    index.insert_approximate("a", chain(range(0, 8)), now_s=0.0)
    inserted = index.insert_approximate("a", chain(range(0, 12)), now_s=5.0)
    assert inserted is not None
    assert index.withdraw_approximate(inserted) == 2
    assert index.withdraw_approximate(inserted) == 0
    assert gpu_depth(index, chain(range(0, 12))) == 4
    assert index.expire(10.0) == 4  # the expiry of before the withdrawn request
    assert index.stats().num_approx_blocks == 0
    index.check_invariants()


def test_withdrawal_after_a_later_refresh_keeps_the_blocks() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    first = index.insert_approximate("a", chain(range(0, 8)), now_s=0.0)
    index.insert_approximate("a", chain(range(0, 12)), now_s=5.0)  # another request still pending
    assert first is not None and index.withdraw_approximate(first) == 0
    assert gpu_depth(index, chain(range(0, 12))) == 6


def test_expiry_in_slices_drops_leaf_first_and_resumes() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    hashes = chain(range(0, 2 * 5000))
    index.insert_approximate("a", hashes, now_s=0.0)
    assert index.expire(10.0, max_blocks=1200) == 1200
    assert gpu_depth(index, hashes) == 3800 and index.has_expired(10.0)
    index.check_invariants()
    # Inserted again at its expiry: the insertion drops one more slice (REQUEST_PATH_EXPIRY_BLOCKS, 256) first,
    # then the record is extended in place over what went.
    again = index.insert_approximate("a", hashes, now_s=10.0)
    assert again is not None and (again.start, again.end) == (3800 - 256, 5000) and again.record is not None
    assert again.record.start == 0 and again.record.up is None
    assert index.expire(10.0) == 0
    assert gpu_depth(index, hashes) == 5000
    while index.has_expired(30.0):
        index.expire(30.0, max_blocks=1200)
    assert index.num_blocks() == 0 and index.stats().num_approx_blocks == 0
    index.check_invariants()


def test_an_insertion_drops_a_bounded_slice_of_expired_blocks_first() -> None:
    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    index.insert_approximate("a", chain(range(0, 2 * 3000)), now_s=0.0)
    index.insert_approximate("b", chain(range(9000, 9004)), now_s=20.0)
    assert REQUEST_PATH_EXPIRY_BLOCKS == 256
    assert index.stats().num_approx_blocks == 3000 - 256 + 2  # REQUEST_PATH_EXPIRY_BLOCKS went
    assert index.has_expired(20.0)


def test_clearing_or_removing_a_worker_takes_its_records_out_of_the_expiry_queue() -> None:
    """A record holds its chain's hashes and its slot: one left queued after its worker's GPU blocks were cleared,
    or the worker removed, kept them (and a removed slot's engine map and journals) alive until its expiry."""
    import sys

    index = PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=10.0))
    index.insert_approximate("a", chain(range(0, 8)), now_s=0.0)
    index.insert_approximate("a", chain(range(50, 56)), now_s=0.0)
    index.insert_approximate("b", chain(range(0, 8)), now_s=1.0)
    index.insert_approximate("c", chain(range(20, 24)), now_s=2.0)
    queue = index.state.approx_queue
    assert sorted(item[2].slot.worker_id for item in queue) == ["a", "a", "b", "c"]

    index.clear_worker("a")
    assert sorted(item[2].slot.worker_id for item in queue) == ["b", "c"]
    assert index.stats().num_approx_blocks == 6 and gpu_depth(index, chain(range(0, 8))) == 0
    assert gpu_depth(index, chain(range(0, 8)), "b") == 4
    index.insert_approximate("a", chain(range(0, 4)), now_s=3.0)  # the cleared slot takes new blocks again
    assert sorted(item[2].slot.worker_id for item in queue) == ["a", "b", "c"]

    slot_b = index.state.worker_slots("b")[0]
    index.remove_worker("b")
    assert sys.getrefcount(slot_b) == 2  # this name and the call's argument: nothing in the index holds it
    assert sorted((item[0], item[2].slot.worker_id) for item in queue) == [(12.0, "c"), (13.0, "a")]
    assert queue[0][0] == 12.0  # still a heap by expiry
    assert index.stats().num_approx_blocks == 4
    assert index.expire(12.0) == 2 and index.expire(13.0) == 2 and index.num_blocks() == 0
    index.check_invariants()
