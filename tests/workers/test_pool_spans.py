"""Pool spans against a real ``mooncake_master`` on loopback: one object per 16 aligned blocks of a chain, singles
for the tail; exact keys, exact restores, corrupt members, lost spans, partial reads, and ``blocks_per_span=1``
as the per-block layout (skipped without the ``mooncake`` extra)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from tests.mooncake_master import running_master

pytest.importorskip("mooncake.store")

from common.pool_keys import member_engine_hashes, span_key  # noqa: E402
from events.types import BlockRemoved, BlockStored, KVEvent, Medium  # noqa: E402
from loadgen.mooncake_master import MooncakeMaster  # noqa: E402
from workers.config import KVCacheConfig, PoolConfig  # noqa: E402
from workers.kv.block_pool import BlockMeta  # noqa: E402
from workers.kv.hashing import BlockHash, extend_block_hashes, namespace_root, to_engine_hash  # noqa: E402
from workers.kv.manager import KVCacheManager, SequenceKV  # noqa: E402
from workers.kv.pool_chunk import HostBuffer  # noqa: E402
from workers.kv.pool_layout import LAYOUT_KEY  # noqa: E402
from workers.kv.pool_tier import MooncakePoolStore, PoolObject, PoolTier, pool_key  # noqa: E402

pytestmark = pytest.mark.integration

BS = 4
VALUE_BYTES = 100  # a chunk: 56-byte manifest + 16 bytes of tokens, padded to 100
L = 16


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with running_master(lease_ttl_ms=500) as m:
        yield m


class RecordingStore(MooncakePoolStore):
    """A Mooncake client that records each ``get_into`` batch's keys and sizes."""

    reads: list[tuple[list[str], list[int]]]

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.reads.append((list(keys), list(sizes)))
        return super().get_into(keys, buffer, offsets, sizes)


def client(master: MooncakeMaster, segment_bytes: int = 16 << 20) -> RecordingStore:
    store = RecordingStore(master.address, global_segment_size=segment_bytes, local_buffer_size=8 << 20)
    store.reads = []
    return store


def chain(num_blocks: int, base: int = 5000) -> tuple[list[BlockHash], list[BlockMeta]]:
    tokens = [base + i for i in range(num_blocks * BS)]
    hashes = extend_block_hashes([], namespace_root(), tokens, BS)
    metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), i)
             for i, h in enumerate(hashes)]  # fmt: skip
    return hashes, metas


def tier(store: MooncakePoolStore, events: list[KVEvent], blocks_per_span: int = L) -> PoolTier:
    return PoolTier(store, BS, events.append, value_bytes_per_block=VALUE_BYTES, blocks_per_span=blocks_per_span)


def store_all(t: PoolTier, hashes: list[BlockHash], metas: list[BlockMeta], job_id: int = 1) -> None:
    assert t.prepare_store(job_id, hashes, metas) == list(range(len(metas)))
    t.complete_store(job_id)


def ehs(hashes: Sequence[BlockHash]) -> tuple[int, ...]:
    return tuple(map(to_engine_hash, hashes))


def stored_event(metas: Sequence[BlockMeta]) -> BlockStored:
    parent = metas[0].parent_block_hash
    return BlockStored(block_hashes=ehs([m.block_hash for m in metas]),
                       parent_block_hash=None if parent is None else to_engine_hash(parent),
                       token_ids=tuple(t for m in metas for t in m.token_ids), block_size=BS,
                       medium=Medium.MOONCAKE)  # fmt: skip


def test_a_40_block_chain_is_two_spans_and_eight_singles_and_restores_exactly(master: MooncakeMaster):
    hashes, metas = chain(40)
    a_events: list[KVEvent] = []
    b_events: list[KVEvent] = []
    sa, sb = client(master), client(master, 0)
    try:
        a = tier(sa, a_events)
        store_all(a, hashes, metas)
        spans = [span_key(hashes[0:16]), span_key(hashes[16:32])]
        singles = [pool_key(h) for h in hashes[32:]]
        assert sorted(master.keys()) == sorted([LAYOUT_KEY, *spans, *singles])  # and A's layout marker
        assert member_engine_hashes(spans[1]) == ehs(hashes[16:32])  # the key lists its members
        assert a_events == [stored_event(metas)]  # one BlockStored per block, as before
        assert (a.num_blocks_stored, a.block_counts()["num_blocks_stored_here"]) == (40, 40)
        # worker B finds and restores all 40 through 10 objects: 2 spans, 8 singles
        b = tier(sb, b_events)
        hit = b.lookup(hashes, 0, 40)
        assert hit.num_blocks == 40
        assert [o.key for o in hit.objects] == spans + singles
        assert hit.objects[1] == PoolObject(spans[1], 16, tuple(hashes[16:32]))
        assert b.fetch(metas, hit.objects) == 40
        chunk = b.layout.chunk_bytes
        assert chunk == VALUE_BYTES and sb.reads == [(spans + singles, [16 * chunk] * 2 + [chunk] * 8)]
        assert (b.num_blocks_fetched, b.num_fetch_mismatches, b.num_fetch_lost, b_events) == (40, 0, 0, [])
        assert [m.block_hash for m in b.snapshot_metas()] == hashes
        # store rule 2 per object: B writes nothing that A wrote
        assert b.prepare_store(7, hashes, metas) == [] and b.num_stores_skipped_stored == 40
    finally:
        sb.close()
        sa.close()


