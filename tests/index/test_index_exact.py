"""Exact-value scenarios of the prefix index (one behaviour per test)."""

from __future__ import annotations

import msgspec
import pytest

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Medium, Resync
from router.block_hash import hash_token_blocks, make_namespace
from router.index import (
    GroupKind,
    GroupSpec,
    IndexConfig,
    IndexConfigError,
    PrefixIndex,
    UnknownWorkerError,
    WorkerMatch,
)

pytestmark = pytest.mark.unit

BS = 4
TOKENS = tuple(range(100, 124))  # 6 blocks of 4
HASHES = hash_token_blocks(list(TOKENS), BS)


def make_index(**kwargs) -> PrefixIndex:
    return PrefixIndex(IndexConfig(block_size=BS, **kwargs))


def stored(first: int, last: int, *, parent: int | None = None, **kwargs) -> BlockStored:
    """Blocks ``first..last-1`` of TOKENS with engine hashes 1000 + i."""
    return BlockStored(
        block_hashes=tuple(1000 + i for i in range(first, last)),
        parent_block_hash=(1000 + first - 1) if first else parent,
        token_ids=TOKENS[first * BS : last * BS],
        block_size=BS,
        **kwargs,
    )


def batch(worker: str, *events, dp_rank: int = 0, seq: int = 0) -> EventBatch:
    return EventBatch(worker, dp_rank, seq, 0.0, tuple(events))


def depths(index: PrefixIndex, hashes=HASHES) -> dict[str, tuple[int, int, int]]:
    result = index.match(hashes)
    return {w: (m.num_gpu_blocks, m.num_cpu_blocks, m.num_pool_blocks) for w, m in result.workers.items()}


def test_store_and_match_exact():
    index = make_index()
    index.apply(batch("w0", stored(0, 6)))
    index.apply(batch("w1", stored(0, 2)))
    result = index.match(HASHES)
    assert result.workers == {
        "w0": WorkerMatch("w0", 0, 6, 0, 0),
        "w1": WorkerMatch("w1", 0, 2, 0, 0),
    }
    assert result.num_blocks == 6
    assert index.num_blocks() == 6
    assert depths(index, HASHES[:3]) == {"w0": (3, 0, 0), "w1": (2, 0, 0)}
    assert depths(index, hash_token_blocks([1, 2, 3, 4], BS)) == {}


def test_remove_one_of_two_copies():
    index = make_index()
    index.apply(batch("w0", stored(0, 3), stored(0, 3)))
    index.apply(batch("w0", BlockRemoved((1002,))))
    assert depths(index) == {"w0": (3, 0, 0)}
    assert index.stats().counters["num_extra_copies_stored"] == 3
    index.apply(batch("w0", BlockRemoved((1002,))))
    assert depths(index) == {"w0": (2, 0, 0)}
    index.apply(batch("w0", BlockRemoved((1002,))))
    assert index.stats().counters["num_unknown_removals"] == 1


def test_unknown_removal_counted_rest_of_batch_applies():
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w0", BlockRemoved((999_999, 1002)), BlockRemoved((424242,))))
    assert depths(index) == {"w0": (2, 0, 0)}
    assert index.stats().counters["num_unknown_removals"] == 2


def test_clear_one_worker_leaves_others_intact():
    index = make_index()
    index.apply(batch("w0", stored(0, 6)))
    index.apply(batch("w1", stored(0, 4)))
    index.apply(batch("w0", AllBlocksCleared()))
    assert depths(index) == {"w1": (4, 0, 0)}
    assert index.num_blocks() == 4  # w0-only blocks 4 and 5 are gone from the index
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 0}, "w1": {"GPU": 4}}
    index.apply(batch("w0", BlockRemoved((1000,))))
    assert index.stats().counters["num_unknown_removals"] == 1


