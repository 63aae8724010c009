"""Hybrid models in the worker (``workers.kv.hybrid``): per-group blocks, sliding-window frees, recurrent-state
checkpoints a returning session resumes from, and the events each group publishes. Scheduler, KV manager and sim
engine are the real ones; counts are exact."""

from __future__ import annotations

import msgspec
import pytest

from events.types import BlockRemoved, BlockStored, Medium
from workers.config import CacheGroupConfig, CheckpointConfig, KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams, ScheduledStep
from workers.engines.sim import SimEngine
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.hybrid import CheckpointCosts
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, Scheduler

pytestmark = pytest.mark.unit

BS = 4
STATE_BYTES = 1 << 20


def make_sched(
    *,
    window: int = 9,
    sw_blocks: int | None = None,
    checkpoints: CheckpointConfig | None = None,
    recurrent: bool = True,
    sliding: bool = True,
    budget: int = 64,
) -> tuple[Scheduler, SimEngine]:
    groups = [CacheGroupConfig()]
    if sliding:
        groups.append(CacheGroupConfig(kind="sliding_window", sliding_window_tokens=window, num_gpu_blocks=sw_blocks))
    if recurrent:
        groups.append(CacheGroupConfig(kind="recurrent", state_bytes=STATE_BYTES))
    config = KVCacheConfig(
        num_gpu_blocks=32,
        block_size=BS,
        groups=tuple(groups),
        checkpoints=checkpoints or CheckpointConfig(interval_tokens=0),
    )
    kv = KVCacheManager(config)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, eos_token_id=None)
    return sched, SimEngine(TimingProfile(), BS, [7, 8, 9], None)


def run(sched: Scheduler, engine: SimEngine, max_steps: int = 1000) -> list[ScheduledStep]:
    steps = []
    for _ in range(max_steps):
        if not sched.has_work() and not engine.has_pending_copies():
            break
        step = sched.schedule()
        steps.append(step)
        sched.update(engine.execute(step))
    return steps


def serve(sched: Scheduler, engine: SimEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[Request, list]:
    req = Request(rid, list(prompt), max_tokens, SamplingParams(seed=1), ignore_eos=True)
    sched.add_request(req)
    steps = run(sched, engine)
    return req, steps


def engine_hashes(tokens: list[int]) -> list[int]:
    return [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(), tokens, BS)]


def prefill_shapes(steps: list[ScheduledStep]) -> list[tuple[int, int]]:
    return [(p.start_pos, len(p.token_ids)) for s in steps for p in s.prefills]


def test_next_turn_reuses_the_generated_tokens_and_computes_only_the_new_suffix():
    sched, engine = make_sched(checkpoints=CheckpointConfig(interval_tokens=0))
    turn1, steps1 = serve(sched, engine, "t1", list(range(100, 110)), max_tokens=7)
    assert turn1.num_cached_tokens == 0
    assert len(turn1.all_token_ids) == 17  # 10 prompt + 7 generated; 16 computed (the last sampled one is not)
    events = sched.kv.take_events()
    hashes = engine_hashes(turn1.all_token_ids)
    checkpoints = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 2]
    # prompt end: block 1 (tokens 0..7, the prompt's last full block); generation end: block 3 (tokens 0..15)
    assert [e.block_hashes for e in checkpoints] == [(hashes[1],), (hashes[3],)]
    assert sched.kv.groups.recurrent[0].num_commits == 2
    # next turn: the whole conversation so far plus 5 new tokens
    prompt2 = [*turn1.all_token_ids, 200, 201, 202, 203, 204]
    turn2, steps2 = serve(sched, engine, "t2", prompt2, max_tokens=1)
    assert turn2.num_cached_tokens == 16  # resumed at the generation-end checkpoint
    assert prefill_shapes(steps2) == [(16, 6)]  # the last generated token + the 5 new ones
    assert sched.kv.groups.recurrent[0].num_resumes == 1


