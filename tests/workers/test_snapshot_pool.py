"""A cold gateway index warmed only from two pool workers' snapshots predicts their pool hits exactly."""

from __future__ import annotations

import time

import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import BatchEncoder
from events.types import EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.index.config import IndexConfig
from router.index.index import PrefixIndex
from workers.config import KVCacheConfig
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_tier import SimPool

pytestmark = pytest.mark.unit

BS = 4
A = list(range(16))  # 4 blocks, served on a first
B = A + list(range(500, 508))  # a's 4 blocks + 2, served on b (restores a's 4 from the pool)
CPU_ONLY = list(range(300, 312))  # 3 blocks on a
FILLER = [list(range(1000 + 100 * i, 1000 + 100 * i + 24)) for i in range(3)]  # 6 blocks each: evict the GPU


def worker(pool: SimPool, num_cpu_blocks: int) -> KVCacheManager:
    holder: list[KVCacheManager] = []
    client = pool.attach(lambda keys: holder[0]._on_pool_evict(keys))
    config = KVCacheConfig(num_gpu_blocks=8, num_cpu_blocks=num_cpu_blocks, block_size=BS)
    holder.append(KVCacheManager(config, pool_store=client))
    return holder[0]


def serve(kv: KVCacheManager, rid: str, tokens: list[int], to_pool: bool = True) -> None:
    """Admit, restore, compute, store to CPU and (``to_pool``) the pool, free."""
    seq = SequenceKV(rid)
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    for _ in range(2):
        stores, restores = kv.take_copies()
        pool_stores, pool_restores = kv.take_pool_copies()
        for job in (*restores, *pool_restores):
            kv.complete_restore(job.job_id)
        for job in (*stores, *(pool_stores if to_pool else ())):
            kv.complete_store(job.job_id)
        if _ == 0:
            kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    kv.free(seq)


def batch_of(events: list, worker_id: str, seq: int) -> EventBatch:
    body = BatchEncoder("vllm").encode(events, time.time(), 0)
    batch = EventDecoder(EventCounters()).decode(body, worker_id=worker_id, seq=seq)
    assert batch is not None
    return batch


def truth(kv: KVCacheManager, prompt: list[int]) -> tuple[int, int, int]:
    hit = kv.find_prefix(SequenceKV("probe"), prompt, len(prompt))
    return len(hit.gpu_block_ids), hit.num_cpu_blocks, hit.num_pool_blocks


def predicted(index: PrefixIndex, worker_id: str, prompt: list[int]) -> tuple[int, int, int]:
    match = index.match(hash_token_blocks(prompt, BS)).get(worker_id)
    return (0, 0, 0) if match is None else (match.num_gpu_blocks, match.num_cpu_blocks, match.num_pool_blocks)


def test_snapshots_carry_every_tier_and_a_cold_index_predicts_pool_hits_exactly():
    pool = SimPool(64)
    a, b = worker(pool, 64), worker(pool, 0)
    live = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
    seqs = {"a": 0, "b": 0}

    def drain() -> None:
        for wid, kv in (("a", a), ("b", b)):
            events = kv.take_events()
            if events:
                live.apply(batch_of(events, wid, seqs[wid]))
                seqs[wid] += 1

    serve(a, "a1", A + [0])
    drain()
    serve(b, "b1", B + [0])  # restores a's 4 blocks from the pool, stores its 2 new ones there
    drain()
    serve(a, "a2", CPU_ONLY + [0], to_pool=False)
    drain()
    for i, filler in enumerate(FILLER):  # evict a's and b's GPU copies (a keeps CPU copies)
        serve(a, f"fa{i}", filler + [0], to_pool=False)
        serve(b, f"fb{i}", filler + [0], to_pool=False)
        drain()
    assert b.pool is not None and b.pool.num_blocks_fetched == 4
    prompts = [A + [1], B + [1], B[:20] + [9], CPU_ONLY + [1], FILLER[2] + [1], list(range(900, 909))]
    expected = {wid: [truth(kv, p) for p in prompts] for wid, kv in (("a", a), ("b", b))}
    # a: A on CPU (its own copy) after its GPU was refilled, B's 2 new blocks through the pool
    assert expected["a"] == [(0, 4, 0), (0, 4, 2), (0, 4, 1), (0, 3, 0), (6, 0, 0), (0, 0, 0)]
    # b (no CPU tier): everything from the pool, which b never stored A's blocks to
    assert expected["b"] == [(0, 0, 4), (0, 0, 6), (0, 0, 5), (0, 0, 0), (6, 0, 0), (0, 0, 0)]

    cold = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
    snap_b = b.snapshot_events()
    assert any(getattr(e, "medium", None) is Medium.MOONCAKE for e in snap_b)
    cold.apply(batch_of(snap_b, "b", 0))  # b first: its pool blocks chain off blocks a stored
    cold.apply(batch_of(a.snapshot_events(), "a", 0))
    for wid in ("a", "b"):
        assert [predicted(live, wid, p) for p in prompts] == expected[wid], wid
        assert [predicted(cold, wid, p) for p in prompts] == expected[wid], wid
    assert cold.state.counters["num_parked_blocks_dropped"] == 0


def test_evicted_pool_blocks_leave_the_snapshot_and_are_removed_by_every_worker_that_knew_them():
    pool = SimPool(6)
    a, b = worker(pool, 0), worker(pool, 0)
    serve(a, "a1", A + [0])
    serve(b, "b1", B + [0])  # 4 fetched + 2 stored: the pool is full
    a.take_events()
    b.take_events()
    assert b.pool is not None and len(b.pool.snapshot_metas()) == 6
    serve(a, "a2", CPU_ONLY + [0])  # 3 new blocks: the pool evicts A's first 3 (least recently used)
    assert pool.num_evicted == 3
    removed_a = [e for e in a.take_events() if type(e).__name__ == "BlockRemoved"]
    removed_b = [e for e in b.take_events() if type(e).__name__ == "BlockRemoved"]
    assert [len(e.block_hashes) for e in removed_a] == [3] and removed_a == removed_b
    assert len(b.pool.snapshot_metas()) == 3
    cold = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
    cold.apply(batch_of(b.snapshot_events(), "b", 0))
    cold.apply(batch_of(a.snapshot_events(), "a", 0))
    prompts = [A + [1], B + [1], CPU_ONLY + [1]]
    for wid, kv in (("a", a), ("b", b)):
        assert [predicted(cold, wid, p) for p in prompts] == [truth(kv, p) for p in prompts], wid
    # a: A on its GPU, B's 2 new blocks still in the pool; b: B on its GPU, nothing of CPU_ONLY (its own GPU
    # copy is on a; the pool copy of CPU_ONLY is a's store, reachable by b)
    assert [truth(a, p) for p in prompts] == [(4, 0, 0), (4, 0, 2), (3, 0, 0)]
    assert [truth(b, p) for p in prompts] == [(4, 0, 0), (6, 0, 0), (0, 0, 3)]