def test_clear_one_tier():
    index = make_index()
    offload = BlockStored((1000, 1001, 1002, 1003), None, (), BS, medium=Medium.CPU)
    index.apply(batch("w0", stored(0, 4), offload, BlockRemoved((1002,)), BlockRemoved((1003,))))
    assert depths(index) == {"w0": (2, 2, 0)}
    index.apply(batch("w0", AllBlocksCleared(Medium.CPU)))
    assert depths(index) == {"w0": (2, 0, 0)}
    index.clear_worker("w0", Medium.GPU)
    assert depths(index) == {}
    assert index.num_blocks() == 0


def test_offload_store_without_tokens_resolved_by_engine_hash():
    index = make_index()
    index.apply(batch("w0", stored(0, 4)))
    offload = BlockStored((1002, 1003, 777), None, (), BS, medium=Medium.CPU)
    index.apply(batch("w0", offload, BlockRemoved((1002,)), BlockRemoved((1003,))))
    assert depths(index) == {"w0": (2, 2, 0)}
    assert index.stats().counters["num_unresolved_offload_blocks"] == 1
    # A CPU removal of 1002 now makes the prefix stop at block 2 on every tier.
    index.apply(batch("w0", BlockRemoved((1002,), medium=Medium.CPU)))
    assert depths(index) == {"w0": (2, 0, 0)}


def test_offload_block_covering_two_index_blocks():
    index = make_index()
    index.apply(batch("w0", stored(0, 4)))
    # Offloaded blocks of 8 tokens: one hash per pair, the hash of the pair's last GPU block.
    index.apply(batch("w0", BlockStored((1001, 1003), None, (), 2 * BS, medium=Medium.CPU)))
    index.apply(batch("w0", *(BlockRemoved((1000 + i,)) for i in range(4))))
    assert depths(index) == {"w0": (0, 4, 0)}
    index.apply(batch("w0", BlockRemoved((1003,), medium=Medium.CPU)))
    assert depths(index) == {"w0": (0, 2, 0)}


def test_large_engine_block_split_into_index_blocks():
    index = make_index()
    event = BlockStored((5001, 5002, 5003), None, TOKENS, 2 * BS)
    index.apply(batch("w0", event))
    assert depths(index) == {"w0": (6, 0, 0)}
    index.apply(batch("w0", BlockRemoved((5003,))))
    assert depths(index) == {"w0": (4, 0, 0)}
    index.apply(batch("w0", BlockStored((6001,), None, TOKENS[:3], 3)))
    assert index.stats().counters["num_block_size_mismatch_blocks"] == 1


def test_child_before_parent_is_parked_then_attached():
    index = make_index()
    index.apply(batch("w0", stored(2, 4)))  # parent 1001 unknown yet
    assert depths(index) == {}
    assert index.num_blocks() == 0
    assert index.stats().counters["num_orphan_blocks"] == 2
    assert index.stats().counters["num_parked_events"] == 1
    index.apply(batch("w0", stored(0, 2)))
    assert depths(index) == {"w0": (4, 0, 0)}
    assert index.stats().counters["num_parked_blocks_applied"] == 2


def test_parked_children_attach_in_a_cascade():
    index = make_index()
    index.apply(batch("w0", stored(4, 6), stored(2, 4)))  # 4..5 wait for 1003, 2..3 for 1001
    assert index.stats().counters["num_parked_events"] == 2
    index.apply(batch("w0", stored(0, 2)))  # maps 1001: releases 2..3, which maps 1003: releases 4..5
    assert depths(index) == {"w0": (6, 0, 0)}
    assert index.stats().counters["num_parked_blocks_applied"] == 4
    assert index.stats().counters["num_parked_events"] == 0
    index.check_invariants()


def test_orphan_never_attaches_to_another_workers_or_ranks_parent():
    index = make_index()
    index.apply(batch("w1", stored(0, 2)))
    index.apply(batch("w0", stored(0, 2), dp_rank=1))
    index.apply(batch("w0", stored(2, 4)))  # rank 0 never stored 1001
    assert depths(index) == {"w1": (2, 0, 0), "w0": (2, 0, 0)}
    assert index.match(HASHES).workers["w0"].dp_rank == 1
    index.apply(batch("w0", AllBlocksCleared()))  # drops the parked child of rank 0
    index.apply(batch("w0", stored(0, 2)))
    assert depths(index) == {"w1": (2, 0, 0), "w0": (2, 0, 0)}


