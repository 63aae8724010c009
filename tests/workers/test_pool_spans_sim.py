"""Pool spans on the in-process sim pool: its capacity counts a span's blocks, and it evicts a span whole, which
the worker that stored it announces for every member."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from common.pool_keys import key_num_blocks, span_key
from events.types import BlockRemoved, Medium
from tests.workers.test_pool_tier import prefill, worker
from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import extend_block_hashes, namespace_root, to_engine_hash
from workers.kv.pool_spans import objects_of, positions_of, store_objects
from workers.kv.pool_tier import PoolTier, SimPool, SimPoolClient, pool_key

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


class CountingClient(SimPoolClient):
    """A sim pool client that records each existence check's keys."""

    def __init__(self, pool: SimPool) -> None:
        super().__init__(pool, 0)
        self.checks: list[list[str]] = []

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.checks.append(list(keys))
        return super().exists(keys)


def test_a_lookup_is_one_existence_check_and_a_second_only_inside_a_missing_span():
    client = CountingClient(SimPool(256))
    tier = PoolTier(client, BS, lambda event: None)
    tokens = [4000 + i for i in range(50 * BS)]
    hashes = extend_block_hashes([], namespace_root(), tokens, BS)
    metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), i)
             for i, h in enumerate(hashes)]  # fmt: skip
    assert len(tier.prepare_store(1, hashes[:40], metas[:40])) == 40
    tier.complete_store(1)
    client.checks.clear()
    spans = [span_key(hashes[k : k + 16]) for k in (0, 16, 32)]
    # all 40 blocks, then 10 more the pool never saw: span 2 is missing, its first 8 blocks are singles
    hit = tier.lookup(hashes, 3, 50)
    assert hit.num_blocks == 37 and [o.key for o in hit.objects[:2]] == spans[:2]
    assert client.checks == [[*spans, pool_key(hashes[48]), pool_key(hashes[49])],
                             [pool_key(h) for h in hashes[32:47]]]  # fmt: skip
    client.checks.clear()
    hit = tier.lookup(hashes, 20, 30)  # inside span 1: one check, of that span alone
    assert (hit.num_blocks, [o.key for o in hit.objects], client.checks) == (10, spans[1:2], [spans[1:2]])
    client.checks.clear()
    assert tier.lookup(hashes[:40], 0, 40).num_blocks == 40 and len(client.checks) == 1
    assert tier.lookup(hashes, 45, 45).num_blocks == 0


@pytest.mark.parametrize("first", [0, 5, 16])
@pytest.mark.parametrize("span_len", [2, 16])
def test_a_store_jobs_objects_are_its_spans_under_span_key_and_its_singles_under_pool_key(first: int, span_len: int):
    tokens = [9000 + i for i in range(60 * BS)]
    hashes = extend_block_hashes([], namespace_root(), tokens, BS)
    metas = [BlockMeta(h, hashes[d - 1] if d else None, tuple(tokens[d * BS : (d + 1) * BS]), d)
             for d, h in enumerate(hashes)][first:]  # fmt: skip
    want: list[tuple[str, int, int]] = []
    i = 0
    while i < len(metas):
        if (first + i) % span_len == 0 and i + span_len <= len(metas):
            want.append((span_key(hashes[first + i : first + i + span_len]), i, i + span_len))
            i += span_len
        else:
            want += [(pool_key(hashes[first + i]), i, i + 1)] if i >= 3 else []
            i += 1
    got = store_objects(metas, span_len, 3)
    assert got == want
    num_spans = sum(1 for k, _, _ in got if key_num_blocks(k) > 1)
    counts = {(0, 16): (3, 12), (5, 16): (2, 20), (16, 16): (2, 12), (0, 2): (30, 0), (5, 2): (27, 0), (16, 2): (22, 0)}
    assert (num_spans, len(got) - num_spans) == counts[first, span_len]


def test_a_jobs_positions_are_every_position_of_its_objects_in_order():
    assert positions_of([("a", 0, 16), ("b", 16, 17), ("c", 17, 18)]) == list(range(18))
    assert positions_of([("a", 0, 16), ("c", 17, 18)]) == [*range(16), 17]
    assert positions_of([("b", 3, 4), ("c", 5, 7)]) == [3, 5, 6]
    assert positions_of([]) == []


def test_a_restore_planned_from_objects_that_do_not_hold_its_blocks_raises():
    tier = PoolTier(SimPool(64).attach(), BS, lambda event: None, blocks_per_span=16)

    def chain(base: int) -> list[BlockMeta]:
        tokens = [base + i for i in range(20 * BS)]
        hashes = extend_block_hashes([], namespace_root(), tokens, BS)
        return [BlockMeta(h, hashes[d - 1] if d else None, tuple(tokens[d * BS : (d + 1) * BS]), d)
                for d, h in enumerate(hashes)]  # fmt: skip

    a, b = chain(1000), chain(5000)
    assert len(tier.prepare_store(1, [m.block_hash for m in a], a)) == 20
    tier.complete_store(1)
    objects = objects_of(a, 16)
    assert [o.num_blocks for o in objects] == [16, 1, 1, 1, 1] and tier.fetch(a, objects) == 20
    assert tier.fetch(a[3:18], objects) == 15  # from inside the span, ending before the last single
    with pytest.raises(RuntimeError, match="do not hold"):  # another chain's objects, all in the pool
        tier.fetch(b, objects)
    with pytest.raises(RuntimeError, match="do not hold"):  # a single left out: a gap in the plan
        tier.fetch(a, [objects[0], *objects[2:]])