def test_without_a_generation_end_checkpoint_the_generated_tokens_are_replayed():
    sched, engine = make_sched(checkpoints=CheckpointConfig(interval_tokens=0, at_generation_end=False))
    turn1, _ = serve(sched, engine, "t1", list(range(100, 110)), max_tokens=7)
    prompt2 = [*turn1.all_token_ids, 200, 201, 202, 203, 204]
    turn2, steps2 = serve(sched, engine, "t2", prompt2, max_tokens=1)
    # Full attention and the window still hold blocks 0..3, but the state is checkpointed only at block 1.
    assert sched.kv.gpu.holds_all(turn2.kv.block_hashes[:4])
    assert turn2.num_cached_tokens == 8
    assert prefill_shapes(steps2) == [(8, 14)]


def test_no_checkpoint_means_a_full_recompute_charged_as_prefill():
    sched, engine = make_sched(
        checkpoints=CheckpointConfig(interval_tokens=0, at_prompt_end=False, at_generation_end=False)
    )
    turn1, _ = serve(sched, engine, "t1", list(range(100, 110)), max_tokens=7)
    prompt2 = [*turn1.all_token_ids, 200, 201, 202, 203, 204]
    clock_before = engine.clock_s
    turn2, steps2 = serve(sched, engine, "t2", prompt2, max_tokens=1)
    assert turn2.num_cached_tokens == 0
    assert prefill_shapes(steps2) == [(0, 22)]
    timing = engine.timing
    assert engine.clock_s - clock_before == pytest.approx(TimingProfile().step_overhead_s + timing.prefill_s(22, 0))


def test_sliding_window_evictions_never_remove_full_attention_entries():
    # window 5 tokens: a hit of L blocks needs block L-1 only; the window group has a pool of 4 blocks
    sched, engine = make_sched(window=5, sw_blocks=4, recurrent=False, budget=8)
    prompt = list(range(300, 324))  # 6 blocks, prefilled in 3 chunks of 8
    req, steps = serve(sched, engine, "a", prompt, max_tokens=1)
    assert prefill_shapes(steps) == [(0, 8), (8, 8), (16, 8)]
    events = sched.kv.take_events()
    hashes = engine_hashes(prompt)
    removed = [(e.group_idx, e.block_hashes) for e in events if isinstance(e, BlockRemoved)]
    # chunk 1 freed block 0 (out of the window), chunk 2 blocks 2 then 1; chunk 3's two new blocks evicted the
    # free queue's front: block 0, then block 2
    assert removed == [(1, (hashes[0],)), (1, (hashes[2],))]
    stored0 = [h for e in events if isinstance(e, BlockStored) and e.group_idx == 0 for h in e.block_hashes]
    assert stored0 == hashes
    assert sched.kv.gpu.holds_all(req.kv.block_hashes[:6])
    window_pool = sched.kv.groups.sliding[0].pool
    assert [window_pool.get_cached_block(h) is not None for h in req.kv.block_hashes[:6]] == [
        False, True, False, True, True, True,
    ]
    # the same prefix again: the window's last block (5) is held, so all 6 blocks are a hit
    again, steps2 = serve(sched, engine, "b", [*prompt, 999], max_tokens=1)
    assert again.num_cached_tokens == 24 and prefill_shapes(steps2) == [(24, 1)]