def test_parked_events_are_bounded():
    index = make_index(max_parked_events_per_worker=1)
    index.apply(batch("w0", stored(2, 3), stored(4, 5)))
    counters = index.stats().counters
    assert counters["num_parked_blocks_dropped"] == 1
    assert counters["num_parked_events"] == 1


def test_namespace_isolation_lora_and_salt():
    index = make_index()
    index.apply(batch("lora", stored(0, 3, lora_name="adapter-a")))
    index.apply(batch("salted", stored(0, 3, extra_keys=(("tenant-1",), None, None))))
    index.apply(batch("lora-salted", stored(0, 3, lora_name="a", extra_keys=(("a", "t"), ("a",), ("a",)))))
    assert depths(index) == {}
    tokens = list(TOKENS)
    assert depths(index, hash_token_blocks(tokens, BS, make_namespace("adapter-a", None))) == {"lora": (3, 0, 0)}
    assert depths(index, hash_token_blocks(tokens, BS, make_namespace(None, "tenant-1"))) == {"salted": (3, 0, 0)}
    assert depths(index, hash_token_blocks(tokens, BS, make_namespace("a", "t"))) == {"lora-salted": (3, 0, 0)}
    assert depths(index, hash_token_blocks(tokens, BS, make_namespace(None, "tenant-2"))) == {}


def test_multimodal_extra_keys_stop_the_chain():
    index = make_index()
    index.apply(batch("w0", stored(0, 3, extra_keys=(None, (("img", 0),), None))))
    assert depths(index) == {"w0": (1, 0, 0)}
    assert index.stats().counters["num_unsupported_extra_key_blocks"] == 2


def test_pool_reachable_by_members_only():
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["w0", "w1"]})
    index.apply(batch("w0", stored(0, 4), BlockStored((1000, 1001, 1002, 1003), None, (), BS, medium=Medium.MOONCAKE)))
    index.apply(batch("w1", stored(0, 1)))
    index.apply(batch("w2", stored(0, 2)))
    assert depths(index) == {"w0": (4, 0, 0), "w1": (1, 0, 3), "w2": (2, 0, 0)}
    index.apply(batch("w0", AllBlocksCleared()))  # the pool is not w0's own: it stays
    assert depths(index) == {"w0": (0, 0, 4), "w1": (1, 0, 3), "w2": (2, 0, 0)}
    index.set_pool_members(Medium.MOONCAKE, ["w0", "w2"])
    assert depths(index) == {"w0": (0, 0, 4), "w1": (1, 0, 0), "w2": (2, 0, 2)}
    with pytest.raises(IndexConfigError):
        index.set_pool_members(Medium.CPU, ["w0"])


def test_resync_clears_all_ranks_of_the_worker():
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w0", stored(0, 5), dp_rank=1))
    index.apply(batch("w1", stored(0, 1)))
    assert index.match(HASHES).workers["w0"] == WorkerMatch("w0", 1, 5)
    index.apply_resync(Resync("w0", "seq_backwards"))
    assert depths(index) == {"w1": (1, 0, 0)}
    assert index.num_blocks() == 1


def test_resync_of_one_rank_keeps_the_other_ranks():
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w0", stored(0, 5), dp_rank=1))
    assert index.match(HASHES).workers["w0"] == WorkerMatch("w0", 1, 5)
    index.apply_resync(Resync("w0", "gap_unrecoverable", dp_rank=1))  # rank 1's stream broke: rank 0 keeps its 3
    assert index.match(HASHES).workers["w0"] == WorkerMatch("w0", 0, 3)
    assert index.num_blocks() == 3
    index.apply_resync(Resync("w0", "gap_unrecoverable", dp_rank=0))
    assert depths(index) == {}
    assert index.num_blocks() == 0


