"""Scheduler + sim engine: chunked prefill, FCFS admission, preemption by recompute, CPU restore then GPU hit,
timing model calibration, determinism."""

from __future__ import annotations

import argparse

import pytest

from workers.cli import add_arguments, config_from_args
from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams, ScheduledStep
from workers.engines.sim import SimEngine
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, RequestStatus, Scheduler

pytestmark = pytest.mark.unit

BS = 4


def make_sched(num_gpu: int = 32, num_cpu: int = 0, max_seqs: int = 8, budget: int = 64) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, block_size=BS))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, eos_token_id=None)
    return sched, SimEngine(TimingProfile(), BS, [7, 8, 9], None)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, max_tokens, SamplingParams(seed=1))


def run(sched: Scheduler, engine: SimEngine, max_steps: int = 1000) -> list[ScheduledStep]:
    steps = []
    for _ in range(max_steps):
        if not sched.has_work() and not engine.has_pending_copies():
            break
        step = sched.schedule()
        steps.append(step)
        sched.update(engine.execute(step))
    return steps


def test_chunked_prefill_and_decode_sequence():
    sched, engine = make_sched(budget=8)
    req = make_request("a", list(range(20)), max_tokens=3)
    sched.add_request(req)
    steps = run(sched, engine)
    shapes = [
        ([(len(p.token_ids), p.start_pos, p.sample) for p in s.prefills], [d.position for d in s.decodes])
        for s in steps
    ]
    assert shapes == [
        ([(8, 0, False)], []),
        ([(8, 8, False)], []),
        ([(4, 16, True)], []),
        ([], [20]),
        ([], [21]),
    ]
    assert req.all_token_ids[20:] == [engine.sample(1, 20), engine.sample(1, 21), engine.sample(1, 22)]
    assert req.status is RequestStatus.FINISHED and req.finish_reason == "length"
    assert sched.kv.gpu.num_free_blocks == 32


def test_fcfs_and_max_num_seqs():
    sched, engine = make_sched(max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [50 + i] * 5, max_tokens=2))
    step = sched.schedule()
    assert [p.request_id for p in step.prefills] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_by_recompute_frees_the_newest():
    # 6 blocks; two requests of 8 prompt tokens each (2 blocks), each growing to 16 tokens needs 4 blocks
    sched, engine = make_sched(num_gpu=6)
    a, b = make_request("a", list(range(8)), max_tokens=8), make_request("b", list(range(100, 108)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, engine)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 8
    # recompute keeps outputs deterministic
    assert b.all_token_ids[8:] == [engine.sample(1, p) for p in range(8, 16)]
    assert sched.kv.gpu.num_free_blocks == 6


def test_restore_from_cpu_then_next_turn_from_gpu():
    sched, engine = make_sched(num_gpu=8, num_cpu=32)
    prompt = list(range(17))  # 4 full blocks
    sched.add_request(make_request("t1", prompt, max_tokens=1))
    run(sched, engine)
    assert sched.kv.cpu is not None and sched.kv.cpu.num_stored_blocks == 4
    sched.add_request(make_request("flush", list(range(200, 232)), max_tokens=1))  # 8 blocks: evicts the prompt
    run(sched, engine)
    assert sched.kv.gpu.get_cached_block(sched.kv.cpu.lru_order()[0]) is None
    t2 = make_request("t2", prompt + [5, 6, 7, 8], max_tokens=1)
    sched.add_request(t2)
    first = sched.schedule()
    assert first.prefills == () and len(first.restores) == 1 and len(first.restores[0].dst_block_ids) == 4
    assert t2.status is RequestStatus.RESTORING
    result = engine.execute(first)
    # 4 blocks * 4 tokens * 128 KiB over 55 GB/s plus latency
    assert result.duration_s == pytest.approx(2e-5 + 16 * 131072 / 55e9)
    sched.update(result)
    assert t2.status is RequestStatus.RUNNING and t2.num_cached_tokens == 16
    assert t2.num_cached_tokens_by_medium == (0, 16, 0)
    run(sched, engine)
    t3 = make_request("t3", prompt + [5, 6, 7, 8, 9], max_tokens=1)
    sched.add_request(t3)
    step = sched.schedule()
    assert step.restores == () and step.prefills[0].start_pos == 20 and t3.num_cached_tokens == 20
    assert t3.num_cached_tokens_by_medium == (20, 0, 0)


def test_timing_model_calibration():
    engine = SimEngine(TimingProfile(), 16, [1], None)
    t = engine.timing
    assert t.profile.step_overhead_s + t.prefill_s(32768, 0) == pytest.approx(1.26, abs=0.005)
    assert t.copy_s(2048, 55e9) == pytest.approx(0.078, abs=0.001)


def make_hold_sched(hold: bool, num_gpu: int, max_seqs: int = 8) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu, num_cpu_blocks=0, block_size=BS))
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, hold_prefix_on_arrival=hold)
    return Scheduler(config, kv, eos_token_id=None), SimEngine(TimingProfile(), BS, [7, 8, 9], None)


