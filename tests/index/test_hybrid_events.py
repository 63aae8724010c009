"""Hybrid-model events from vLLM into the prefix index: per-group holdings, sparse stores, and the regression for
the collision seen in the field (a Mamba group's blocks keyed without their group: vLLM publishes the same plain
digest for a block in every group, so the Mamba state's eviction removed the attention block, the next attention
store found no parent, every decision saw 0 hits and all traffic stayed on one worker)."""

from __future__ import annotations

import msgspec
import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.types import BlockStored, EventBatch
from router.block_hash import hash_token_blocks
from router.index import GroupKind, GroupSpec, IndexConfig, PrefixIndex
from tests.fixtures.events import payloads as p

pytestmark = pytest.mark.unit

BS = 4
TOKENS = list(range(20))
HASHES = hash_token_blocks(TOKENS, BS)


def decode(payload: bytes, worker: str = "w0", seq: int = 0) -> EventBatch:
    batch = EventDecoder(EventCounters()).decode(payload, worker_id=worker, seq=seq, block_size=BS)
    assert batch is not None
    return batch


def depth(index: PrefixIndex, num_blocks: int) -> dict[str, int]:
    return {w: m.num_gpu_blocks for w, m in index.match(HASHES[:num_blocks]).workers.items()}


def test_mamba_state_eviction_never_touches_the_attention_chain():
    index = PrefixIndex(IndexConfig(block_size=BS, groups=(GroupSpec(GroupKind.FULL), GroupSpec(GroupKind.RECURRENT))))
    index.apply(decode(p.HYBRID_MAMBA))
    assert depth(index, 3) == {"w0": 3}  # attention blocks 0..2 and the state after block 2
    index.apply(decode(p.HYBRID_MAMBA_EVICT, seq=1))  # group 1 drops HY[2], the digest group 0 also holds
    # Attention still holds all 3 blocks; without a state to resume from the hybrid prefix is empty.
    assert depth(index, 3) == {}
    full_only = PrefixIndex(IndexConfig(block_size=BS))  # the same worker seen as full attention: unaffected
    # The next attention store continues from HY[2]: its parent resolves (the eviction left group 0's entry).
    group0_chunk = decode(p.HYBRID_SWA_CHUNK, seq=2)
    index.apply(msgspec.structs.replace(group0_chunk, events=group0_chunk.events[:1]))
    stats = index.stats().counters
    assert stats["num_orphan_blocks"] == 0 and stats["num_unknown_removals"] == 0
    assert stats["num_blocks_stored"] == 3 + 1 + 2 and stats["num_blocks_removed"] == 1
    index.set_group_spec(1, GroupSpec(GroupKind.FULL))  # read group 1 as full attention: it holds nothing now
    assert depth(index, 5) == {}
    index.set_group_spec(1, GroupSpec(GroupKind.RECURRENT))
    for payload, seq in ((p.HYBRID_MAMBA, 0), (p.HYBRID_MAMBA_EVICT, 1), (p.HYBRID_SWA_CHUNK, 2)):
        full_only.apply(decode(payload, seq=seq))
    assert depth(full_only, 5) == {"w0": 5}  # group 1 undeclared there: refused and counted, group 0 intact
    assert full_only.stats().counters["num_unknown_group_events"] == 3
    index.check_invariants()


def test_a_sparse_sliding_window_store_holds_only_its_named_blocks():
    index = PrefixIndex(
        IndexConfig(block_size=BS, groups=(GroupSpec(GroupKind.FULL), GroupSpec(GroupKind.SLIDING_WINDOW, 8)))
    )
    first = decode(p.HYBRID_MAMBA)  # group 0: blocks 0..2; re-used as the window group's dense first store
    window0 = msgspec.structs.replace(
        first.events[0], group_idx=1, kv_cache_spec_kind="sliding_window", sliding_window_tokens=8
    )
    index.apply(msgspec.structs.replace(first, events=(first.events[0], window0)))
    index.apply(decode(p.HYBRID_SWA_CHUNK, seq=1))  # group 0: blocks 3, 4; group 1: block 4 only (3 skipped)
    stored = index.dump_worker("w0")
    assert [d.block_hashes for d in stored] == [tuple(HASHES[:5])]  # group 0's chain, whole
    assert depth(index, 5) == {"w0": 3}  # a window of 8 tokens needs blocks L-2, L-1: block 3 is missing
    assert index.stats().counters["num_malformed_events"] == 0
    index.check_invariants()


def test_sparse_mamba_store_links_through_the_skipped_blocks():
    index = PrefixIndex(IndexConfig(block_size=BS, groups=(GroupSpec(GroupKind.FULL), GroupSpec(GroupKind.RECURRENT))))
    batch = decode(p.HYBRID_MAMBA)
    mamba = batch.events[1]
    assert isinstance(mamba, BlockStored) and mamba.num_skipped_blocks == 2
    index.apply(msgspec.structs.replace(batch, events=(mamba,)))  # the state alone, before any attention store
    assert depth(index, 3) == {}  # a checkpoint at block 2 but no attention blocks
    index.apply(msgspec.structs.replace(batch, events=(batch.events[0],)))
    assert depth(index, 3) == {"w0": 3}
    assert depth(index, 2) == {}  # a 2-block prefix has no checkpoint at block 1
    index.check_invariants()