def test_remove_worker_and_clear_all():
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w1", stored(0, 2)))
    index.remove_worker("w0")
    assert depths(index) == {"w1": (2, 0, 0)}
    assert "w0" not in index.stats().num_blocks_by_worker
    with pytest.raises(UnknownWorkerError):
        index.dump_worker("w0")
    index.apply(batch("w2", stored(0, 4)))  # reuses w0's bit
    assert depths(index) == {"w1": (2, 0, 0), "w2": (4, 0, 0)}
    index.clear()
    assert depths(index) == {}
    assert index.num_blocks() == 0


def test_approximate_mode_ttl_refresh_and_confirmation():
    index = make_index(approx_ttl_s=10.0)
    index.insert_approximate("a", HASHES[:4], now_s=100.0)
    assert depths(index) == {"a": (4, 0, 0)}
    assert index.stats().num_approx_blocks == 4
    index.insert_approximate("a", HASHES[:2], now_s=105.0)  # refreshes blocks 0 and 1
    index.apply(batch("a", stored(0, 3)))  # events confirm blocks 0..2: they stop expiring
    assert index.stats().num_approx_blocks == 1
    assert index.expire(110.0) == 1  # block 3 (inserted at 100) expires
    assert depths(index) == {"a": (3, 0, 0)}
    assert index.expire(1000.0) == 0
    assert depths(index) == {"a": (3, 0, 0)}
    index.apply(batch("a", BlockRemoved((1002,))))
    assert depths(index) == {"a": (2, 0, 0)}


def test_approximate_cap_evicts_oldest():
    index = make_index(approx_max_blocks=4, prune_target_ratio=0.5)
    index.insert_approximate("a", HASHES[:3], now_s=0.0)
    index.insert_approximate("b", HASHES[:2], now_s=1.0)
    # 5 > 4: the oldest decision (a's) goes, leaving b's 2 blocks (= 4 * 0.5).
    assert depths(index) == {"b": (2, 0, 0)}
    assert index.stats().num_approx_blocks == 2


def test_block_cap_prunes_least_recent_leaves():
    index = make_index(max_blocks=6, prune_target_ratio=0.5)
    other = tuple(range(500, 512))
    index.apply(batch("w0", stored(0, 4)))
    index.apply(batch("w1", BlockStored((1, 2, 3), None, other, BS)))  # 7 blocks > 6: prune to 3
    assert index.num_blocks() == 3
    assert index.stats().counters["num_pruned_blocks"] == 4
    # w0's older chain is pruned leaf first down to nothing; w1's newer chain stays whole.
    assert depths(index) == {}
    assert depths(index, hash_token_blocks(list(other), BS)) == {"w1": (3, 0, 0)}
    index.apply(batch("w0", BlockRemoved((1003,))))  # a pruned block: known engine hash, nothing held
    assert index.stats().counters["num_removals_not_held"] == 1
    assert index.stats().counters["num_unknown_removals"] == 0


def test_block_cap_keeps_interior_blocks_while_children_live():
    index = make_index(max_blocks=5, prune_target_ratio=0.8)
    index.apply(batch("w0", stored(0, 2)))
    index.apply(batch("w1", stored(0, 4)))  # w1 re-stores blocks 0..1 (touched) and adds 2..3
    index.apply(batch("w0", BlockStored((7,), None, tuple(range(900, 904)), BS)))
    index.apply(batch("w0", BlockStored((8,), 7, tuple(range(904, 908)), BS)))  # 6 > 5: prune to 4
    assert index.num_blocks() == 4
    assert depths(index) == {"w0": (2, 0, 0), "w1": (2, 0, 0)}


def test_block_cap_restore_of_a_chain_makes_it_recent():
    index = make_index(max_blocks=7, prune_target_ratio=0.5)
    other = tuple(range(500, 512))
    index.apply(batch("w0", stored(0, 4)))
    index.apply(batch("w1", BlockStored((1, 2, 3), None, other, BS)))
    index.apply(batch("w1", stored(0, 4)))  # every block indexed: the chain's last block becomes the most recent
    index.apply(batch("w2", BlockStored((9,), None, tuple(range(900, 904)), BS)))  # 8 > 7: prune to 3
    assert index.stats().counters["num_pruned_blocks"] == 5
    # The other chain (3 blocks) goes first, then the restored chain from its leaf up: blocks 3, 2.
    assert depths(index) == {"w0": (2, 0, 0), "w1": (2, 0, 0)}
    assert depths(index, hash_token_blocks(list(other), BS)) == {}
    assert depths(index, hash_token_blocks(list(range(900, 904)), BS)) == {"w2": (1, 0, 0)}
    index.check_invariants()


