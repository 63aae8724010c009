"""The honesty check's causes: the index's journal of GPU evictions, and ``IndexTicket.mismatch_cause`` over it."""

from __future__ import annotations

import pytest

from events.types import BlockRemoved, BlockStored, EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.config import CircuitBreakerConfig, ModelConfig
from router.fleet import WorkerRuntime
from router.index import IndexConfig, PrefixIndex
from router.request_view import PromptView
from router.routing import IndexTicket
from router.worker_config import WorkerConfig

pytestmark = pytest.mark.unit

BS = 4
TOKENS = tuple(range(100, 124))  # 6 blocks of 4
HASHES = hash_token_blocks(list(TOKENS), BS)


def stored(first: int, last: int) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(1000 + i for i in range(first, last)),
        parent_block_hash=(1000 + first - 1) if first else None,
        token_ids=TOKENS[first * BS: last * BS],
        block_size=BS,
    )


def batch(worker: str, *events: object) -> EventBatch:
    return EventBatch(worker, 0, 0, 0.0, tuple(events))  # type: ignore[arg-type]


def ticket(index: PrefixIndex) -> IndexTicket:
    view = PromptView(num_tokens=len(TOKENS), block_hashes=tuple(HASHES), block_size=BS)
    return IndexTicket(index, ModelConfig(name="m", block_size=BS), view, {})


def test_eviction_journal_stamps_gpu_removals_after_a_given_sequence():
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch("w0", stored(0, 6)))
    seq = index.journal_seq
    assert seq == 0
    index.apply(batch("w0", BlockRemoved(block_hashes=(1004, 1005))))
    assert index.journal_seq == 2
    assert index.evicted_since("w0", HASHES[4], seq) and index.evicted_since("w0", HASHES[5], seq)
    assert not index.evicted_since("w0", HASHES[3], seq)
    assert not index.evicted_since("w1", HASHES[4], seq)
    assert not index.evicted_since("w0", HASHES[4], 2)  # nothing since stamp 2
    # The same question for a run of blocks, as a mismatch's cause asks it: any of them evicted since the stamp.
    assert index.any_evicted_since("w0", HASHES[2:5], seq) and index.any_evicted_since("w0", HASHES[5:], seq)
    assert not index.any_evicted_since("w0", HASHES[:4], seq)
    assert not index.any_evicted_since("w1", HASHES, seq)
    assert not index.any_evicted_since("w0", HASHES, 2)
    assert not index.any_evicted_since("w0", (), seq)
    # The mismatch's one question: evicted in a range of positions (no slice made), else the first confirmed.
    assert index.miss_cause("w0", HASHES, 2, 5, seq) == "evicted" and index.miss_cause("w0", HASHES, 5, 6, seq)
    assert index.miss_cause("w0", HASHES, 0, 4, seq) is None and index.miss_cause("w0", HASHES, 4, 4, seq) is None
    assert index.miss_cause("w1", HASHES, 0, 6, seq) is None and index.miss_cause("w0", HASHES, 0, 6, 2) is None


def test_cpu_removals_are_not_gpu_evictions():
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch("w0", stored(0, 6), BlockStored(block_hashes=(1005,), parent_block_hash=1004,
                                                      token_ids=TOKENS[20:24], block_size=BS, medium=Medium.CPU)))
    index.apply(batch("w0", BlockRemoved(block_hashes=(1005,), medium=Medium.CPU)))
    assert index.journal_seq == 0


def test_mismatch_causes():
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch("w0", stored(0, 6)))
    t = ticket(index)
    assert t.match() is not None  # stamps the ticket with journal_seq 0
    # The worker reports 12 cached tokens where 20 were predicted: blocks 3 and 4 were not served from cache.
    assert t.mismatch_cause("w0", 20, 12) == "index"  # no eviction reported: the index was wrong
    index.apply(batch("w0", BlockRemoved(block_hashes=(1005,))))
    assert t.mismatch_cause("w0", 20, 12) == "index"  # block 5 is past the predicted 20 tokens
    index.apply(batch("w0", BlockRemoved(block_hashes=(1004,))))
    assert t.mismatch_cause("w0", 20, 12) == "evicted"  # block 4 (tokens 16..19) was evicted after the decision
    assert t.mismatch_cause("w0", 12, 20) == "late"  # the worker held more than the index knew
    later = ticket(index)
    later.match()
    assert later.mismatch_cause("w0", 20, 12) == "index"  # that eviction came before this decision


