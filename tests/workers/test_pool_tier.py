"""Shared pool tier (MOONCAKE): cross-worker restores, store rules, events, eviction, scheduler end to end."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from events.types import BlockRemoved, BlockStored, Medium
from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_chunk import HostBuffer
from workers.kv.pool_tier import PoolTier, SimPool, SimPoolClient, pool_key
from workers.scheduler import Request, Scheduler

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(8))


def eh(tokens: list[int]) -> list[int]:
    return [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), tokens, BS)]


def worker(pool: SimPool, num_gpu_blocks: int = 8) -> KVCacheManager:
    holder: list[KVCacheManager] = []
    client = pool.attach(lambda keys: holder[0]._on_pool_evict(keys))
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu_blocks, block_size=BS), pool_store=client)
    holder.append(kv)
    return kv


def prefill(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[SequenceKV, int]:
    seq = SequenceKV(rid)
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    return seq, hit.num_cached_tokens


def test_block_stored_by_a_is_restored_by_b_and_counts_as_cached():
    pool = SimPool(16)
    a, b = worker(pool), worker(pool)
    prefill(a, "a", PROMPT)
    (store,), () = a.take_pool_copies()
    assert store.src_block_ids == (0, 1) and store.dst_block_ids == ()
    assert len(pool) == 0  # not visible before the copy lands
    a.take_events()
    a.complete_store(store.job_id)
    h = eh(PROMPT)
    assert a.take_events() == [
        BlockStored(
            block_hashes=(h[0], h[1]), parent_block_hash=None, token_ids=(), block_size=BS, medium=Medium.MOONCAKE
        )
    ]
    assert pool.keys() == [pool_key(x) for x in extend_block_hashes([], namespace_root(), PROMPT, BS)]
    # worker B: 2 blocks found in the pool, restored into reserved GPU blocks, reported cached
    seq = SequenceKV("b")
    hit = b.find_prefix(seq, PROMPT + [8], 9)
    assert (hit.gpu_block_ids, hit.num_cpu_blocks, hit.num_pool_blocks, hit.num_cached_tokens) == ((), 0, 2, 8)
    assert b.admit(seq, hit, 9)
    assert seq.block_ids == [0, 1, 2] and seq.num_cached_blocks == 2
    (), (restore,) = b.take_pool_copies()
    assert restore.src_block_ids == () and restore.dst_block_ids == (0, 1)
    assert b.take_events() == []  # nothing registered on GPU before the copy lands
    assert b.complete_restore(restore.job_id) is seq
    assert b.take_events() == [
        BlockStored(block_hashes=(h[0], h[1]), parent_block_hash=None, token_ids=tuple(PROMPT), block_size=BS)
    ]
    assert b.pool is not None and b.pool.num_blocks_fetched == 2
    assert b.pool.num_reads == 1 and b.pool.read_wall_s > 0.0  # the real read, timed for /metrics
    # the next turn on B hits on its GPU
    b.cache_computed(seq, PROMPT + [8], 9, 9)
    b.free(seq)
    seq2 = SequenceKV("b2")
    hit2 = b.find_prefix(seq2, PROMPT + [8, 9], 10)
    assert (hit2.gpu_block_ids, hit2.num_pool_blocks) == ((0, 1), 0)


def test_pool_store_rules():
    pool = SimPool(16)
    a, b = worker(pool), worker(pool)
    sa, _ = prefill(a, "a", PROMPT)
    (store,), _ = a.take_pool_copies()
    assert a.pool is not None and b.pool is not None
    # rule 1: an identical store in flight on the same worker is skipped
    dup = SequenceKV("dup")
    dup.block_ids = a.gpu.allocate(2)
    a.cache_computed(dup, PROMPT, 8, 8)
    assert a.take_pool_copies() == ((), ())
    assert a.pool.num_stores_skipped_in_flight == 2
    # rule 3: the GPU copies go before the store lands; it still completes, and its event carries tokens
    a.free(sa)
    a.free(dup)
    assert a.reset_prefix_cache()
    a.take_events()
    a.complete_store(store.job_id)
    h = eh(PROMPT)
    assert a.take_events() == [
        BlockStored(
            block_hashes=(h[0], h[1]),
            parent_block_hash=None,
            token_ids=tuple(PROMPT),
            block_size=BS,
            medium=Medium.MOONCAKE,
        )
    ]
    # rule 2: a block already in the pool (stored by another worker) is not stored again
    prefill(b, "b", [100, 101, 102, 103] + PROMPT[:0])
    b.take_pool_copies()
    sb = SequenceKV("b2")
    sb.block_ids = b.gpu.allocate(2)
    b.cache_computed(sb, PROMPT, 8, 8)
    assert b.take_pool_copies() == ((), ())
    assert b.pool.num_stores_skipped_stored == 2
    assert len(pool) == 2


def test_pool_eviction_is_published_by_the_worker_that_stored():
    pool = SimPool(2)
    a, b = worker(pool), worker(pool)
    prefill(a, "a", PROMPT)
    (s1,), _ = a.take_pool_copies()
    a.complete_store(s1.job_id)
    a.take_events()
    other = [50, 51, 52, 53]
    prefill(b, "b", other)
    (s2,), _ = b.take_pool_copies()
    b.complete_store(s2.job_id)
    assert a.take_events() == [BlockRemoved(block_hashes=(eh(PROMPT)[0],), medium=Medium.MOONCAKE)]
    assert pool.num_evicted == 1


def test_scheduler_restores_from_pool_then_runs():
    pool = SimPool(64)
    a = worker(pool, 16)
    prompt = list(range(16))
    prefill(a, "a", prompt)
    (st,), _ = a.take_pool_copies()
    a.complete_store(st.job_id)
    b = worker(pool, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), b, None)
    engine = SimEngine(TimingProfile(), BS, [7], None)
    req = Request("r1", prompt + [1], 2, SamplingParams(), ignore_eos=True)
    sched.add_request(req)
    step = sched.schedule()
    assert step.prefills == () and step.restores == ()
    assert len(step.pool_restores) == 1 and step.pool_restores[0].dst_block_ids == (0, 1, 2, 3)
    assert req.num_cached_tokens == 16 and sched.num_running == 1
    assert req.num_cached_tokens_by_medium == (0, 0, 16)  # all of it restored from the pool
    result = engine.execute(step)
    p = TimingProfile()
    assert result.duration_s == pytest.approx(p.pool_latency_s + 16 * p.kv_bytes_per_token / p.pool_bytes_per_s)
    sched.update(result)
    while sched.has_work() or engine.has_pending_copies():
        sched.update(engine.execute(sched.schedule()))
    assert req.finish_reason == "length" and req.all_token_ids[16:] == [1, 7, 7]
    assert b.num_restored_blocks == 4 and sched.num_running == 0


class RecordingClient(SimPoolClient):
    """A sim pool client that records the keys of each ``get_into`` batch."""

    def __init__(self, pool: SimPool) -> None:
        super().__init__(pool, 0)
        self.reads: list[list[str]] = []

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.reads.append(list(keys))
        return super().get_into(keys, buffer, offsets, sizes)


def stored_metas(tier: PoolTier, tokens: list[int]) -> list[BlockMeta]:
    hashes = extend_block_hashes([], namespace_root(), tokens, BS)
    metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), i)
             for i, h in enumerate(hashes)]  # fmt: skip
    assert tier.prepare_store(1, hashes, metas) == list(range(len(hashes)))
    tier.complete_store(1)
    return metas


@pytest.mark.parametrize(("max_read_bytes", "batch_sizes"), [(64 << 20, [7]), (3 * 1000 + 999, [3, 3, 1])])
def test_a_restore_reads_its_chunks_in_one_batch_up_to_max_read_bytes(max_read_bytes, batch_sizes):
    client = RecordingClient(SimPool(16))
    tier = PoolTier(client, BS, lambda event: None, value_bytes_per_block=1000, max_read_bytes=max_read_bytes)
    metas = stored_metas(tier, list(range(7 * BS)))
    assert tier.fetch(metas) == 7
    keys = [pool_key(m.block_hash) for m in metas]
    assert client.reads == [keys[sum(batch_sizes[:i]) : sum(batch_sizes[: i + 1])] for i in range(len(batch_sizes))]
    assert [len(r) for r in client.reads] == batch_sizes
    with pytest.raises(ValueError, match="max_read_bytes must be positive"):
        PoolTier(client, BS, lambda event: None, max_read_bytes=0)


def test_a_read_that_finds_a_chunk_gone_announces_it_removed():
    pool = SimPool(16)
    client = RecordingClient(pool)  # no eviction listener: the pool evicts silently, as Mooncake does
    events: list[object] = []
    tier = PoolTier(client, BS, events.append)
    metas = stored_metas(tier, list(range(4 * BS)))
    events.clear()
    pool.evict([pool_key(metas[2].block_hash), pool_key(metas[3].block_hash)])
    assert tier.fetch(metas) == 2
    assert events == [BlockRemoved(block_hashes=(to_engine_hash(metas[2].block_hash),), medium=Medium.MOONCAKE)]
    assert tier.num_fetch_lost == 1 and tier.num_fetch_mismatches == 0
    assert [m.block_hash for m in tier.snapshot_metas()] == [m.block_hash for m in metas[:2]] + [metas[3].block_hash]


@pytest.mark.parametrize(("read_ahead", "num_check_threads"), [(True, 1), (False, 1), (True, 3), (False, 2)])
def test_a_large_restore_reads_ahead_in_batches_and_still_stops_at_a_flipped_byte(
    read_ahead: bool, num_check_threads: int
):
    value_bytes = 1 << 20  # 24 blocks of 1 MiB: 24 MiB, at least twice READ_AHEAD_MIN_BATCH_BYTES
    pool = SimPool(64)
    client = RecordingClient(pool)
    tier = PoolTier(client, BS, lambda event: None, value_bytes_per_block=value_bytes, blocks_per_span=1,
                    read_ahead=read_ahead, num_check_threads=num_check_threads)  # fmt: skip
    assert tier.layout.zero_check.num_threads == num_check_threads
    metas = stored_metas(tier, list(range(24 * BS)))
    keys = [pool_key(m.block_hash) for m in metas]
    assert tier.fetch(metas) == 24
    batches = [keys[0:8], keys[8:16], keys[16:24]] if read_ahead else [keys]  # 8 MiB each, one read ahead
    assert client.reads == batches
    value, owner = pool._data[keys[19]]
    flipped = bytearray(value)
    flipped[value_bytes // 2] ^= 0x10  # a padding byte of block 19, in the last batch
    pool._data[keys[19]] = (bytes(flipped), owner)
    client.reads.clear()
    assert tier.fetch(metas) == 19
    assert client.reads == batches
    assert tier.num_fetch_mismatches == 1 and keys[19] not in pool._data  # removed from the pool
    tier.close()
