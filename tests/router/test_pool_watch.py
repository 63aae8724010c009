"""The pool watcher against a real ``mooncake_master``: a worker stores into the pool through the Mooncake client,
its events feed the index, and what the master no longer holds (removed, lost in a restart, unreachable past the
TTL) leaves the index, by sweep or by a decision check."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import BatchEncoder
from events.types import Medium
from loadgen.mooncake_master import MooncakeMaster
from router.block_hash import hash_token_blocks
from router.index import PrefixIndex
from router.index.config import IndexConfig
from router.index.result import WorkerMatch
from router.pool_watch import PoolWatcher, parse_counters, parse_pool_key
from router.pool_watch_config import PoolWatchConfig
from tests.mooncake_master import running_master

BS = 4
H = "ab" * 24 + "0123456789abcdef"  # 64 hex digits; the last 16 are the engine hash


def test_pool_keys_of_both_engines_name_their_group_and_engine_hash():
    eh = 0x0123456789ABCDEF
    assert parse_pool_key(f"kvgate/v1/{H}") == (0, eh)
    assert parse_pool_key(f"kvgate/v1/ckpt/2/{H}") == (2, eh)
    assert parse_pool_key(f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{H}") == (0, eh)
    assert parse_pool_key(f"tiny@tp_rank:1@pcp0@dcp0@pp_rank:0@group:3@{H}") == (3, eh)
    for other in ("raw/1/2", f"other/{H}", f"kvgate/v1/x/{H}", f"kvgate/v1/ckpt/x/{H}", H[:-1] + "g", ""):
        assert parse_pool_key(other) is None
    assert parse_counters("# HELP x\nmaster_key_count 12\nmaster_evicted_key_count 3.0\nlab{a=\"b\"} 1\n") == {
        "master_key_count": 12.0, "master_evicted_key_count": 3.0}


def test_the_config_refuses_a_ttl_longer_than_the_lease():
    with pytest.raises(ValueError, match="lease_ttl_s"):
        PoolWatchConfig(admin_url="http://127.0.0.1:1", lease_ttl_s=2.0, entry_ttl_s=3.0)
    with pytest.raises(ValueError, match="interval_s"):
        PoolWatchConfig(admin_url="http://127.0.0.1:1", lease_ttl_s=2.0, entry_ttl_s=2.0, interval_s=2.0)


pytest.importorskip("mooncake.store")

from workers.config import KVCacheConfig  # noqa: E402
from workers.kv.manager import KVCacheManager, SequenceKV  # noqa: E402
from workers.kv.pool_tier import MooncakePoolStore, pool_key  # noqa: E402


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with running_master(lease_ttl_ms=2000) as m:
        yield m


class Writer:
    """Worker ``a`` storing prompts into the pool, its events applied to a two-member index as they come."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.store = MooncakePoolStore(master.address, global_segment_size=32 << 20, local_buffer_size=16 << 20)
        self.kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=64, block_size=BS), pool_store=self.store)
        self.index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
        self._decoder, self._encoder, self._seq = EventDecoder(EventCounters()), BatchEncoder("vllm"), 0

    def serve(self, tokens: list[int]) -> SequenceKV:
        seq = SequenceKV(f"r{self._seq}")
        assert self.kv.admit(seq, self.kv.find_prefix(seq, tokens, len(tokens)), len(tokens))
        self.kv.cache_computed(seq, tokens, len(tokens), len(tokens))
        for job in self.kv.take_pool_copies()[0]:
            self.kv.complete_store(job.job_id)
        self.kv.free(seq)
        batch = self._decoder.decode(self._encoder.encode(self.kv.take_events(), time.time(), 0), worker_id="a",
                                     seq=self._seq)  # fmt: skip
        assert batch is not None
        self.index.apply(batch)
        self._seq += 1
        return seq

    def close(self) -> None:
        self.store.close()


def watcher_for(
    master: MooncakeMaster, index: PrefixIndex, clock: list[float], budget_s: float = 0.0, span_len: int | None = None
) -> PoolWatcher:
    config = PoolWatchConfig(admin_url=master.admin_url, lease_ttl_s=2.0, entry_ttl_s=2.0, interval_s=0.5,
                             request_timeout_s=1.0, decision_check_budget_s=budget_s,
                             blocks_per_span=span_len)  # fmt: skip
    return PoolWatcher(config, {"m": index}, clock=lambda: clock[0])


PROMPT = [7000 + i for i in range(4 * BS)] + [1]


@pytest.mark.integration
async def test_a_sweep_drops_exactly_the_blocks_the_master_no_longer_holds(master: MooncakeMaster):
    writer = Writer(master)
    clock = [100.0]
    watcher = watcher_for(master, writer.index, clock)
    await watcher.open()
    try:
        seq = writer.serve(PROMPT)
        hashes = hash_token_blocks(PROMPT, BS)
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 4)
        assert await watcher.sweep() and watcher.num_entries_dropped == 0 and watcher.master_key_count == 5  # + marker
        writer.store.remove([pool_key(seq.block_hashes[2])])  # as the master's eviction would
        assert await watcher.sweep()
        assert watcher.num_entries_dropped == 1
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 2)
        assert writer.index.match(hashes).get("a") == WorkerMatch("a", 0, 4, 0, 0)  # its GPU copies stay
        assert watcher.last_sweep_s > 0 and watcher.is_master_up
    finally:
        await watcher.close()
        writer.close()


