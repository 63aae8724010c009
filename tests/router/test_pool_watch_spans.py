"""The pool watcher and kvgate span objects (16 blocks of a chain in one Mooncake object): the key names every
member, so a sweep and a decision check keep exactly the blocks some object still holds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.pool_keys import member_engine_hashes, span_key
from router.block_hash import hash_token_blocks
from router.index.result import WorkerMatch
from router.pool_watch import parse_pool_key, pool_key_blocks
from tests.mooncake_master import running_master
from tests.router.test_pool_watch import BS, H, Writer, watcher_for

pytest.importorskip("mooncake.store")

from loadgen.mooncake_master import MooncakeMaster  # noqa: E402
from workers.kv.hashing import to_engine_hash  # noqa: E402
from workers.kv.pool_tier import pool_key  # noqa: E402


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with running_master(lease_ttl_ms=2000) as m:
        yield m


PROMPT = [8000 + i for i in range(20 * BS)] + [1]  # 20 blocks: span 0 (blocks 0-15), singles 16-19


def test_a_span_key_names_its_members_in_chain_order():
    members = [bytes(24) + i.to_bytes(8, "big") for i in range(1, 16)] + [bytes.fromhex(H)]
    key = span_key(members)
    assert len(key) == 80 + 16 * 15
    assert member_engine_hashes(key) == (*range(1, 16), 0x0123456789ABCDEF)
    assert pool_key_blocks(key) == tuple((0, h) for h in (*range(1, 16), 0x0123456789ABCDEF))
    assert parse_pool_key(key) is None  # several blocks: not one block's key
    assert pool_key_blocks(f"kvgate/v1/{H}") == ((0, 0x0123456789ABCDEF),)
    for bad in (key[:-1], key.replace("/", "//", 3), key[:20] + "G" + key[21:], "kvgate/v1/span/" + "0" * 15 + "/" + H,
                "kvgate/v1/span//" + H):  # fmt: skip
        assert member_engine_hashes(bad) is None and pool_key_blocks(bad) is None


@pytest.mark.integration
async def test_a_sweep_and_a_check_drop_exactly_the_members_of_a_span_gone(master: MooncakeMaster):
    writer = Writer(master)
    clock = [100.0]
    watcher = watcher_for(master, writer.index, clock, budget_s=0.5)
    await watcher.open()
    try:
        seq = writer.serve(PROMPT)
        hashes = hash_token_blocks(PROMPT, BS)
        span = span_key(seq.block_hashes[0:16])
        assert sorted(master.keys()) == sorted([span, *(pool_key(h) for h in seq.block_hashes[16:20])])
        assert pool_key_blocks(span) == tuple((0, to_engine_hash(h)) for h in seq.block_hashes[0:16])
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 20)
        assert await watcher.sweep() and watcher.num_entries_dropped == 0 and watcher.master_key_count == 5
        assert await watcher.check("m", hashes) == 0
        writer.store.remove([pool_key(seq.block_hashes[18])])  # a single gone: that block only
        assert await watcher.sweep() and watcher.num_entries_dropped == 1
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 18)
        writer.store.remove([span])  # the span gone: its 16 members, found by the decision check
        assert await watcher.check("m", hashes) == 16 and watcher.num_check_drops == 16
        assert writer.index.match(hashes).get("b") is None
        assert await watcher.sweep() and watcher.num_entries_dropped == 1 + 16
    finally:
        await watcher.close()
        writer.close()