def test_a_block_pending_at_the_decision_and_stored_after_it_is_a_pending_miss():
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch("w0", stored(0, 2)))
    index.insert_approximate("w0", HASHES[:6], 0.0, ttl_s=60.0)  # an earlier request routed there: 2..5 pending
    assert index.match(HASHES).workers["w0"].num_gpu_blocks == 6
    t = ticket(index)
    t.match()
    index.apply(batch("w0", stored(2, 6)))  # that request's blocks, stored after this one was admitted
    assert index.journal_seq == 4  # four pending entries confirmed
    assert t.mismatch_cause("w0", 20, 8) == "pending"  # blocks 2..4 were computed by the request in flight
    assert t.mismatch_cause("w0", 4, 8) == "late"
    later = ticket(index)
    later.match()
    assert later.mismatch_cause("w0", 20, 8) == "index"  # confirmed before this decision: the index was right


def test_a_confirm_of_the_requests_own_pending_entry_is_no_pending_miss():
    """The decision credited w0 with blocks 0..1 on GPU and 2..5 on its CPU tier; the request's own pending entries
    (``insert_for``) cover all six. The worker lost 2..5 without a word, recomputed and stored them: the confirms are
    of the request's own entries, so the miss is the index's. The same store of blocks that were another request's
    pending entries at the decision stays a pending miss."""
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch("w0", stored(0, 2), BlockStored(block_hashes=(1002, 1003, 1004, 1005), parent_block_hash=1001,
                                                      token_ids=TOKENS[8:24], block_size=BS, medium=Medium.CPU)))
    worker = WorkerRuntime(WorkerConfig(id="w0", url="http://127.0.0.1:9000", model="m",
                                        events_endpoint="tcp://127.0.0.1:5557"), BS, CircuitBreakerConfig())
    assert not worker.is_approximate
    t = ticket(index)
    match = t.match()
    assert match is not None and (match.workers["w0"].num_gpu_blocks, match.workers["w0"].num_cpu_blocks) == (2, 4)
    t.insert_for(worker, match, 0.0)
    assert t.pending is not None and index.match(HASHES).workers["w0"].num_gpu_blocks == 6
    index.apply(batch("w0", stored(2, 6)))  # the request's own blocks, recomputed
    assert index.journal_seq == 4  # its four pending entries confirmed
    assert t.mismatch_cause("w0", 24, 8) == "index"
    # Another request's pending entries at the decision: the same confirms explain the miss.
    other = PrefixIndex(IndexConfig(block_size=BS))
    other.apply(batch("w0", stored(0, 2)))
    other.insert_approximate("w0", HASHES[:6], 0.0, ttl_s=60.0)
    u = ticket(other)
    u_match = u.match()
    assert u_match is not None and u_match.workers["w0"].num_gpu_blocks == 6
    u.insert_for(worker, u_match, 0.0)
    other.apply(batch("w0", stored(2, 6)))
    assert u.mismatch_cause("w0", 24, 8) == "pending"