def test_block_cap_prunes_a_parent_left_without_holders_with_its_last_child():
    # Block 0 is removed before block 1: an entry only as block 1's parent. Pruning reaches its target with
    # block 1 (the oldest leaf); block 0, now without holders or children, goes too.
    index = make_index(max_blocks=3, prune_target_ratio=1.0)
    other = hash_token_blocks(list(range(500, 508)), BS)
    index.apply(batch("a", stored(0, 2)))
    index.apply(batch("a", BlockRemoved((1000,))))
    assert index.num_blocks() == 2 and depths(index) == {}
    index.insert_approximate("b", other, now_s=2.0)  # 4 > 3: prune 1
    assert index.num_blocks() == 2
    assert HASHES[0] not in index.state.id_of and HASHES[1] not in index.state.id_of
    assert index.stats().counters["num_pruned_blocks"] == 2
    assert depths(index, HASHES[:2]) == {}
    assert depths(index, other) == {"b": (2, 0, 0)}
    assert index.stats().num_approx_blocks == 2
    index.check_invariants()
    assert index.expire(10.0) == 0  # b's blocks expire at 122
    index.remove_worker("b")
    assert index.num_blocks() == 0


def test_storing_a_dangling_parent_ends_the_gap_of_its_held_child():
    index = make_index(max_blocks=4, prune_target_ratio=0.2)
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w1", BlockStored((1, 2), None, tuple(range(500, 508)), BS)))  # 5 > 4: prune to 0
    assert index.num_blocks() == 0
    index.apply(batch("w0", stored(3, 4)))  # w0 still maps 1002 to block 2: block 3 hangs under a dangling key
    assert index.num_blocks() == 1 and depths(index) == {}
    assert index.state.slots[("w0", 0)].num_gaps == 1
    index.apply(batch("w0", stored(0, 3)))  # blocks 0 and 1 are new, block 2 was the dangling key
    assert index.state.slots[("w0", 0)].num_gaps == 0 and index.state.dirty_mask == 0
    assert index.num_blocks() == 4
    assert depths(index) == {"w0": (4, 0, 0)}
    index.check_invariants()


def test_pruned_ids_are_reused_and_stale_engine_hashes_never_reach_the_new_blocks():
    index = make_index(max_blocks=7, prune_target_ratio=0.5)
    other = tuple(range(500, 516))
    index.apply(batch("w0", stored(0, 4)))
    index.apply(batch("w1", BlockStored((1, 2, 3, 4), None, other, BS)))  # 8 > 7: prune to 3
    assert index.stats().counters["num_pruned_blocks"] == 5  # w0's chain, then w1's last block
    third = tuple(range(700, 708))
    index.apply(batch("w2", BlockStored((5, 6), None, third, BS)))  # takes 2 of the 5 freed ids
    assert index.num_blocks() == 5
    # w0 still maps its engine hashes to its pruned blocks: a removal finds nothing held, and a child of
    # block 3 hangs under a dangling key (not an entry) and matches nowhere from the root.
    index.apply(batch("w0", BlockRemoved((1001,))))
    assert index.stats().counters["num_removals_not_held"] == 1
    index.apply(batch("w0", stored(4, 6)))
    assert index.num_blocks() == 7
    assert depths(index) == {}
    assert depths(index, HASHES[:4]) == {}
    assert depths(index, hash_token_blocks(list(third), BS)) == {"w2": (2, 0, 0)}
    assert depths(index, hash_token_blocks(list(other), BS)) == {"w1": (3, 0, 0)}
    index.check_invariants()
    # Dropping the child frees the dangling key with it.
    index.apply(batch("w0", BlockRemoved((1005, 1004))))
    assert index.num_blocks() == 5
    index.check_invariants()


