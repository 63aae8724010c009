"""The pool watcher and kvgate span objects (16 blocks of a chain in one Mooncake object): the key names every
member, so a sweep and a decision check keep exactly the blocks some object still holds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.pool_keys import LAYOUT_KEY, member_engine_hashes, span_key
from events.types import Medium
from router.block_hash import hash_token_blocks
from router.index import PrefixIndex
from router.index.config import IndexConfig
from router.index.result import WorkerMatch
from router.pool_watch import parse_pool_key, pool_key_blocks
from tests.mooncake_master import running_master
from tests.router.test_pool_watch import BS, H, Writer, watcher_for

pytest.importorskip("mooncake.store")

from loadgen.mooncake_master import MooncakeMaster  # noqa: E402
from workers.kv.block_pool import BlockMeta  # noqa: E402
from workers.kv.hashing import (  # noqa: E402
    extend_block_hashes,
    namespace_root,
    to_engine_hash,  # noqa: E402
)
from workers.kv.pool_tier import MooncakePoolStore, PoolTier, pool_key  # noqa: E402


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
        assert sorted(master.keys()) == sorted([LAYOUT_KEY, span, *(pool_key(h) for h in seq.block_hashes[16:20])])
        assert pool_key_blocks(span) == tuple((0, to_engine_hash(h)) for h in seq.block_hashes[0:16])
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 20)
        assert await watcher.sweep() and watcher.num_entries_dropped == 0 and watcher.master_key_count == 6
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


@pytest.mark.integration
async def test_a_sweep_counts_and_logs_the_spans_of_another_length(master: MooncakeMaster,
                                                                   caplog: pytest.LogCaptureFixture):  # fmt: skip
    store = MooncakePoolStore(master.address, global_segment_size=16 << 20, local_buffer_size=8 << 20)
    try:
        tokens = [9000 + i for i in range(16 * BS)]
        hashes = extend_block_hashes([], namespace_root(), tokens, BS)
        metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), i)
                 for i, h in enumerate(hashes)]  # fmt: skip
        tier = PoolTier(store, BS, lambda event: None, blocks_per_span=8)  # alone in the pool: its marker says 8
        assert tier.prepare_store(1, hashes, metas) == list(range(16))
        tier.complete_store(1)
        spans = [span_key(hashes[0:8]), span_key(hashes[8:16])]
        assert sorted(master.keys()) == sorted([LAYOUT_KEY, *spans])
        index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a"]})
        watcher = watcher_for(master, index, [100.0], span_len=16)
        await watcher.open()
        try:
            assert await watcher.sweep()
            assert (watcher.num_span_length_mismatches, watcher.num_foreign_keys, watcher.master_key_count) == (2, 0, 3)
            assert await watcher.sweep() and watcher.num_span_length_mismatches == 4  # each sweep counts its own
            logged = [r.getMessage() for r in caplog.records if "spans of" in r.getMessage()]
            said = [f"pool watch: the master at {master.admin_url} holds spans of 8 blocks ({key[:40]}...), the pool's "
                    "workers use 16 (pool_watch.blocks_per_span): a worker of another span length stores spans the "
                    "others never look up" for key in spans]  # fmt: skip
            assert logged in ([said[0]], [said[1]])  # once, naming the first such key of the listing
        finally:
            await watcher.close()
    finally:
        store.close()


@pytest.mark.integration
async def test_after_an_answer_a_pool_block_the_master_evicted_is_a_forecast_miss_not_a_wrong_index(
    master: MooncakeMaster,
):
    writer = Writer(master)
    watcher = watcher_for(master, writer.index, [100.0])  # decision checks off: the confirmation is its own
    await watcher.open()
    try:
        seq = writer.serve(PROMPT)
        hashes = hash_token_blocks(PROMPT, BS)
        assert await watcher.sweep() and writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 20)
        stamp = writer.index.open_journal_window()  # the decision
        writer.store.remove([span_key(seq.block_hashes[0:16])])  # the master evicts, telling no one
        assert writer.index.miss_cause("b", hashes, 0, 16, stamp) is None  # nothing explains it: "index"
        assert await watcher.confirm_gone("m", hashes[4:16]) == 12  # the blocks worker b did not serve
        assert (watcher.num_confirms, watcher.num_confirm_drops, watcher.num_checks) == (1, 12, 0)
        assert writer.index.miss_cause("b", hashes, 4, 16, stamp) == "evicted"
        assert await watcher.confirm_gone("m", hashes[16:20]) == 0  # still held: a wrong index it would stay
        assert watcher.num_confirms == 2
        writer.index.close_journal_window(stamp)
    finally:
        await watcher.close()
        writer.close()
