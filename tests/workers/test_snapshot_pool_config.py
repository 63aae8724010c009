"""A cold gateway index fed only the snapshot; pool tier flags, load figures; torch engine with a pool refused."""

from __future__ import annotations

import argparse
import time

import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import BatchEncoder
from router.block_hash import hash_token_blocks
from router.index.config import IndexConfig
from router.index.index import PrefixIndex
from workers.cli import add_arguments, config_from_args
from workers.config import KVCacheConfig, build_config
from workers.errors import ConfigError
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.server import build_worker, load_info

pytestmark = pytest.mark.unit

BS = 4
P1 = list(range(12))  # 3 blocks
P2 = list(range(100, 124))  # 6 blocks
P3 = list(range(200, 208))  # 2 blocks


def complete_copies(kv: KVCacheManager) -> None:
    stores, restores = kv.take_copies()
    for store in stores:
        kv.complete_store(store.job_id)
    for restore in restores:
        kv.complete_restore(restore.job_id)


def serve(kv: KVCacheManager, rid: str, tokens: list[int]) -> SequenceKV:
    seq = SequenceKV(rid)
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    complete_copies(kv)
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    complete_copies(kv)
    kv.free(seq)
    return seq


def test_cold_index_fed_the_snapshot_matches_the_worker_including_cpu_only_prefixes():
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=8, num_cpu_blocks=32, block_size=BS))
    serve(kv, "a", P1)  # GPU 0-2
    serve(kv, "c", P3)  # GPU 3-4
    serve(kv, "b", P2)  # 6 blocks: evicts P1's 3 blocks from GPU -> P1 lives on CPU only
    serve(kv, "e", P1[:8] + [7])  # restores P1's first 2 blocks to GPU; P1's third stays CPU-only
    kv.take_events()
    prompts = [P1 + [0], P2 + [0], P3 + [0], P1[:8] + [0], P2[:12] + [1], [999] * 9]
    expected = {}
    for i, prompt in enumerate(prompts):
        hit = kv.find_prefix(SequenceKV(f"q{i}"), prompt, len(prompt))
        expected[i] = (len(hit.gpu_block_ids), hit.num_cpu_blocks)
    # P1: 2 blocks restored to GPU, its third CPU-only; P2's tail and all of P3 were evicted from GPU by e's
    # blocks and live on CPU only (a whole CPU-only prefix: no GPU store to resolve it by engine hash)
    assert expected == {0: (2, 1), 1: (5, 1), 2: (0, 2), 3: (2, 0), 4: (3, 0), 5: (0, 0)}

    body = BatchEncoder("vllm").encode(kv.snapshot_events(), time.time(), 0)
    batch = EventDecoder(EventCounters()).decode(body, worker_id="w", seq=0)
    assert batch is not None
    index = PrefixIndex(IndexConfig(block_size=BS))
    index.apply(batch)
    for i, prompt in enumerate(prompts):
        match = index.match(hash_token_blocks(prompt, BS)).get("w")
        got = (0, 0) if match is None else (match.num_gpu_blocks, match.num_cpu_blocks)
        assert got == expected[i], (i, got, expected[i])


def test_pool_flags_build_the_pool_section_and_load_reports_it():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--pool-backend", "sim", "--pool-name", "snap-test", "--pool-capacity-blocks", "100", "--block-size", "4"]
    )
    cfg = config_from_args(args)
    assert cfg.kv_cache.pool is not None
    assert (cfg.kv_cache.pool.backend, cfg.kv_cache.pool.name, cfg.kv_cache.pool.capacity_blocks) == (
        "sim",
        "snap-test",
        100,
    )
    mc = config_from_args(parser.parse_args(["--pool-backend", "mooncake", "--mooncake-master", "127.0.0.1:5"]))
    assert mc.kv_cache.pool is not None and mc.kv_cache.pool.master_address == "127.0.0.1:5"
    assert config_from_args(parser.parse_args([])).kv_cache.pool is None

    worker = build_worker(cfg)
    kv = worker.core.kv
    seq = serve(kv, "a", P1)
    stores, _ = kv.take_pool_copies()
    for store in stores:
        kv.complete_store(store.job_id)
    load = load_info(worker)
    assert load["num_free_blocks"]["MOONCAKE"] == 97 and load["num_total_blocks"]["MOONCAKE"] == 100
    assert load["pool"] == {"num_blocks_stored_here": 3, "num_used_blocks": 3, "num_free_blocks": 97}
    assert seq.block_ids == []


def test_torch_engine_with_a_pool_is_refused_at_config_time():
    with pytest.raises(ConfigError, match="torch engine does not run shared pool copies"):
        build_config({"engine": "torch", "kv-cache": {"pool": {"backend": "sim"}}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="torch engine"):
        config_from_args(parser.parse_args(["--engine", "torch", "--pool-backend", "mooncake"]))
    assert build_config({"engine": "torch"}).kv_cache.pool is None


@pytest.mark.parametrize("value", [0, 65, "16"])
def test_a_span_length_out_of_range_is_refused_with_its_key(value: object):
    with pytest.raises(ConfigError, match=r"blocks-per-span"):
        build_config({"kv-cache": {"pool": {"backend": "sim", "blocks-per-span": value}}})
    pool = build_config({"kv-cache": {"pool": {"backend": "sim", "blocks-per-span": 1}}}).kv_cache.pool
    assert pool is not None and pool.blocks_per_span == 1