def test_a_corrupt_member_byte_fails_the_read_there_and_removes_the_span(master: MooncakeMaster):
    hashes, metas = chain(40)
    sa, sb = client(master), client(master, 0)
    b_events: list[KVEvent] = []
    try:
        a = tier(sa, [])
        store_all(a, hashes, metas)
        key = span_key(hashes[16:32])
        (value,) = sa.get([key])
        assert value is not None and len(value) == 16 * VALUE_BYTES
        bad = bytearray(value)
        bad[5 * VALUE_BYTES + 60] ^= 0x01  # one token byte of member 5 (block 21)
        sa.remove([key])
        assert sa.put([key], [bytes(bad)]) == [True]
        b = tier(sb, b_events)
        hit = b.lookup(hashes, 0, 40)
        assert hit.num_blocks == 40
        assert b.fetch(metas, hit.objects) == 21  # span 0 and members 0-4 of span 1 check out; block 21 does not
        assert b.num_fetch_mismatches == 1 and b.num_blocks_fetched == 21
        assert key not in master.keys()  # removed, so no worker reads it again
        assert b_events == [BlockRemoved(block_hashes=ehs(hashes[16:32]), medium=Medium.MOONCAKE)]
        assert b.lookup(hashes, 0, 40).num_blocks == 16
    finally:
        sb.close()
        sa.close()


def test_a_span_gone_from_the_master_is_announced_removed_for_every_member(master: MooncakeMaster):
    hashes, metas = chain(40)
    sa, sb = client(master), client(master, 0)
    a_events: list[KVEvent] = []
    try:
        a = tier(sa, a_events)
        store_all(a, hashes, metas)
        hit = a.lookup(hashes, 0, 40)
        a_events.clear()
        sb.remove([span_key(hashes[0:16])])  # as the master's eviction would: no one is told
        assert a.fetch(metas, hit.objects) == 0
        assert a_events == [BlockRemoved(block_hashes=ehs(hashes[0:16]), medium=Medium.MOONCAKE)]
        assert (a.num_fetch_lost, a.num_fetch_mismatches) == (1, 0)
        assert [m.block_hash for m in a.snapshot_metas()] == hashes[16:]  # the other objects stay announced
        assert a.lookup(hashes, 0, 40).num_blocks == 0
    finally:
        sb.close()
        sa.close()


def test_a_restore_of_part_of_a_span_reads_the_whole_object_and_uses_its_blocks(master: MooncakeMaster):
    hashes, metas = chain(40)
    sa, sb = client(master), client(master, 0)
    try:
        store_all(tier(sa, []), hashes, metas)
        b = tier(sb, [])
        hit = b.lookup(hashes, 5, 20)  # blocks 0-4 already on GPU, the hit capped at block 19
        assert hit.num_blocks == 15
        assert [o.key for o in hit.objects] == [span_key(hashes[0:16]), span_key(hashes[16:32])]
        assert b.fetch(metas[5:20], hit.objects) == 15
        assert sb.reads == [([o.key for o in hit.objects], [16 * VALUE_BYTES] * 2)]
        assert [m.block_hash for m in b.snapshot_metas()] == hashes[5:20]
    finally:
        sb.close()
        sa.close()