def test_hybrid_groups_sliding_window_and_recurrent():
    index = PrefixIndex(
        IndexConfig(block_size=BS),
        groups={0: GroupSpec(GroupKind.FULL), 1: GroupSpec(GroupKind.SLIDING_WINDOW, 2 * BS + 1)},
    )
    index.apply(batch("w0", stored(0, 6)))
    index.apply(batch("w0", stored(0, 6, group_idx=1)))
    assert depths(index) == {"w0": (6, 0, 0)}
    # The sliding group dropped blocks 0..2 (outside the window): still a 6-block hit (needs blocks 4, 5).
    index.apply(batch("w0", BlockRemoved((1000, 1001, 1002), group_idx=1)))
    assert depths(index) == {"w0": (6, 0, 0)}
    # Block 4 gone in the sliding group: L=6 needs 4..5, L=5 needs 3..4: the best is L=4 (blocks 2..3? no, 2 is
    # gone) -> L=0..1 only need block 0 (gone) -> no usable prefix except via L where blocks L-2, L-1 are held.
    index.apply(batch("w0", BlockRemoved((1004,), group_idx=1)))
    assert depths(index) == {}
    # A removal in group 1 never touched group 0.
    index.set_group_spec(1, GroupSpec(GroupKind.RECURRENT))
    assert depths(index) == {"w0": (6, 0, 0)}  # checkpoint at block 5 is held in group 1
    index.apply(batch("w0", BlockRemoved((1005,), group_idx=1)))
    assert depths(index) == {"w0": (4, 0, 0)}  # latest checkpoint at or before the end: block 3


def test_undeclared_group_refused_counted_and_creates_nothing(caplog):
    index = make_index()
    index.apply(batch("w0", stored(0, 4)))
    with caplog.at_level("DEBUG", logger="router.index.ingest"):
        for group_idx in (1, -1, 2**40):
            index.apply(batch("evil", stored(0, 1, group_idx=group_idx, kv_cache_spec_kind="mamba")))
        index.apply(batch("evil", BlockRemoved((1000,), group_idx=1)))
        index.apply(batch("w0", BlockRemoved((1003,), group_idx=7)))
    assert depths(index) == {"w0": (4, 0, 0)}  # still the plain full-attention match
    counters = index.stats().counters
    assert counters["num_unknown_group_events"] == 5
    assert counters["num_malformed_events"] == 0
    assert counters["num_blocks_stored"] == 4
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 4}, "evil": {}}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # once per slot, debug after
    assert warnings[0].startswith("kv events of worker evil rank 0: refused an event of 1 blocks in cache group 1,")
    assert warnings[1].startswith("kv events of worker w0 rank 0: refused an event of 1 blocks in cache group 7,")
    index.check_invariants()
    index.remove_worker("evil")
    index.clear()
    index.apply(batch("w0", stored(0, 2)))
    assert depths(index) == {"w0": (2, 0, 0)}
    index.check_invariants()


def test_groups_declared_in_config_survive_clear():
    config = IndexConfig(block_size=BS, groups=(GroupSpec(GroupKind.FULL), GroupSpec(GroupKind.RECURRENT)))
    index = PrefixIndex(config)
    index.apply(batch("w0", stored(0, 4)))
    assert depths(index) == {}  # the recurrent group holds no checkpoint yet
    index.apply(batch("w0", stored(0, 4, group_idx=1)))
    index.apply(batch("w0", BlockRemoved((1001,), group_idx=1)))
    assert depths(index) == {"w0": (4, 0, 0)}
    index.apply(batch("w0", BlockRemoved((1003,), group_idx=1)))
    assert depths(index) == {"w0": (3, 0, 0)}  # latest checkpoint: block 2
    index.apply(batch("w0", stored(0, 4, group_idx=2)))
    assert index.stats().counters["num_unknown_group_events"] == 1
    index.clear()
    index.apply(batch("w0", stored(0, 4)))
    assert depths(index) == {}  # group 1 is still declared: the hybrid rule still applies
    index.apply(batch("w0", stored(0, 2, group_idx=1)))
    assert depths(index) == {"w0": (2, 0, 0)}
    index.check_invariants()