def test_sliding_window_hit_stops_where_the_window_is_missing():
    # window 9 tokens: a hit of L blocks needs blocks L-2 and L-1; the window group has a pool of 4 blocks
    sched, engine = make_sched(window=9, sw_blocks=4, recurrent=False, budget=8)
    prompt = list(range(300, 324))
    a, _ = serve(sched, engine, "a", prompt, max_tokens=1)
    window_pool = sched.kv.groups.sliding[0].pool
    held = [window_pool.get_cached_block(h) is not None for h in a.kv.block_hashes[:6]]
    assert held == [False, False, True, True, True, True]  # chunk 3 evicted blocks 1 and 0 (freed by chunk 2)
    b, _ = serve(sched, engine, "b", prompt[:20] + [999], max_tokens=1)  # a hit of at most 5 blocks
    assert b.num_cached_tokens == 20  # blocks 3, 4 held
    # b's one new block evicted the free queue's front, block 2
    assert [window_pool.get_cached_block(h) is not None for h in a.kv.block_hashes[:6]] == [
        False, False, False, True, True, True,
    ]
    # at most 3 blocks: full attention holds blocks 0..2, but no L in 1..3 has its window (blocks L-2, L-1)
    assert sched.kv.gpu.holds_all(a.kv.block_hashes[:3])
    c, steps = serve(sched, engine, "c", prompt[:12] + [999], max_tokens=1)
    assert c.num_cached_tokens == 0 and prefill_shapes(steps) == [(0, 8), (8, 5)]


def test_checkpoint_events_are_vllm_mamba_group_stores():
    sched, engine = make_sched(sliding=False, checkpoints=CheckpointConfig(interval_tokens=0))
    req, _ = serve(sched, engine, "a", list(range(100, 110)), max_tokens=2)
    events = sched.kv.take_events()
    hashes = engine_hashes(req.all_token_ids)
    # 12 tokens, 11 computed: prompt end at block 1, generation end at block 1 too (a refresh, no second store)
    assert [e for e in events if isinstance(e, BlockStored)] == [
        BlockStored(
            block_hashes=(hashes[0], hashes[1]),
            parent_block_hash=None,
            token_ids=tuple(range(100, 108)),
            block_size=BS,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=(hashes[1],),
            parent_block_hash=hashes[0],
            token_ids=tuple(range(104, 108)),
            block_size=BS,
            group_idx=1,
            kv_cache_spec_kind="mamba",
        ),
    ]
    assert sched.kv.groups.recurrent[0].num_commits == 1


def test_interval_checkpoints_and_lru_eviction_with_a_cpu_tier():
    config = CheckpointConfig(
        interval_tokens=8, at_prompt_end=False, at_generation_end=False, max_checkpoints=2, num_cpu_checkpoints=3
    )
    sched, engine = make_sched(sliding=False, checkpoints=config)
    prompt = list(range(500, 533))  # 33 tokens: boundaries at 8, 16, 24, 32 -> blocks 1, 3, 5, 7
    req, _ = serve(sched, engine, "a", prompt, max_tokens=1)
    events = sched.kv.take_events()
    hashes = engine_hashes(prompt)
    group1 = [
        (type(e).__name__, e.medium.value, e.block_hashes)
        for e in events
        if isinstance(e, BlockStored | BlockRemoved) and e.group_idx == 1
    ]
    assert group1 == [
        ("BlockStored", "GPU", (hashes[1],)),
        ("BlockStored", "CPU", (hashes[1],)),
        ("BlockStored", "GPU", (hashes[3],)),
        ("BlockStored", "CPU", (hashes[3],)),
        ("BlockStored", "GPU", (hashes[5],)),
        ("BlockRemoved", "GPU", (hashes[1],)),
        ("BlockStored", "CPU", (hashes[5],)),
        ("BlockStored", "GPU", (hashes[7],)),
        ("BlockRemoved", "GPU", (hashes[3],)),
        ("BlockStored", "CPU", (hashes[7],)),
        ("BlockRemoved", "CPU", (hashes[1],)),
    ]
    group = sched.kv.groups.recurrent[0]
    kv_hashes = req.kv.block_hashes
    assert group.checkpoint_hashes(Medium.GPU) == [kv_hashes[5], kv_hashes[7]]
    assert group.checkpoint_hashes(Medium.CPU) == [kv_hashes[3], kv_hashes[5], kv_hashes[7]]
    # a prompt of 17 tokens: its best checkpoint (block 3) is on CPU only: resumed from there, copied back
    sched.kv.take_checkpoint_costs()
    again, steps = serve(sched, engine, "b", prompt[:16] + [1], max_tokens=1)
    assert again.num_cached_tokens == 16 and prefill_shapes(steps) == [(16, 1)]
    assert group.checkpoint_hashes(Medium.GPU) == [kv_hashes[7], kv_hashes[3]]
    assert steps[0].num_state_copies == 1 and steps[0].state_restore_bytes == STATE_BYTES
    restored = [e for e in sched.kv.take_events() if isinstance(e, BlockStored) and e.group_idx == 1]
    assert restored[0].block_hashes == (hashes[3],) and restored[0].medium is Medium.GPU