def test_a_chain_grown_past_its_tail_is_found_through_the_singles_then_stored_as_a_span(master: MooncakeMaster):
    hashes, metas = chain(48)
    sa = client(master)
    events: list[KVEvent] = []
    try:
        a = tier(sa, events)
        store_all(a, hashes[:40], metas[:40])
        events.clear()
        # the chain now reaches block 47: span 2 is missing, its first 8 blocks are singles
        hit = a.lookup(hashes, 0, 48)
        assert hit.num_blocks == 40 and [o.key for o in hit.objects[2:]] == [pool_key(h) for h in hashes[32:40]]
        # the next job covers blocks 40-47, widened back to the span's start: span 2 is written whole
        assert a.span_start(40) == 32
        assert a.prepare_store(2, hashes[32:48], metas[32:48], num_context_blocks=8) == list(range(16))
        a.complete_store(2)
        assert span_key(hashes[32:48]) in master.keys()
        assert events == [stored_event(metas[40:48])]  # blocks 32-39 were announced with their singles
        hit = a.lookup(hashes, 0, 48)
        assert hit.num_blocks == 48 and [o.key for o in hit.objects] == [span_key(hashes[k : k + 16])
                                                                         for k in (0, 16, 32)]  # fmt: skip
        # span 2 gone from the master: its members without a single of this worker are announced removed
        events.clear()
        sa.remove([span_key(hashes[32:48])])
        assert a.fetch(metas[32:48], hit.objects[2:]) == 0 and a.num_fetch_lost == 1
        assert events == [BlockRemoved(block_hashes=ehs(hashes[40:48]), medium=Medium.MOONCAKE)]
        assert a.lookup(hashes, 0, 48).num_blocks == 40  # through the singles again
        events.clear()
        a.on_evict([pool_key(hashes[33])])  # the last object holding block 33
        assert events == [BlockRemoved(block_hashes=ehs([hashes[33]]), medium=Medium.MOONCAKE)]
    finally:
        sa.close()


def test_one_block_per_span_is_the_per_block_layout(master: MooncakeMaster):
    hashes, metas = chain(40)
    sa, sb = client(master), client(master, 0)
    a_events: list[KVEvent] = []
    try:
        a = tier(sa, a_events, blocks_per_span=1)
        store_all(a, hashes, metas)
        assert sorted(master.keys()) == sorted([LAYOUT_KEY, *(pool_key(h) for h in hashes)])
        assert span_key(hashes[3:4]) == pool_key(hashes[3])
        assert a_events == [stored_event(metas)]
        b = tier(sb, [], blocks_per_span=1)
        hit = b.lookup(hashes, 0, 40)
        assert hit.num_blocks == 40 and [o.key for o in hit.objects] == [pool_key(h) for h in hashes]
        assert b.fetch(metas, hit.objects) == 40
        assert sb.reads == [([pool_key(h) for h in hashes], [VALUE_BYTES] * 40)]
        sa.remove([pool_key(hashes[7])])
        assert b.lookup(hashes, 0, 40).num_blocks == 7
    finally:
        sb.close()
        sa.close()
    with pytest.raises(ValueError, match="blocks_per_span"):
        PoolTier(sa, BS, a_events.append, blocks_per_span=0)


def test_the_manager_writes_spans_as_a_sequence_grows_and_another_worker_restores_them(master: MooncakeMaster):
    config = KVCacheConfig(num_gpu_blocks=64, block_size=BS, pool=PoolConfig(value_bytes_per_block=VALUE_BYTES))
    sa, sb = client(master), client(master, 0)
    try:
        a = KVCacheManager(config, pool_store=sa, pool_io_threads=False)
        b = KVCacheManager(config, pool_store=sb, pool_io_threads=False)
        tokens = [9000 + i for i in range(20 * BS)]
        seq = SequenceKV("a")
        assert a.admit(seq, a.find_prefix(seq, tokens, len(tokens)), len(tokens))
        for n in (6, 14, 20):  # three prefill chunks: blocks 0-5, 6-13, 14-19
            a.cache_computed(seq, tokens, n * BS, len(tokens))
            for job in a.take_pool_copies()[0]:
                a.complete_store(job.job_id)
        hashes = seq.block_hashes
        # the first two chunks were tails (singles 0-13); the third completes span 0 (blocks 14 and 15 only in it)
        singles = [pool_key(h) for h in (*hashes[:14], *hashes[16:20])]
        assert sorted(master.keys()) == sorted([LAYOUT_KEY, span_key(hashes[0:16]), *singles])
        assert a.pool is not None and a.pool.num_blocks_stored == 14 + 16 + 4
        seq_b = SequenceKV("b")
        hit = b.find_prefix(seq_b, [*tokens, 1], len(tokens) + 1)
        assert hit.num_pool_blocks == 20
        assert [o.key for o in hit.pool_objects] == [span_key(hashes[0:16]), *(pool_key(h) for h in hashes[16:20])]
        assert b.admit(seq_b, hit, len(tokens) + 1)
        assert b.pool is not None and b.pool.num_blocks_fetched == 20
    finally:
        sb.close()
        sa.close()
