"""Shared pool tier against a real ``mooncake_master`` on loopback (skipped without the ``mooncake`` extra)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mooncake_master import running_master

pytest.importorskip("mooncake.store")

from workers.config import KVCacheConfig  # noqa: E402
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash  # noqa: E402
from workers.kv.manager import KVCacheManager, SequenceKV  # noqa: E402
from workers.kv.pool_tier import MooncakePoolStore  # noqa: E402

pytestmark = pytest.mark.integration

BS = 4


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with running_master(lease_ttl_ms=2000) as m:
        yield m.address


def test_block_stored_by_a_is_restored_by_b_through_mooncake(master: str):
    cfg = KVCacheConfig(num_gpu_blocks=8, block_size=BS)
    sa = MooncakePoolStore(master, global_segment_size=32 << 20, local_buffer_size=16 << 20)
    sb = MooncakePoolStore(master, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        a, b = KVCacheManager(cfg, pool_store=sa), KVCacheManager(cfg, pool_store=sb)
        prompt = [1000 + i for i in range(8)]
        seq = SequenceKV("a")
        assert a.admit(seq, a.find_prefix(seq, prompt, 8), 8)
        a.cache_computed(seq, prompt, 8, 8)
        (store,), _ = a.take_pool_copies()
        a.take_events()
        a.complete_store(store.job_id)
        (ev,) = a.take_events()
        h = [to_engine_hash(x) for x in extend_block_hashes([], namespace_root(), prompt, BS)]
        assert ev.block_hashes == tuple(h) and ev.token_ids == ()
        seq_b = SequenceKV("b")
        hit = b.find_prefix(seq_b, prompt + [1], 9)
        assert hit.num_pool_blocks == 2 and hit.num_cached_tokens == 8
        assert b.admit(seq_b, hit, 9)
        (), (restore,) = b.take_pool_copies()
        assert b.complete_restore(restore.job_id) is seq_b
        assert b.pool is not None and b.pool.num_blocks_fetched == 2
        # rule 2 across workers: B does not store what A stored
        dup = SequenceKV("dup")
        dup.block_ids = b.gpu.allocate(2)
        b.cache_computed(dup, prompt, 8, 8)
        assert b.take_pool_copies() == ((), ()) and b.pool.num_stores_skipped_stored == 2
    finally:
        sb.close()
        sa.close()


def test_checkpoint_stored_by_a_is_resumed_by_b_through_mooncake(master: str):
    from events.types import BlockStored, Medium
    from workers.config import CacheGroupConfig, CheckpointConfig, SchedulerConfig, TimingProfile
    from workers.engines.base import SamplingParams
    from workers.engines.sim import SimEngine
    from workers.kv.hybrid import checkpoint_key
    from workers.scheduler import Request, Scheduler

    cfg = KVCacheConfig(
        num_gpu_blocks=32,
        block_size=BS,
        groups=(CacheGroupConfig(), CacheGroupConfig(kind="recurrent", state_bytes=1 << 20)),
        checkpoints=CheckpointConfig(interval_tokens=0, max_checkpoints=1),
    )

    def serve(kv: KVCacheManager, rid: str, prompt: list[int], max_tokens: int) -> tuple[Request, list]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, eos_token_id=None)
        engine = SimEngine(TimingProfile(), BS, [7, 8, 9], None)
        req = Request(rid, prompt, max_tokens, SamplingParams(seed=1), ignore_eos=True)
        sched.add_request(req)
        steps = []
        while sched.has_work() or engine.has_pending_copies():
            steps.append(sched.schedule())
            sched.update(engine.execute(steps[-1]))
        return req, steps

    sa = MooncakePoolStore(master, global_segment_size=32 << 20, local_buffer_size=16 << 20)
    sb = MooncakePoolStore(master, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        a, b = KVCacheManager(cfg, pool_store=sa), KVCacheManager(cfg, pool_store=sb)
        turn1, _ = serve(a, "t1", [2000 + i for i in range(10)], 7)  # 16 computed: generation end at block 3
        kv_hashes = turn1.kv.block_hashes
        assert sa.exists([checkpoint_key(1, kv_hashes[1]), checkpoint_key(1, kv_hashes[3])]) == [True, True]
        h = [to_engine_hash(x) for x in kv_hashes]
        pool_stores = [
            e.block_hashes for e in a.take_events()
            if isinstance(e, BlockStored) and e.group_idx == 1 and e.medium is Medium.MOONCAKE
        ]  # fmt: skip
        assert pool_stores == [(h[1],), (h[3],)]
        turn2, steps = serve(b, "t2", [*turn1.all_token_ids, 1, 2, 3, 4, 5], 1)
        assert turn2.num_cached_tokens == 16
        assert [(p.start_pos, len(p.token_ids)) for s in steps for p in s.prefills] == [(16, 6)]
        assert steps[0].num_state_pool_restores == 1 and b.groups.recurrent[0].num_resumes == 1
    finally:
        sb.close()
        sa.close()


def test_a_chunk_of_three_layer_groups_is_one_mooncake_object_read_whole_or_not_at_all(master: str):
    from workers.config import PoolConfig
    from workers.kv.pool_chunk import ChunkLayout
    from workers.kv.pool_tier import pool_key

    cfg = KVCacheConfig(num_gpu_blocks=8, block_size=BS, pool=PoolConfig(
        backend="mooncake", value_bytes_per_block=64 << 10, num_layer_groups=3))  # fmt: skip
    sa = MooncakePoolStore(master, global_segment_size=32 << 20, local_buffer_size=16 << 20)
    sb = MooncakePoolStore(master, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        a, b = KVCacheManager(cfg, pool_store=sa), KVCacheManager(cfg, pool_store=sb)
        prompt = [5000 + i for i in range(8)]
        seq = SequenceKV("a")
        assert a.admit(seq, a.find_prefix(seq, prompt, 8), 8)
        a.cache_computed(seq, prompt, 8, 8)
        (store,), _ = a.take_pool_copies()
        a.complete_store(store.job_id)
        keys = [pool_key(h) for h in seq.block_hashes]
        layout = ChunkLayout(BS, 3, 64 << 10)
        assert sb._store.get_batch(keys) == [
            layout.build(h, prompt[i * BS : (i + 1) * BS]) for i, h in enumerate(seq.block_hashes)
        ]  # one object per block, all three groups in it
        value = sb._store.get(keys[1])
        assert sb._store.upsert(keys[1], value[: layout.header_bytes + 2 * layout.piece_bytes]) == 0  # group 2 gone
        seq_b = SequenceKV("b")
        hit = b.find_prefix(seq_b, prompt + [1], 9)
        assert hit.num_pool_blocks == 2 and b.admit(seq_b, hit, 9)
        assert seq_b.num_cached_blocks == 1  # block 0 restored; block 1 computed, none of its groups loaded
        assert b.pool is not None and (b.pool.num_fetch_mismatches, b.pool.num_blocks_fetched) == (1, 1)
        assert sb.exists(keys) == [True, False]  # the damaged chunk was removed from the pool
    finally:
        sb.close()
        sa.close()