def test_engine_hash_reused_for_another_block_refused_and_clear_complete(caplog):
    index = make_index()
    other = tuple(range(500, 508))  # 2 blocks unrelated to TOKENS
    other_hashes = hash_token_blocks(list(other), BS)
    index.apply(batch("w0", BlockStored((4, 5, 7), None, TOKENS[:12], BS)))
    with caplog.at_level("WARNING", logger="router.index.ingest"):
        index.apply(batch("w0", BlockStored((7,), None, other[:4], BS)))  # 7 already names block 2 of TOKENS
        index.apply(batch("w0", BlockStored((8, 4), None, other, BS)))  # cut before 4: block 0 of TOKENS
    assert depths(index) == {"w0": (3, 0, 0)}
    assert depths(index, other_hashes) == {"w0": (1, 0, 0)}
    assert index.stats().counters["num_engine_hash_reuse_blocks"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "kv events of worker w0 rank 0: refused 1 blocks from engine hash 7, which already names another block the "
        "worker holds (an engine hash must identify one block) (counted as num_engine_hash_reuse_blocks; further "
        "ones are logged at debug)"
    ]
    index.check_invariants()
    index.apply(batch("w0", AllBlocksCleared()))
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 0}}
    assert index.num_blocks() == 0
    index.check_invariants()
    index.apply(batch("w0", BlockStored((4,), None, TOKENS[:4], BS)))
    assert depths(index) == {"w0": (1, 0, 0)}
    # Once the block it named is gone, an engine hash may name another one (a new chain after an eviction).
    index.apply(batch("w0", BlockRemoved((4,)), BlockStored((4,), None, other[:4], BS)))
    assert depths(index) == {} and depths(index, other_hashes) == {"w0": (1, 0, 0)}
    index.apply_resync(Resync("w0", "test"))
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 0}} and index.num_blocks() == 0
    assert index.stats().counters["num_engine_hash_reuse_blocks"] == 2
    index.check_invariants()


def test_clear_is_complete_even_for_a_block_no_engine_hash_names(caplog):
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    index.apply(batch("w1", stored(0, 2)))
    del index.state.slots[("w0", 0)].engine[1002]  # break the slot invariant by hand
    with caplog.at_level("ERROR", logger="router.index.upkeep"):
        index.apply(batch("w0", AllBlocksCleared()))
    assert depths(index) == {"w1": (2, 0, 0)}
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 0}, "w1": {"GPU": 2}}
    assert index.num_blocks() == 2
    assert [r.getMessage() for r in caplog.records] == [
        "index: 1 blocks of w0/0 on (0, <Medium.GPU: 'GPU'>) were not reachable from its engine hashes; cleared "
        "by a scan"
    ]
    index.check_invariants()


def test_malformed_event_counted_rest_applies(caplog):
    index = make_index()
    bad = BlockStored((1, 2), None, (1, 2, 3), BS)  # 3 tokens for 2 blocks
    negative = BlockStored((3,), None, (-1, 0, 0, 0), BS)
    too_large = BlockStored((4,), None, (2**32, 0, 0, 0), BS)
    with caplog.at_level("DEBUG", logger="router.index.ingest"):
        index.apply(batch("w0", bad, negative, too_large, stored(0, 2)))
    assert depths(index) == {"w0": (2, 0, 0)}
    assert index.stats().counters["num_malformed_events"] == 3
    assert [r.levelname for r in caplog.records] == ["WARNING", "DEBUG", "DEBUG"]  # once per slot, then debug
    assert caplog.records[0].getMessage().startswith("kv events of worker w0 rank 0: refused a malformed event (")


