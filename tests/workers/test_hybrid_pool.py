"""Recurrent-state checkpoints through the shared pool tier (``workers.kv.hybrid`` over ``workers.kv.pool_tier``):
written through like blocks, restored by the same worker after its GPU copy is evicted or by another worker
attached to the pool, resumed from with exact counts; their events are pool-tier stores (MOONCAKE) of the
recurrent group. Real scheduler, KV managers and sim engine over one ``SimPool``."""

from __future__ import annotations

import pytest

from events.types import BlockRemoved, BlockStored, KVEvent, Medium
from workers.config import CacheGroupConfig, CheckpointConfig, KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams, ScheduledStep
from workers.engines.sim import SimEngine
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.hybrid import checkpoint_key
from workers.kv.manager import KVCacheManager
from workers.kv.pool_tier import SimPool
from workers.scheduler import Request, Scheduler

pytestmark = pytest.mark.unit

BS = 4
STATE_BYTES = 1 << 20
PROMPT = list(range(100, 110))  # 10 tokens: prompt end at block 1


def worker(pool: SimPool, max_checkpoints: int = 1) -> tuple[Scheduler, SimEngine]:
    holder: list[KVCacheManager] = []
    client = pool.attach(lambda keys: holder[0]._on_pool_evict(keys))
    config = KVCacheConfig(
        num_gpu_blocks=32,
        block_size=BS,
        groups=(CacheGroupConfig(), CacheGroupConfig(kind="recurrent", state_bytes=STATE_BYTES)),
        checkpoints=CheckpointConfig(interval_tokens=0, max_checkpoints=max_checkpoints),
    )
    kv = KVCacheManager(config, pool_store=client)
    holder.append(kv)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, eos_token_id=None)
    return sched, SimEngine(TimingProfile(), BS, [7, 8, 9], None)


def serve(sched: Scheduler, engine: SimEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[Request, list]:
    req = Request(rid, list(prompt), max_tokens, SamplingParams(seed=1), ignore_eos=True)
    sched.add_request(req)
    steps: list[ScheduledStep] = []
    for _ in range(1000):
        if not sched.has_work() and not engine.has_pending_copies():
            break
        step = sched.schedule()
        steps.append(step)
        sched.update(engine.execute(step))
    return req, steps


def eh(tokens: list[int]) -> list[int]:
    return [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), tokens, BS)]


