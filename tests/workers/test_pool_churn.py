"""The shared pool under churn: two rounds of 2,000 requests, 16 sessions in flight sharing a prefix, moving
between 4 workers, on a pool small enough to evict all the time, with values of a block's byte size. Every
restored block is read back and compared with what was stored (zero mismatches), and a gateway index fed the live
events predicts every hit exactly (GPU, CPU and pool blocks)."""

from __future__ import annotations

import random
import time

import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import BatchEncoder
from events.types import Medium
from router.block_hash import hash_token_blocks
from router.index.config import IndexConfig
from router.index.index import PrefixIndex
from workers.config import KVCacheConfig, PoolConfig
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_chunk import ChunkLayout
from workers.kv.pool_tier import SimPool, pool_key

pytestmark = pytest.mark.unit

BS = 16
VALUE_BYTES = 2048  # a block's value: its token ids padded to this size
SHARED = list(range(4 * BS))  # every session starts with the same 4 blocks
NUM_SESSIONS = 16
NUM_WORKERS = 4
REQUESTS_PER_ROUND = 2000


def make_worker(pool: SimPool) -> KVCacheManager:
    holder: list[KVCacheManager] = []
    client = pool.attach(lambda keys: holder[0]._on_pool_evict(keys))
    config = KVCacheConfig(num_gpu_blocks=256, block_size=BS,
                           pool=PoolConfig(backend="sim", value_bytes_per_block=VALUE_BYTES))  # fmt: skip
    holder.append(KVCacheManager(config, pool_store=client))
    return holder[0]


def prompt(session: int, turn: int) -> list[int]:
    """The shared prefix, then ``turn % 10 + 1`` blocks of the session's own history (a new conversation every
    10 turns), then one token."""
    start = 10_000_000 * (turn // 10) + 100_000 * (session + 1)
    own = [start + i for i in range((turn % 10 + 1) * BS)]
    return SHARED + own + [7]


def run_round(workers: list[KVCacheManager], index: PrefixIndex, seqs: list[int], rng: random.Random,
              first_turn: int) -> dict[str, int]:  # fmt: skip
    decoder = EventDecoder(EventCounters())
    encoder = BatchEncoder("vllm")
    totals = {"requests": 0, "pool_blocks": 0, "mismatched_predictions": 0, "cached_tokens": 0}

    def drain() -> None:
        for w, kv in enumerate(workers):
            events = kv.take_events()
            if events:
                batch = decoder.decode(encoder.encode(events, time.time(), 0), worker_id=f"w{w}", seq=seqs[w])
                assert batch is not None
                index.apply(batch)
                seqs[w] += 1

    turn = first_turn
    while totals["requests"] < REQUESTS_PER_ROUND:
        in_flight: list[tuple[KVCacheManager, SequenceKV, list[int]]] = []
        for session in range(NUM_SESSIONS):  # 16 in flight: admitted together, then finished together
            tokens = prompt(session, turn)
            w = rng.randrange(NUM_WORKERS)  # sessions move between workers: their history is in the pool
            kv = workers[w]
            seq = SequenceKV(f"r{turn}-{session}")
            hit = kv.find_prefix(seq, tokens, len(tokens))
            match = index.match(hash_token_blocks(tokens, BS)).workers.get(f"w{w}")
            predicted = 0 if match is None else match.num_blocks * BS
            totals["mismatched_predictions"] += predicted != hit.num_cached_tokens
            assert kv.admit(seq, hit, len(tokens))
            totals["pool_blocks"] += seq.num_cached_blocks - len(hit.gpu_block_ids)
            totals["cached_tokens"] += hit.num_cached_tokens
            in_flight.append((kv, seq, tokens))
            totals["requests"] += 1
        for kv in workers:
            _, restores = kv.take_pool_copies()
            for job in restores:
                kv.complete_restore(job.job_id)
        for kv, seq, tokens in in_flight:
            kv.cache_computed(seq, tokens, len(tokens), len(tokens))
        for kv in workers:
            stores, _ = kv.take_pool_copies()
            for job in stores:
                kv.complete_store(job.job_id)
        for kv, seq, _ in in_flight:
            kv.free(seq)
        drain()
        turn += 1
    return totals


def test_two_rounds_of_churn_restore_only_intact_blocks_and_the_index_predicts_every_hit():
    pool = SimPool(400)  # 16 sessions × up to 15 blocks do not fit: the pool evicts all the time
    workers = [make_worker(pool) for _ in range(NUM_WORKERS)]
    index = PrefixIndex(IndexConfig(block_size=BS),
                        pool_members={Medium.MOONCAKE: [f"w{i}" for i in range(NUM_WORKERS)]})  # fmt: skip
    rng = random.Random(18)
    seqs = [0] * NUM_WORKERS
    evicted = [pool.num_evicted]
    rounds = []
    for first_turn in (0, 1000):
        rounds.append(run_round(workers, index, seqs, rng, first_turn))
        evicted.append(pool.num_evicted)
    for totals in rounds:
        assert totals["requests"] == REQUESTS_PER_ROUND
        assert totals["pool_blocks"] > 2000  # restores from the pool all along
        assert totals["mismatched_predictions"] == 0
    assert evicted[1] > evicted[0] + 1000 and evicted[2] > evicted[1] + 1000  # the pool evicted in each round
    assert sum(kv.pool.num_fetch_mismatches for kv in workers if kv.pool is not None) == 0
    assert sum(kv.pool.num_blocks_fetched for kv in workers if kv.pool is not None) == sum(
        r["pool_blocks"] for r in rounds
    )
    assert len(pool) <= 400 and all(len(v) == VALUE_BYTES for v, _ in pool._data.values())


def test_a_block_read_back_with_other_bytes_is_counted_and_computed_instead():
    pool = SimPool(64)
    a, b = make_worker(pool), make_worker(pool)
    tokens = SHARED + [1]
    seq = SequenceKV("a")
    assert a.admit(seq, a.find_prefix(seq, tokens, len(tokens)), len(tokens))
    a.cache_computed(seq, tokens, len(tokens), len(tokens))
    (store,), _ = a.take_pool_copies()
    a.complete_store(store.job_id)
    keys = pool.keys()
    chunk = ChunkLayout(BS, 1, VALUE_BYTES).build(seq.block_hashes[0], SHARED[:BS])
    assert len(keys) == 4 and pool._data[keys[0]][0] == chunk
    value, owner = pool._data[keys[2]]
    pool._data[keys[2]] = (value[:-1] + b"\x01", owner)  # one flipped byte in block 2's padding
    seq_b = SequenceKV("b")
    hit = b.find_prefix(seq_b, tokens, len(tokens))
    assert hit.num_pool_blocks == 4  # the lookup sees the keys
    assert b.admit(seq_b, hit, len(tokens))
    assert seq_b.num_cached_blocks == 2  # blocks 0 and 1 restored; 2 (and so 3) computed
    assert b.pool is not None and (b.pool.num_fetch_mismatches, b.pool.num_blocks_fetched) == (1, 2)
    assert b.num_short_reads == 1  # the read found 2 of the 4 blocks the lookup counted
    assert keys[2] == pool_key(seq_b.block_hashes[2])