@pytest.mark.integration
async def test_a_master_down_past_the_ttl_clears_the_pool_and_a_restarted_one_keeps_only_what_it_holds(
    master: MooncakeMaster,
):
    writer = Writer(master)
    clock = [100.0]
    watcher = watcher_for(master, writer.index, clock)
    await watcher.open()
    try:
        writer.serve(PROMPT)
        hashes = hash_token_blocks(PROMPT, BS)
        assert await watcher.sweep()
        master.kill()
        clock[0] = 101.0  # within entry_ttl_s of the last sweep: entries kept
        assert not await watcher.sweep() and not watcher.is_master_up
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 4)
        clock[0] = 102.5  # past it: nothing the pool held is trusted
        assert not await watcher.sweep() and watcher.num_ttl_clears == 1
        assert writer.index.match(hashes).get("b") is None
        master.start()  # same ports, empty
        deadline = time.monotonic() + 10
        while not writer.store.put(["probe"], [b"x"])[0]:  # the client remounts its segment after a ping
            assert time.monotonic() < deadline, "the worker's Mooncake client did not come back"
            time.sleep(0.2)
        other = [9000 + i for i in range(2 * BS)] + [1]
        writer.serve(other)  # the worker's client is back on the new master
        clock[0] = 103.0
        assert await watcher.sweep() and watcher.num_master_restarts == 1
        assert writer.index.match(hash_token_blocks(other, BS)).get("b") == WorkerMatch("b", 0, 0, 0, 2)
        assert writer.index.match(hashes).get("b") is None
    finally:
        await watcher.close()
        writer.close()


@pytest.mark.integration
async def test_a_decision_check_drops_a_gone_block_within_its_budget(master: MooncakeMaster):
    writer = Writer(master)
    clock = [100.0]
    watcher = watcher_for(master, writer.index, clock, budget_s=0.5)
    await watcher.open()
    try:
        seq = writer.serve(PROMPT)
        hashes = hash_token_blocks(PROMPT, BS)
        assert await watcher.sweep()
        assert await watcher.check("m", hashes) == 0 and watcher.num_checks == 1
        writer.store.remove([pool_key(seq.block_hashes[1])])
        assert await watcher.check("m", hashes) == 1 and watcher.num_check_drops == 1
        assert writer.index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 1)
        assert 0 < watcher.last_check_s < 0.5
        tight = watcher_for(master, writer.index, clock, budget_s=1e-6)
        await tight.open()
        try:
            assert await tight.sweep()
            assert await tight.check("m", hashes) == 0 and tight.num_checks_unanswered == 1  # too late: unchanged
        finally:
            await tight.close()
    finally:
        await watcher.close()
        writer.close()


@pytest.mark.integration
async def test_a_decision_check_asks_the_master_about_keys_it_would_misread_raw(master: MooncakeMaster):
    """vLLM keys carry the model name: ``+``, ``%``, ``&`` and ``#`` in it reach the master intact (percent-encoded);
    a key with a comma, which the master splits even when encoded, is not asked about."""
    from events.types import BlockStored, EngineBlockHash, EventBatch

    store = MooncakePoolStore(master.address, global_segment_size=32 << 20, local_buffer_size=16 << 20)
    index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: ["a", "b"]})
    clock = [100.0]
    watcher = watcher_for(master, index, clock, budget_s=0.5)
    await watcher.open()
    try:
        models = ["org/m+x%41&y#z", "org/m+x%41&y#z", "org/m+x%41&y#z", "org/m,v"]
        digests = [f"{0xABC0 + i:064x}" for i in range(4)]
        keys = [f"{m}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d}" for m, d in zip(models, digests, strict=True)]
        assert store.put(keys, [b"v" * 64] * 4) == [True] * 4
        assert all(parse_pool_key(k) == (0, 0xABC0 + i) for i, k in enumerate(keys))
        stored = BlockStored(block_hashes=tuple(EngineBlockHash(0xABC0 + i) for i in range(4)), parent_block_hash=None,
                             token_ids=tuple(PROMPT[: 4 * BS]), block_size=BS, medium=Medium.MOONCAKE)  # fmt: skip
        index.apply(EventBatch("a", 0, 0, time.time(), (stored,)))
        hashes = hash_token_blocks(PROMPT, BS)
        assert index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 4)
        assert await watcher.sweep() and watcher.master_key_count == 4 and watcher.num_entries_dropped == 0
        assert await watcher.check("m", hashes) == 0  # raw, every key but the comma one read as another: 3 drops
        assert index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 4)
        store.remove([keys[1], keys[3]])
        assert await watcher.check("m", hashes) == 1 and watcher.num_check_drops == 1  # block 1; block 3 not asked
        assert index.match(hashes).get("b") == WorkerMatch("b", 0, 0, 0, 1)
        assert await watcher.sweep() and watcher.num_entries_dropped == 2  # the sweep finds the comma key gone
    finally:
        await watcher.close()
        store.close()
