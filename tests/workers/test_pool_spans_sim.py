"""Pool spans on the in-process sim pool: its capacity counts a span's blocks, and it evicts a span whole, which
the worker that stored it announces for every member."""

from __future__ import annotations

import pytest

from common.pool_keys import key_num_blocks, span_key
from events.types import BlockRemoved, Medium
from tests.workers.test_pool_tier import prefill, worker
from workers.kv.hashing import to_engine_hash
from workers.kv.pool_tier import SimPool, pool_key

pytestmark = pytest.mark.unit

BS = 4


def test_the_sim_pool_counts_span_members_and_evicts_a_span_whole():
    pool = SimPool(44)
    a, b = worker(pool, 64), worker(pool, 64)
    seq, _ = prefill(a, "a", [3000 + i for i in range(40 * BS)])
    (job,), _ = a.take_pool_copies()
    assert len(job.src_block_ids) == 40
    a.complete_store(job.job_id)
    h = seq.block_hashes
    spans = [span_key(h[0:16]), span_key(h[16:32])]
    assert pool.keys() == [*spans, *(pool_key(x) for x in h[32:40])]
    assert [key_num_blocks(k) for k in pool.keys()] == [16, 16] + [1] * 8
    assert pool.num_used_blocks == 40 and len(pool) == 10
    a.take_events()
    other, _ = prefill(b, "b", [7000 + i for i in range(16 * BS)])  # one span: 16 more blocks, 4 free
    (job_b,), _ = b.take_pool_copies()
    b.complete_store(job_b.job_id)
    assert pool.keys() == [spans[1], *(pool_key(x) for x in h[32:40]), span_key(other.block_hashes)]
    assert pool.num_used_blocks == 40 and pool.num_evicted == 1
    assert a.take_events() == [BlockRemoved(block_hashes=tuple(map(to_engine_hash, h[0:16])), medium=Medium.MOONCAKE)]
    assert a.pool is not None and a.pool.block_counts() == {
        "num_blocks_stored_here": 24, "num_used_blocks": 40, "num_free_blocks": 4}  # fmt: skip
    # a span larger than the whole pool is refused, as a full Mooncake refuses a put
    small = SimPool(8)
    c = worker(small, 64)
    prefill(c, "c", [9000 + i for i in range(16 * BS)])
    (job_c,), _ = c.take_pool_copies()
    c.complete_store(job_c.job_id)
    assert len(small) == 0 and c.pool is not None and c.pool.num_stores_failed == 16