def test_zero_reuse_traffic_pays_two_commits_per_request_and_the_step_charges_them():
    sched, engine = make_sched(sliding=False, checkpoints=CheckpointConfig())  # default interval 4096
    req, steps = serve(sched, engine, "a", list(range(1000, 1040)), max_tokens=9)
    group = sched.kv.groups.recurrent[0]
    assert group.num_commits == 2  # prompt end (block 9), generation end (block 11)
    charged = [(s.num_state_copies, s.state_copy_bytes) for s in steps if s.num_state_copies]
    assert charged == [(1, STATE_BYTES)]  # the prompt-end copy, in the step after the prefill
    # the generation-end copy is made as the request finishes: the next step (of any request) pays for it
    assert sched.kv.take_checkpoint_costs() == CheckpointCosts(num_commits=1, commit_bytes=STATE_BYTES)
    p = TimingProfile()
    with_copy = next(s for s in steps if s.num_state_copies)
    without = msgspec.structs.replace(with_copy, num_state_copies=0, state_copy_bytes=0)
    assert engine.timing.step_s(with_copy) - engine.timing.step_s(without) == pytest.approx(
        p.copy_latency_s + 2 * STATE_BYTES / p.kv_read_bytes_per_s
    )


def test_a_shared_prefix_checkpoint_is_stored_once():
    sched, engine = make_sched(sliding=False, checkpoints=CheckpointConfig(interval_tokens=8, at_generation_end=False))
    serve(sched, engine, "a", list(range(16)) + [1, 2], max_tokens=1)
    serve(sched, engine, "b", list(range(16)) + [3, 4], max_tokens=1)
    group = sched.kv.groups.recurrent[0]
    # a: interval at 8 and 16 (16 is the prompt end too); b resumes at 16 and commits nothing new
    assert group.num_commits == 2 and group.num_resumes == 1


def test_preemption_drops_the_live_state_without_a_checkpoint():
    sched, engine = make_sched(sliding=False, checkpoints=CheckpointConfig(interval_tokens=0, at_prompt_end=False))
    req = Request("a", list(range(10)), 8, SamplingParams(seed=1), ignore_eos=True)
    sched.add_request(req)
    sched.update(engine.execute(sched.schedule()))
    sched._preempt(req)
    assert sched.kv.groups.recurrent[0].num_commits == 0
    run(sched, engine)
    assert sched.kv.groups.recurrent[0].num_commits == 1  # the generation end of the rerun only


def test_group_config_is_validated():
    with pytest.raises(ValueError, match="groups\\[0\\] must be the full-attention group"):
        KVCacheConfig(groups=(CacheGroupConfig(kind="recurrent"),))
    with pytest.raises(ValueError, match="needs sliding-window-tokens"):
        CacheGroupConfig(kind="sliding_window")
    with pytest.raises(ValueError, match="not a multiple of block-size 16"):
        KVCacheConfig(checkpoints=CheckpointConfig(interval_tokens=100))
    with pytest.raises(ValueError, match="only kv-cache.groups\\[0\\] may be"):
        KVCacheConfig(groups=(CacheGroupConfig(), CacheGroupConfig()))