@pytest.mark.parametrize(("hold", "expected_cached"), [(True, 12), (False, 4)])
def test_a_held_prefix_is_evicted_after_every_other_free_block(hold, expected_cached):
    # 8 blocks, one request at a time. "warm" (blocks 0, 1, 2) then "recent" (3, 4, 5) cache 12 prompt tokens each
    # and free them tail first: the free queue is 6, 7, 2, 1, 0, 5, 4, 3 (LRU first). "big" (12 prompt tokens + 4
    # outputs: 4 blocks) runs while "turn" (warm's 12 tokens + 4) waits. Without a hold big takes 6, 7, 2, 1 and turn
    # finds block 0 alone; with turn holding 0, 1, 2 big takes 6, 7, 5, 4 and turn finds its 12 tokens.
    sched, engine = make_hold_sched(hold, num_gpu=8, max_seqs=1)
    for rid, base in (("warm", 0), ("recent", 100)):
        sched.add_request(make_request(rid, list(range(base, base + 12)), max_tokens=1))
        run(sched, engine)
    big = make_request("big", list(range(500, 512)), max_tokens=4)
    turn = make_request("turn", [*range(12), 90, 91, 92, 93], max_tokens=1)
    sched.add_request(big)
    sched.add_request(turn)
    assert turn.held_block_ids == ((0, 1, 2) if hold else ())
    run(sched, engine)
    assert turn.num_cached_tokens == expected_cached
    assert big.finish_reason == turn.finish_reason == "length" and big.num_preemptions == 0
    assert turn.held_block_ids == () and sched.kv.gpu.num_free_blocks == 8  # every reference dropped


def test_holds_yield_to_a_running_request_before_a_preemption():
    # 4 blocks. "turn" holds warm's 2 full blocks; "big" (8 prompt tokens + 8 outputs: 4 blocks) needs them to grow.
    sched, engine = make_hold_sched(True, num_gpu=4, max_seqs=1)
    sched.add_request(make_request("warm", list(range(8)), max_tokens=1))
    run(sched, engine)
    big = make_request("big", list(range(500, 508)), max_tokens=8)
    turn = make_request("turn", [*range(8), 90], max_tokens=1)
    sched.add_request(big)
    sched.add_request(turn)
    assert len(turn.held_block_ids) == 2
    run(sched, engine)
    assert big.num_preemptions == 0 and sched.num_preemptions == 0
    assert big.finish_reason == turn.finish_reason == "length" and turn.num_cached_tokens == 0
    assert sched.kv.gpu.num_free_blocks == 4


