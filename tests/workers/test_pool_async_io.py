"""Shared pool reads and puts off the engine step (``PoolTier`` with ``io_threads``): a request waiting for its
restore's bytes keeps its blocks reserved while the other sequences keep stepping; a short read shortens the hit
after admission; a put is announced when it lands; a finished read wakes an idle engine loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from events.types import BlockStored, Medium
from workers.config import KVCacheConfig, PoolConfig, SchedulerConfig, TimingProfile
from workers.core import EngineCore
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_chunk import HostBuffer
from workers.kv.pool_tier import SimPool, SimPoolClient, pool_key
from workers.scheduler import Request, RequestStatus, Scheduler

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(16))  # 4 blocks
WAIT_S = 10.0


class GatedStore(SimPoolClient):
    """A sim pool client whose reads (or puts) block until ``gate`` is set; ``entered`` is set once one has begun."""

    def __init__(self, pool: SimPool, client_id: int, gate_reads: bool = True, gate_puts: bool = False) -> None:
        super().__init__(pool, client_id)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.arrivals = threading.Semaphore(0)
        """Released once per gated call that has begun."""
        self.gate_reads = gate_reads
        self.gate_puts = gate_puts
        self.threads: set[str] = set()

    def _wait(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        self.arrivals.release()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        if self.gate_reads:
            self._wait()
        return super().get_into(keys, buffer, offsets, sizes)

    def put_from(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        if self.gate_puts:
            self._wait()
        return super().put_from(keys, buffer, offsets, sizes)


def gated_worker(
    pool: SimPool, gate_reads: bool = True, gate_puts: bool = False, read_threads: int = 1
) -> tuple[KVCacheManager, GatedStore]:
    holder: list[KVCacheManager] = []
    pool._next_client += 1
    store = GatedStore(pool, pool._next_client, gate_reads, gate_puts)
    pool._listeners[store.client_id] = lambda keys: holder[0]._on_pool_evict(keys)
    # a reader only (no write-through) unless its puts are under test: the waker then fires for reads alone
    policy = "all" if gate_puts else "none"
    config = KVCacheConfig(num_gpu_blocks=16, block_size=BS,
                           pool=PoolConfig(store_policy=policy, read_threads=read_threads))  # fmt: skip
    kv = KVCacheManager(config, pool_store=store, pool_io_threads=True)
    holder.append(kv)
    return kv, store


def store_prompt(pool: SimPool, tokens: list[int]) -> None:
    """Another worker (inline I/O) computes ``tokens`` and writes them to the pool."""
    a = KVCacheManager(KVCacheConfig(num_gpu_blocks=16, block_size=BS), pool_store=pool.attach())
    seq = SequenceKV("writer")
    assert a.admit(seq, a.find_prefix(seq, tokens, len(tokens)), len(tokens))
    a.cache_computed(seq, tokens, len(tokens), len(tokens))
    (store,), _ = a.take_pool_copies()
    a.complete_store(store.job_id)


def test_a_sequence_keeps_decoding_while_another_waits_for_its_pool_read():
    pool = SimPool(64)
    store_prompt(pool, PROMPT)
    b, store = gated_worker(pool)
    done = threading.Event()
    b.set_io_waker(done.set)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), b, None)
    engine = SimEngine(TimingProfile(), BS, [7], None)
    decoder = Request("d", [100, 101, 102, 103, 104], 30, SamplingParams(), ignore_eos=True)
    sched.add_request(decoder)
    sched.update(engine.execute(sched.schedule()))  # its prefill: the first token
    assert decoder.num_output_tokens == 1
    restorer = Request("r", PROMPT + [1], 3, SamplingParams(), ignore_eos=True)
    sched.add_request(restorer)
    step = sched.schedule()  # r admitted: blocks reserved, the read submitted, d decodes
    assert restorer.status is RequestStatus.RESTORING and len(restorer.kv.block_ids) == 5
    assert [d.request_id for d in step.decodes] == ["d"] and len(step.pool_restores) == 1
    sched.update(engine.execute(step))
    assert store.entered.wait(WAIT_S)
    decoded_before = decoder.num_output_tokens
    for _ in range(10):  # the read is held: every step still decodes d, r waits with its blocks
        step = sched.schedule()
        assert [d.request_id for d in step.decodes] == ["d"] and step.prefills == ()
        sched.update(engine.execute(step))
    assert decoder.num_output_tokens - decoded_before == 10
    assert restorer.status is RequestStatus.RESTORING and restorer.num_output_tokens == 0
    assert store.threads == {"pool-read_0"}  # the read ran on the pool's read thread, not in the steps
    store.gate.set()
    assert done.wait(WAIT_S)  # the waker fired from the read thread
    step = sched.schedule()  # the finished read is applied first: r runs in this very step
    assert restorer.status is RequestStatus.RUNNING
    assert [c.request_id for c in step.prefills] == ["r"] and step.prefills[0].start_pos == 16
    sched.update(engine.execute(step))
    while sched.has_work() or engine.has_pending_copies():
        sched.update(engine.execute(sched.schedule()))
    assert restorer.num_cached_tokens == 16 and restorer.num_cached_tokens_by_medium == (0, 0, 16)
    assert restorer.finish_reason == "length" and restorer.all_token_ids[16:] == [1, 7, 7, 7]
    assert b.pool is not None and (b.pool.num_blocks_fetched, b.num_short_reads, b.num_restored_blocks) == (4, 0, 4)
    b.close()


def test_the_reads_of_two_restores_are_in_flight_at_once_on_two_read_threads():
    pool = SimPool(64)
    other = [200 + i for i in range(8)]
    store_prompt(pool, PROMPT)
    store_prompt(pool, other)
    b, store = gated_worker(pool, read_threads=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), b, None)
    engine = SimEngine(TimingProfile(), BS, [7], None)
    first = Request("r1", PROMPT + [1], 1, SamplingParams(), ignore_eos=True)
    second = Request("r2", other + [1], 1, SamplingParams(), ignore_eos=True)
    sched.add_request(first)
    sched.add_request(second)
    sched.update(engine.execute(sched.schedule()))  # both admitted in one step, both reads submitted
    assert store.arrivals.acquire(timeout=WAIT_S) and store.arrivals.acquire(timeout=WAIT_S)
    assert store.threads == {"pool-read_0", "pool-read_1"}  # the second read did not queue behind the first
    assert (first.status, second.status) == (RequestStatus.RESTORING, RequestStatus.RESTORING)
    assert len(first.kv.block_ids) + len(second.kv.block_ids) == 5 + 3  # both reservations held
    store.gate.set()
    while sched.has_work() or engine.has_pending_copies():
        sched.update(engine.execute(sched.schedule()))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (16, 8)
    assert (first.finish_reason, second.finish_reason) == ("length", "length")
    b.close()


def test_a_pool_read_that_comes_back_short_shortens_the_hit_after_admission():
    pool = SimPool(64)
    store_prompt(pool, PROMPT)
    b, store = gated_worker(pool)
    done = threading.Event()
    b.set_io_waker(done.set)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), b, None)
    engine = SimEngine(TimingProfile(), BS, [7], None)
    req = Request("r", PROMPT + [1], 2, SamplingParams(), ignore_eos=True)
    sched.add_request(req)
    sched.update(engine.execute(sched.schedule()))
    assert req.status is RequestStatus.RESTORING and req.num_cached_tokens == 16  # counted whole at admission
    assert store.entered.wait(WAIT_S)
    hashes = extend_block_hashes([], namespace_root(), PROMPT, BS)
    pool.evict([pool_key(hashes[2]), pool_key(hashes[3])])  # gone before the read gets to them
    store.gate.set()
    assert done.wait(WAIT_S)
    step = sched.schedule()
    assert req.status is RequestStatus.RUNNING
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in step.prefills] == [("r", 8, 9)]
    sched.update(engine.execute(step))
    while sched.has_work() or engine.has_pending_copies():
        sched.update(engine.execute(sched.schedule()))
    assert req.num_cached_tokens == 8 and req.num_cached_tokens_by_medium == (0, 0, 8)  # what was really read
    assert req.finish_reason == "length" and req.all_token_ids[16:] == [1, 7, 7]
    assert b.num_short_reads == 1 and b.num_restored_blocks == 2
    seq = SequenceKV("next")
    hit = b.find_prefix(seq, PROMPT + [1, 2], 18)
    assert len(hit.gpu_block_ids) == 4  # the restored blocks and the computed ones are all on GPU now
    b.close()


def test_a_pool_put_runs_off_the_step_and_is_announced_when_it_lands():
    pool = SimPool(64)
    b, store = gated_worker(pool, gate_reads=False, gate_puts=True)
    done = threading.Event()
    b.set_io_waker(done.set)
    seq = SequenceKV("s")
    assert b.admit(seq, b.find_prefix(seq, PROMPT[:8], 8), 8)
    b.cache_computed(seq, PROMPT[:8], 8, 8)
    (job,), _ = b.take_pool_copies()
    b.take_events()
    b.complete_store(job.job_id)  # returns at once: the put waits on the write thread
    assert store.entered.wait(WAIT_S) and store.threads == {"pool-write_0"}
    assert b.has_io_in_flight() and b.take_finished_reads() == [] and b.take_events() == []
    dup = SequenceKV("dup")
    dup.block_ids = b.gpu.allocate(2)
    b.cache_computed(dup, PROMPT[:8], 8, 8)
    assert b.take_pool_copies() == ((), ())  # rule 1 holds until the put has landed
    assert b.pool is not None and b.pool.num_stores_skipped_in_flight == 2
    store.gate.set()
    assert done.wait(WAIT_S)
    assert b.take_finished_reads() == [] and not b.has_io_in_flight()
    h = [to_engine_hash(x) for x in extend_block_hashes([], namespace_root(), PROMPT[:8], BS)]
    assert b.take_events() == [
        BlockStored(block_hashes=(h[0], h[1]), parent_block_hash=None, token_ids=(), block_size=BS,
                    medium=Medium.MOONCAKE)
    ]  # fmt: skip
    assert len(pool) == 2 and b.pool.num_blocks_stored == 2
    b.close()


async def test_a_finished_read_wakes_an_idle_engine_loop():
    pool = SimPool(64)
    store_prompt(pool, PROMPT)
    b, store = gated_worker(pool)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), b, None)
    core = EngineCore(sched, SimEngine(TimingProfile(), BS, [7], None), None, time_scale=0.0)
    task = asyncio.create_task(core.run())
    try:
        stream = core.add_request(Request("r", PROMPT + [1], 1, SamplingParams(), ignore_eos=True))
        assert await asyncio.to_thread(store.entered.wait, WAIT_S)
        for _ in range(20):
            await asyncio.sleep(0)  # the loop runs out of work and sleeps on its wake-up event
        steps = core.num_steps
        assert stream.queue.empty()
        store.gate.set()  # from this thread: only the pool's waker can wake the loop now
        out = await asyncio.wait_for(stream.queue.get(), WAIT_S)
        assert out.finish_reason == "length" and out.new_token_ids == [7] and stream.request.num_cached_tokens == 16
        assert core.num_steps > steps
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        b.close()