def test_dump_worker_chains():
    index = make_index()
    index.apply(batch("w0", stored(0, 3)))
    other = tuple(range(700, 704))
    index.apply(batch("w0", BlockStored((9,), 1000, other, BS)))  # branch after block 0
    index.apply(batch("w0", BlockStored((1001,), None, (), BS, medium=Medium.CPU)))
    branch = hash_token_blocks(list(TOKENS[:4]) + list(other), BS)
    chains = index.dump_worker("w0")
    assert [c.block_hashes for c in chains] == sorted([tuple(HASHES[:3]), tuple(branch)])
    main = next(c for c in chains if c.block_hashes == tuple(HASHES[:3]))
    assert main.media == (("GPU",), ("GPU", "CPU"), ("GPU",))
    assert index.stats().num_blocks_by_worker == {"w0": {"GPU": 4, "CPU": 1}}


def test_config_validation():
    with pytest.raises(IndexConfigError):
        IndexConfig(block_size=0)
    with pytest.raises(IndexConfigError):
        IndexConfig(prune_target_ratio=1.5)
    with pytest.raises(IndexConfigError):
        GroupSpec(GroupKind.SLIDING_WINDOW)


def test_config_groups_from_yaml_mapping():
    raw = {"block_size": 16, "groups": [{"kind": "full"}, {"kind": "sliding_window", "sliding_window_tokens": 4096}]}
    config = msgspec.convert(raw, IndexConfig)
    assert config.groups == (GroupSpec(GroupKind.FULL), GroupSpec(GroupKind.SLIDING_WINDOW, 4096))
    assert PrefixIndex(config).state.groups == {
        0: GroupSpec(GroupKind.FULL), 1: GroupSpec(GroupKind.SLIDING_WINDOW, 4096)
    }
    with pytest.raises(msgspec.ValidationError, match=r"sliding_window_tokens > 0 - at `\$.groups\[0\]`"):
        msgspec.convert({"groups": [{"kind": "sliding_window"}]}, IndexConfig)


def test_a_chain_freed_leaf_first_is_reused_as_one_run_of_ids():
    index = make_index()
    index.apply(batch("w0", stored(0, 6)))
    assert [index.state.id_of[h] for h in HASHES[:6]] == [1, 2, 3, 4, 5, 6]
    index.apply(batch("w0", BlockRemoved(tuple(range(1000, 1006)))))  # root first: the leaf's removal cascades
    assert index.num_blocks() == 0 and index.state.free_ids == [6, 5, 4, 3, 2, 1]
    other = tuple(range(500, 500 + 6 * BS))
    other_hashes = hash_token_blocks(list(other), BS)
    index.apply(batch("w1", BlockStored((1, 2, 3, 4), None, other[: 4 * BS], BS)))
    assert [index.state.id_of[h] for h in other_hashes[:4]] == [1, 2, 3, 4]  # ascending: parent links implicit
    index.apply(batch("w1", BlockStored((5, 6), 4, other[4 * BS :], BS)))
    assert [index.state.id_of[h] for h in other_hashes] == [1, 2, 3, 4, 5, 6] and index.state.free_ids == []
    assert index.state.extra_children == {}
    assert depths(index, other_hashes) == {"w1": (6, 0, 0)}
    assert depths(index) == {}
    index.check_invariants()
    index.apply(batch("w1", BlockRemoved((6,))))
    assert depths(index, other_hashes) == {"w1": (5, 0, 0)}
    index.check_invariants()


def test_withdrawn_insertion_leaves_confirmed_and_refreshed_blocks():
    index = make_index(approx_ttl_s=10.0)
    first = index.insert_approximate("a", HASHES[:4], now_s=100.0)
    assert first is not None and first.expiry_s == 110.0
    index.apply(batch("a", stored(0, 1)))  # an event confirms block 0
    index.insert_approximate("a", HASHES[:2], now_s=101.0)  # another pending request refreshes block 1
    assert index.withdraw_approximate(first) == 2  # blocks 2 and 3: still this insertion's
    assert depths(index) == {"a": (2, 0, 0)}  # block 0 (confirmed) and block 1 (refreshed) stay
    assert index.stats().counters["num_approx_blocks_withdrawn"] == 2
    assert index.withdraw_approximate(first) == 0  # idempotent
    assert index.expire(1000.0) == 1  # block 1's own record still expires on time
    assert depths(index) == {"a": (1, 0, 0)}
    assert index.insert_approximate("a", [], now_s=1000.0) is None