def test_holds_behind_the_head_yield_to_its_admission():
    # 5 blocks. The head holds w1's 2 blocks, "other" w2's 2; one block is free. The head (20 tokens: 5 blocks)
    # needs 3 new blocks besides its hit, which only other's held blocks can give: other's hold is dropped and the
    # head admitted first (FCFS).
    sched, engine = make_hold_sched(True, num_gpu=5)
    sched.add_request(make_request("w1", list(range(9)), max_tokens=1))
    run(sched, engine)
    sched.add_request(make_request("w2", list(range(100, 109)), max_tokens=1))
    run(sched, engine)
    head = make_request("head", [*range(8), *range(200, 212)], max_tokens=1)
    other = make_request("other", [*range(100, 108), 300, 301], max_tokens=1)
    sched.add_request(head)
    sched.add_request(other)
    assert len(head.held_block_ids) == 2 and len(other.held_block_ids) == 2
    step = sched.schedule()
    assert [p.request_id for p in step.prefills] == ["head"] and other.held_block_ids == ()
    sched.update(engine.execute(step))
    run(sched, engine)
    assert head.finish_reason == other.finish_reason == "length" and head.num_cached_tokens == 8
    assert sched.kv.gpu.num_free_blocks == 5


def test_an_abort_while_waiting_drops_the_hold():
    sched, engine = make_hold_sched(True, num_gpu=8, max_seqs=1)
    sched.add_request(make_request("warm", list(range(12)), max_tokens=1))
    run(sched, engine)
    sched.add_request(make_request("big", list(range(500, 520)), max_tokens=2))
    turn = make_request("turn", [*range(12), 90], max_tokens=1)
    sched.add_request(turn)
    assert len(turn.held_block_ids) == 3
    assert sched.finish_request("turn") and turn.held_block_ids == ()
    run(sched, engine)
    assert sched.kv.gpu.num_free_blocks == 8


def schedule_of(steps: list[ScheduledStep]) -> list[list[tuple[str, int, int]]]:
    """Each step's work as ``(request_id, num_new_tokens, start_pos)``: prefill chunks, then decodes (1 token)."""
    return [
        [(p.request_id, len(p.token_ids), p.start_pos) for p in s.prefills]
        + [(d.request_id, 1, d.position) for d in s.decodes]
        for s in steps
    ]


def make_threshold_sched(threshold: int, budget: int = 16) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=32, block_size=BS))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    return Scheduler(config, kv, eos_token_id=None), SimEngine(TimingProfile(), BS, [7, 8, 9], None)


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        # off (vLLM's default 0): the long prompt takes the whole budget; the short one waits a step
        (0, [[("long", 16, 0)],
             [("long", 4, 16), ("short", 5, 0)],
             [("long", 1, 20), ("short", 1, 5)]]),
        # 6 tokens a step at most: the short prompt runs in the first step beside the long one's chunk
        (6, [[("long", 6, 0), ("short", 5, 0)],
             [("long", 6, 6), ("short", 1, 5)],
             [("long", 6, 12)],
             [("long", 2, 18)],
             [("long", 1, 20)]]),
        # at or above the budget it never binds: the same schedule as off
        (16, [[("long", 16, 0)],
              [("long", 4, 16), ("short", 5, 0)],
              [("long", 1, 20), ("short", 1, 5)]]),
    ],
)
def test_long_prefill_token_threshold_caps_each_request_per_step(threshold, expected):
    sched, engine = make_threshold_sched(threshold)
    sched.add_request(make_request("long", list(range(20)), max_tokens=2))
    sched.add_request(make_request("short", list(range(100, 105)), max_tokens=2))
    assert schedule_of(run(sched, engine)) == expected


def test_long_prefill_token_threshold_two_long_prompts_fill_the_budget():
    """Two prompts over the threshold take 6 + 6 of a 14-token budget; the third gets the 2 left, in FCFS order,
    until the first finishes its prefill."""
    sched, engine = make_threshold_sched(6, budget=14)
    sched.add_request(make_request("a", list(range(12)), max_tokens=1))
    sched.add_request(make_request("b", list(range(100, 112)), max_tokens=1))
    sched.add_request(make_request("c", list(range(200, 204)), max_tokens=1))
    assert schedule_of(run(sched, engine)) == [
        [("a", 6, 0), ("b", 6, 0), ("c", 2, 0)],
        [("a", 6, 6), ("b", 6, 6), ("c", 2, 2)],
    ]


def test_long_prefill_token_threshold_from_the_cli_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--long-prefill-token-threshold", "5242"]))
    assert config.scheduler.long_prefill_token_threshold == 5242
    assert config_from_args(parser.parse_args([])).scheduler.long_prefill_token_threshold == 0
