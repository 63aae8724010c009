"""Blocks served from GPU or CPU mark their pool copy as used: an admission's existence check of the objects that
hold its GPU and CPU hit, which a real ``mooncake_master`` answers with a lease (objects leased latest are evicted
last), so a session that keeps hitting on one worker's GPU is not the first the pool evicts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from common.pool_keys import span_key
from tests.mooncake_master import running_master
from tests.workers.test_pool_spans_sim import CountingClient
from workers.config import KVCacheConfig
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_tier import SimPool, pool_key

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
        # a put grants no lease: the worker checks what it put, so a just-written object ranks as just used
        assert raw.remove(pool_key(hashes[39])) == OBJECT_HAS_LEASE
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
