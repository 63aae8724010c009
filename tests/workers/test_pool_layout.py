"""Layout agreement of a pool's members (``workers.kv.pool_layout``): the first worker's marker, and a worker of
another span length refused at start-up with an error naming both lengths, against a real ``mooncake_master`` on
loopback and over the sim pool."""

from __future__ import annotations

import pytest

from tests.mooncake_master import running_master
from workers.config import KVCacheConfig, PoolConfig
from workers.kv.manager import KVCacheManager
from workers.kv.pool_layout import LAYOUT_KEY, PoolLayout, PoolLayoutError, attach_layout
from workers.kv.pool_store import SimPool, SimPoolClient

BS = 4


def mooncake_config(address: str, blocks_per_span: int, segment_bytes: int) -> KVCacheConfig:
    return KVCacheConfig(num_gpu_blocks=8, block_size=BS, pool=PoolConfig(
        backend="mooncake", master_address=address, global_segment_size=segment_bytes, local_buffer_size=8 << 20,
        value_bytes_per_block=100, blocks_per_span=blocks_per_span, io="inline"))  # fmt: skip


@pytest.mark.integration
def test_a_worker_of_span_length_8_is_refused_by_a_pool_of_16(caplog: pytest.LogCaptureFixture):
    pytest.importorskip("mooncake.store")
    with running_master(lease_ttl_ms=500) as master:
        first = KVCacheManager(mooncake_config(master.address, 16, 16 << 20))
        second = None
        try:
            assert first.pool is not None and first.pool.pool_layout == PoolLayout(16, 1, 100, BS, 1)
            assert master.keys() == [LAYOUT_KEY]  # the first member's marker, nothing else yet
            with pytest.raises(PoolLayoutError) as err:
                KVCacheManager(mooncake_config(master.address, 8, 0))
            assert str(err.value) == (
                f"pool {master.address} is laid out for other workers (blocks-per-span 8 here, 16 in the pool): a "
                "worker of another layout would store objects the others never find or read as corrupt, so this "
                "one does not attach; set kv-cache.pool to the pool's values, or use another pool"
            )
            assert (err.value.ours.blocks_per_span, err.value.pool.blocks_per_span) == (8, 16)
            # a member of the pool's layout attaches, and the marker is the first one's still
            second = KVCacheManager(mooncake_config(master.address, 16, 0))
            assert second.pool is not None and second.pool.pool_layout == PoolLayout(16, 1, 100, BS, 1)
            assert master.keys() == [LAYOUT_KEY]
        finally:
            for manager in (second, first):
                if manager is not None and manager.pool is not None:
                    manager.pool.store.close()


def test_over_the_sim_pool_the_first_layout_wins_and_another_chunk_size_is_refused():
    pool = SimPool(64)
    ours = PoolLayout(8, 1, 100, BS, 1)
    assert attach_layout(pool.attach(), ours, "sim") == ours
    assert attach_layout(pool.attach(), ours, "sim") == ours
    other = ours._replace(blocks_per_span=16, chunk_bytes=889)
    with pytest.raises(PoolLayoutError, match=r"^pool sim is laid out for other workers \(blocks-per-span 16 here, 8 "
                       r"in the pool; chunk bytes \(value-bytes-per-block\) 889 here, 100 in the pool\)"):  # fmt: skip
        attach_layout(pool.attach(), other, "sim")
    assert (len(pool), pool.num_used_blocks, list(pool.markers)) == (0, 0, [LAYOUT_KEY])  # no block's capacity


def test_a_marker_key_holding_other_bytes_is_refused():
    pool = SimPool(64)
    pool.markers[LAYOUT_KEY] = b"not a marker"
    with pytest.raises(PoolLayoutError, match=r"kvgate/v1/layout holds 12 bytes that are no kvgate layout marker"):
        attach_layout(pool.attach(), PoolLayout(16, 1, 100, BS, 1), "sim")


class SilentClient(SimPoolClient):
    """A client whose pool does not answer (a Mooncake master that is down)."""

    def put_marker(self, key: str, value: bytes) -> bytes | None:
        return None


def test_a_pool_that_does_not_answer_is_attached_unchecked_and_logged(caplog: pytest.LogCaptureFixture):
    pool = SimPool(64)
    client = SilentClient(pool, 1)
    assert attach_layout(client, PoolLayout(16, 1, 100, BS, 1), "127.0.0.1:1") is None
    assert pool.markers == {}
    assert [r.getMessage() for r in caplog.records] == [
        "pool 127.0.0.1:1 did not take or return its layout marker (kvgate/v1/layout): the layout was not checked"]