def test_a_pool_block_lost_after_the_decision_is_an_evicted_miss_for_every_pool_member():
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["w0", "w1"]})
    pooled = stored(0, 6)
    index.apply(batch("w0", BlockStored(block_hashes=pooled.block_hashes, parent_block_hash=None,
                                        token_ids=pooled.token_ids, block_size=BS, medium=Medium.MOONCAKE)))
    index.apply(batch("w2", stored(0, 2)))  # w2 is no pool member
    t = ticket(index)
    match = t.match()
    assert match is not None and match.workers["w1"].num_pool_blocks == 6
    assert t.mismatch_cause("w1", 24, 12) == "index"  # nothing lost: the index was wrong
    # The pool watcher finds block 5 gone (past the 20 predicted tokens), then block 4, as w0's removals.
    index.apply(batch("w0", BlockRemoved(block_hashes=(1005,), medium=Medium.MOONCAKE)))
    assert index.journal_seq == 2  # w0's put, then the loss
    assert t.mismatch_cause("w1", 20, 12) == "index"
    assert t.mismatch_cause("w1", 24, 12) == "evicted"
    index.apply(batch("w0", BlockRemoved(block_hashes=(1004,), medium=Medium.MOONCAKE)))
    assert index.journal_seq == 3
    assert t.mismatch_cause("w1", 20, 12) == "evicted" and t.mismatch_cause("w0", 20, 12) == "evicted"
    assert t.mismatch_cause("w2", 20, 12) == "index"  # w2 reaches no pool
    later = ticket(index)
    assert later.match() is not None  # a decision after the losses: they are no excuse
    assert later.mismatch_cause("w1", 20, 12) == "index"


def test_a_pool_clear_after_the_decision_is_an_evicted_miss_for_every_pool_member():
    # The pool watcher clears the pool's entries when the master restarts or stays unconfirmed past its TTL.
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["w0", "w1"]})
    pooled = stored(0, 6)
    index.apply(batch("w0", BlockStored(block_hashes=pooled.block_hashes, parent_block_hash=None,
                                        token_ids=pooled.token_ids, block_size=BS, medium=Medium.MOONCAKE)))
    index.apply(batch("w1", stored(0, 2)))  # w1's own GPU blocks stay through the pool's clear
    t = ticket(index)
    match = t.match()
    assert match is not None and match.workers["w1"].num_pool_blocks == 4  # blocks 2..5 from the pool
    assert t.mismatch_cause("w1", 24, 8) == "index"
    index.clear_worker("w0", Medium.MOONCAKE)
    assert index.journal_seq == 2  # w0's put, then the clear
    after = ticket(index).match()
    assert after is not None and after.workers["w1"].num_pool_blocks == 0 and "w0" not in after.workers
    assert t.mismatch_cause("w1", 24, 8) == "evicted" and t.mismatch_cause("w0", 24, 0) == "evicted"
    index.clear_worker("w1", Medium.MOONCAKE)  # nothing of w1's on the pool: nothing journaled
    assert index.journal_seq == 2
    later = ticket(index)
    assert later.match() is not None
    assert later.mismatch_cause("w1", 24, 8) == "index"  # a decision after the clear: it is no excuse


def test_a_member_reporting_a_pool_block_gone_that_another_member_stored_drops_it_as_the_holders():
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["w0", "w1"]})
    pooled = stored(0, 6)
    index.apply(batch("w0", BlockStored(block_hashes=pooled.block_hashes, parent_block_hash=None,
                                        token_ids=pooled.token_ids, block_size=BS, medium=Medium.MOONCAKE)))
    index.apply(batch("w2", stored(0, 2)))
    t = ticket(index)
    assert t.match() is not None
    # w2 is no member: its report of a pool block it never held is unknown and changes nothing.
    index.apply(batch("w2", BlockRemoved(block_hashes=(1004,), medium=Medium.MOONCAKE)))
    assert index.stats().counters["num_unknown_removals"] == 1 and index.journal_seq == 1  # w0's put
    # w1's read found block 4 gone (it lost it between w1's lookup and its read): w0's pool entry is dropped.
    index.apply(batch("w1", BlockRemoved(block_hashes=(1004,), medium=Medium.MOONCAKE)))
    assert index.stats().counters["num_unknown_removals"] == 1 and index.journal_seq == 2
    assert t.mismatch_cause("w1", 20, 16) == "evicted"
    after = index.match(HASHES)
    assert after.workers["w1"].num_pool_blocks == 4 and after.workers["w0"].num_pool_blocks == 4