def group1(events: list[KVEvent]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [
        (type(e).__name__, e.medium.value, e.block_hashes)
        for e in events
        if isinstance(e, BlockStored | BlockRemoved) and e.group_idx == 1
    ]


def prefills(steps: list[ScheduledStep]) -> list[tuple[int, int]]:
    return [(p.start_pos, len(p.token_ids)) for s in steps for p in s.prefills]


def test_checkpoints_are_written_through_to_the_pool_and_announced_as_mooncake_stores():
    pool = SimPool(256)
    sched, engine = worker(pool)
    turn1, _ = serve(sched, engine, "t1", PROMPT, max_tokens=7)  # 16 computed: generation end at block 3
    h = eh(turn1.all_token_ids)
    assert group1(sched.kv.take_events()) == [
        ("BlockStored", "GPU", (h[1],)),
        ("BlockStored", "MOONCAKE", (h[1],)),
        ("BlockStored", "GPU", (h[3],)),
        ("BlockRemoved", "GPU", (h[1],)),  # max-checkpoints 1
        ("BlockStored", "MOONCAKE", (h[3],)),
    ]
    kv_hashes = turn1.kv.block_hashes
    assert [checkpoint_key(1, kv_hashes[i]) in pool.keys() for i in range(4)] == [False, True, False, True]
    group = sched.kv.groups.recurrent[0]
    assert group.checkpoint_hashes(Medium.GPU) == [kv_hashes[3]]


def test_same_worker_resumes_from_the_pool_after_the_gpu_copy_is_evicted():
    pool = SimPool(256)
    sched, engine = worker(pool)
    turn1, _ = serve(sched, engine, "t1", PROMPT, max_tokens=7)
    serve(sched, engine, "other", list(range(500, 512)), max_tokens=1)  # its prompt-end checkpoint evicts block 3's
    group = sched.kv.groups.recurrent[0]
    assert turn1.kv.block_hashes[3] not in group.checkpoint_hashes(Medium.GPU)
    sched.kv.take_events()
    sched.kv.take_checkpoint_costs()
    turn2, steps = serve(sched, engine, "t2", [*turn1.all_token_ids, 200, 201, 202, 203, 204], max_tokens=1)
    assert turn2.num_cached_tokens == 16 and prefills(steps) == [(16, 6)]
    assert steps[0].num_state_pool_restores == 1 and steps[0].state_pool_restore_bytes == STATE_BYTES
    h = eh(turn1.all_token_ids)
    # read back into GPU (a store of the group), the pool copy was announced already
    assert group1(sched.kv.take_events())[0] == ("BlockStored", "GPU", (h[3],))
    p = TimingProfile()
    charged = engine.timing.step_s(steps[0]) - engine.timing.step_s(
        ScheduledStep(steps[0].prefills, steps[0].decodes)
    )
    assert charged == pytest.approx(p.pool_latency_s + STATE_BYTES / p.pool_bytes_per_s)


def test_another_worker_attached_to_the_pool_resumes_the_session():
    pool = SimPool(256)
    a, engine_a = worker(pool)
    turn1, _ = serve(a, engine_a, "t1", PROMPT, max_tokens=7)
    b, engine_b = worker(pool)
    prompt2 = [*turn1.all_token_ids, 200, 201, 202, 203, 204]
    turn2, steps = serve(b, engine_b, "t2", prompt2, max_tokens=1)
    # blocks 0..3 restored from the pool (A wrote them through), the state from A's generation-end checkpoint
    assert turn2.num_cached_tokens == 16
    assert len(steps[0].pool_restores) == 1 and steps[0].pool_restores[0].dst_block_ids == (0, 1, 2, 3)
    assert prefills(steps) == [(16, 6)]
    assert steps[0].num_state_pool_restores == 1
    h = eh(turn1.all_token_ids)
    events = group1(b.kv.take_events())
    # B announces the pool checkpoint it read (so its stream resolves), then its GPU copy; it writes only its
    # own prompt-end checkpoint (block 4, 20 tokens) to the pool
    assert events[:2] == [("BlockStored", "MOONCAKE", (h[3],)), ("BlockStored", "GPU", (h[3],))]
    h2 = eh(prompt2)
    assert [e for e in events if e[1] == "MOONCAKE"] == [
        ("BlockStored", "MOONCAKE", (h[3],)),
        ("BlockStored", "MOONCAKE", (h2[4],)),
    ]
    assert b.kv.groups.recurrent[0].num_resumes == 1


def test_a_pool_eviction_is_published_and_the_checkpoint_stops_counting():
    pool = SimPool(8)  # 4 blocks + 2 checkpoints of turn 1 fit (6 entries); the next request's 4 evict 2
    a, engine_a = worker(pool)
    turn1, _ = serve(a, engine_a, "t1", PROMPT, max_tokens=7)
    a.kv.take_events()
    serve(a, engine_a, "other", list(range(500, 512)), max_tokens=1)  # 3 blocks + 1 checkpoint
    h = eh(turn1.all_token_ids)
    kv_hashes = turn1.kv.block_hashes
    # least recently used first: block 1's checkpoint (written at the prompt end), then block 0
    assert pool.num_evicted == 2 and checkpoint_key(1, kv_hashes[1]) not in pool.keys()
    removed = [e for e in group1(a.kv.take_events()) if e[0] == "BlockRemoved" and e[1] == "MOONCAKE"]
    assert removed == [("BlockRemoved", "MOONCAKE", (h[1],))]
    assert checkpoint_key(1, kv_hashes[3]) in pool.keys()
    b, engine_b = worker(pool)
    # b: block 1's checkpoint and block 0 are gone: nothing of the prompt is usable
    turn2, steps = serve(b, engine_b, "t2", [*PROMPT, 1], max_tokens=1)
    assert turn2.num_cached_tokens == 0 and prefills(steps) == [(0, 11)]
