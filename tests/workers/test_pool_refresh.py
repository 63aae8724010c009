"""Blocks served from GPU or CPU mark their pool copy as used: an admission's existence check of the objects that
hold its GPU and CPU hit, which a real ``mooncake_master`` answers with a lease (objects leased latest are evicted
last), so a session that keeps hitting on one worker's GPU is not the first the pool evicts; not while the pool
refuses the worker's puts (every lease would pin). A put is not checked: the master ranks it by its own time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import pytest

from common.pool_keys import span_key
from tests.mooncake_master import running_master
from tests.workers.test_pool_spans_sim import CountingClient
from workers.cli import add_arguments, config_from_args
from workers.config import MOONCAKE_DEFAULT_LEASE_TTL_S, KVCacheConfig, PoolConfig, build_config
from workers.errors import ConfigError
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_chunk import HostBuffer
from workers.kv.pool_tier import PoolTier, SimPool, pool_key

BS = 4
OBJECT_HAS_LEASE = -706  # Mooncake's ErrorCode for a remove while a lease is held (mooncake-store types.h)


@pytest.mark.unit
def test_an_admission_checks_the_objects_of_its_gpu_hit_once():
    client = CountingClient(SimPool(256))
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=128, block_size=BS), pool_store=client)
    tokens = [6000 + i for i in range(40 * BS)]
    seq = SequenceKV("a")
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert hit.num_cached_tokens == 0 and kv.admit(seq, hit, len(tokens))
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    ((job,), _) = kv.take_pool_copies()
    kv.complete_store(job.job_id)
    client.checks.clear()
    assert kv.pool is not None and kv.pool.num_refreshes == 0
    longer = tokens + [7000 + i for i in range(2 * BS)]  # the same 40 blocks, then 2 new ones
    again = SequenceKV("b")
    hit = kv.find_prefix(again, longer, len(longer))
    assert len(hit.gpu_block_ids) == 40 and hit.num_pool_blocks == 0
    lookups = list(client.checks)  # the pool lookup of the 2 blocks after the GPU hit
    assert kv.admit(again, hit, len(longer))
    h = again.block_hashes
    spans = [span_key(h[0:16]), span_key(h[16:32])]
    assert client.checks[len(lookups):] == [[*spans, *(pool_key(x) for x in h[32:40])]]
    assert kv.pool.num_refreshes == 1


class RefusingClient(CountingClient):
    """A sim pool client whose puts the pool refuses while ``refuse`` is set (as a full Mooncake pool does)."""

    refuse = False

    def put_from(self, keys, buffer: HostBuffer, offsets, sizes) -> list[bool]:  # type: ignore[no-untyped-def]
        return [False] * len(keys) if self.refuse else super().put_from(keys, buffer, offsets, sizes)


@pytest.mark.unit
def test_no_refresh_for_the_pause_after_the_pool_refused_a_put_of_the_worker():
    client = RefusingClient(SimPool(256))
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=128, block_size=BS), pool_store=client)
    assert kv.pool is not None
    now = [100.0]
    kv.pool.uses.clock = lambda: now[0]
    assert kv.pool.uses.pause_s == 10.0

    def serve(name: str, tokens: list[int]) -> list[str]:
        """The request admitted, computed, its new blocks put, freed; the keys of its first 8 blocks."""
        seq = SequenceKV(name)
        assert kv.admit(seq, kv.find_prefix(seq, tokens, len(tokens)), len(tokens))
        kv.cache_computed(seq, tokens, len(tokens), len(tokens))
        for job in kv.take_pool_copies()[0]:
            kv.complete_store(job.job_id)
        kv.free(seq)
        return [pool_key(h) for h in seq.block_hashes[:8]]

    base = [6000 + i for i in range(8 * BS)]
    serve("a", base)  # 8 blocks put
    client.refuse = True
    serve("b", base + [7000 + i for i in range(2 * BS)])  # a GPU hit (refreshed), then 2 blocks refused
    assert kv.pool.num_refreshes == 1 and kv.pool.num_stores_failed == 2 and kv.pool.uses.refused_at == 100.0
    client.refuse = False
    now[0] = 105.0
    serve("c", base + [8000 + i for i in range(2 * BS)])  # a GPU hit: no refresh (paused); its 2 blocks land
    assert kv.pool.num_refreshes == 1 and kv.pool.uses.num_skipped == 1 and kv.pool.num_stores_failed == 2
    now[0] = 109.9
    serve("d", base + [9000 + i for i in range(2 * BS)])  # still paused: a landed put does not end it
    assert kv.pool.num_refreshes == 1 and kv.pool.uses.num_skipped == 2
    now[0] = 110.0
    client.checks.clear()
    keys = serve("e", base + [9500 + i for i in range(2 * BS)])  # 10 s after the refusal: refreshed again
    assert kv.pool.num_refreshes == 2 and keys in client.checks


@pytest.fixture
def master_address() -> Iterator[str]:
    pytest.importorskip("mooncake.store")
    with running_master(lease_ttl_ms=500) as m:
        yield m.address


@pytest.mark.integration
def test_a_refresh_leases_the_objects_of_the_hit_on_a_real_master(master_address: str):
    from tests.workers.test_pool_spans import chain, store_all
    from workers.kv.pool_tier import MooncakePoolStore, PoolTier

    store = MooncakePoolStore(master_address, global_segment_size=16 << 20, local_buffer_size=8 << 20)
    try:
        tier = PoolTier(store, BS, lambda event: None, value_bytes_per_block=100)
        hashes, metas = chain(40)
        store_all(tier, hashes, metas)
        raw = store._store
        # what the worker put it does not check: no lease pins it (the master ranks it by the put's own time)
        assert raw.remove(pool_key(hashes[39])) == 0
        time.sleep(0.7)  # the 500 ms lease runs out
        tier.refresh(hashes, 20)  # blocks 0..19: spans 0 and 1 (16..31 holds 16..19)
        assert raw.remove(span_key(hashes[0:16])) == OBJECT_HAS_LEASE
        assert raw.remove(span_key(hashes[16:32])) == OBJECT_HAS_LEASE
        assert raw.remove(pool_key(hashes[33])) == 0  # a single the hit did not reach: not leased, removed
        assert tier.num_refreshes == 1
        tier.refresh(hashes, 0)
        assert tier.num_refreshes == 1
    finally:
        store.close()


@pytest.mark.integration
def test_a_lookup_announces_what_the_master_evicted_of_its_own_objects(master_address: str):
    from events.types import BlockRemoved, KVEvent, Medium
    from tests.workers.test_pool_spans import chain, ehs, store_all
    from workers.kv.pool_tier import MooncakePoolStore, PoolTier

    store = MooncakePoolStore(master_address, global_segment_size=16 << 20, local_buffer_size=8 << 20)
    try:
        events: list[KVEvent] = []
        tier = PoolTier(store, BS, events.append, value_bytes_per_block=100)
        hashes, metas = chain(40)
        store_all(tier, hashes, metas)
        events.clear()
        store.remove([span_key(hashes[16:32])])  # as the master's eviction would, telling no one
        hit = tier.lookup(hashes, 0, 40)
        assert hit.num_blocks == 16  # span 0; the hit ends where span 1 was
        assert events == [BlockRemoved(block_hashes=ehs(hashes[16:32]), medium=Medium.MOONCAKE)]
        events.clear()
        assert tier.lookup(hashes, 0, 40).num_blocks == 16 and events == []  # announced once
        other = PoolTier(store, BS, events.append, value_bytes_per_block=100)  # stored nothing, read nothing
        store.remove([span_key(hashes[0:16])])
        assert other.lookup(hashes, 0, 40).num_blocks == 0 and events == []  # not its objects to announce
    finally:
        store.close()


@pytest.mark.integration
def test_a_master_evicts_a_just_put_object_after_older_ones_used_or_not():
    """A put needs no check to rank as just used: ``PutEnd`` sets the object's lease time to the put's own
    (``workers.kv.pool_use``), so objects put earlier go first, then those leased before the put, then it."""
    pytest.importorskip("mooncake.store")
    from workers.kv.pool_tier import MooncakePoolStore

    with running_master(500, ("--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.1")) as master:
        store = MooncakePoolStore(master.address, global_segment_size=16 << 20, local_buffer_size=8 << 20)
        try:
            value = b"x" * (512 << 10)  # 32 fill the pool, eviction starts past 25
            old, new = [f"old{i}" for i in range(10)], [f"new{i}" for i in range(10)]
            for key in old:
                assert store.put([key], [value]) == [True]
            store.exists(old[:5])  # used: leased until now + 500 ms
            time.sleep(0.6)
            for key in new:
                assert store.put([key], [value]) == [True]
            fills = [f"fill{i}" for i in range(60)]
            for key in fills:  # more puts, until the master has evicted 12 keys
                store.put([key], [value])
                time.sleep(0.02)
                if master.metric("master_evicted_key_count") >= 12:
                    break
            assert master.metric("master_evicted_key_count") >= 12
            present = set(master.keys())
            assert not present & set(old)  # the 10 older objects all went first, the 5 used ones with them
            gone = [key for key in new if key not in present]
            assert 0 < len(gone) < len(new) and gone == new[: len(gone)]  # then the oldest of the just-put ones
        finally:
            store.close()


@pytest.mark.unit
def test_the_refresh_pause_is_the_master_lease_from_the_config_and_a_bad_one_is_refused_by_name():
    assert PoolConfig().lease_ttl_s == MOONCAKE_DEFAULT_LEASE_TTL_S == 10.0  # mooncake_master's default lease
    config = build_config({"kv-cache": {"block-size": BS, "pool": {"lease-ttl-s": 1.5}}})
    assert config.kv_cache.pool is not None and config.kv_cache.pool.lease_ttl_s == 1.5
    kv = KVCacheManager(config.kv_cache, pool_store=RefusingClient(SimPool(256)))
    assert kv.pool is not None and kv.pool.uses.pause_s == 1.5
    args = argparse.ArgumentParser()
    add_arguments(args)
    from_flags = config_from_args(args.parse_args(["--pool-backend", "sim", "--mooncake-lease-ttl-s", "2.5"]))
    assert from_flags.kv_cache.pool is not None and from_flags.kv_cache.pool.lease_ttl_s == 2.5
    for bad in (0, -1.0, float("nan"), float("inf"), "10s"):
        with pytest.raises(ConfigError, match=r"\$\.kv-cache\.pool\.lease-ttl-s"):
            build_config({"kv-cache": {"pool": {"lease-ttl-s": bad}}})
    with pytest.raises(ValueError, match="must be positive seconds, not 0"):
        PoolTier(SimPool(8).attach(), BS, lambda event: None, lease_ttl_s=0)
