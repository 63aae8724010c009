"""A pool block another member put, evicted by the master before the serving worker's lookup and put back by that
worker before its answer: when the pool watcher asks the master, the block is present again, so the confirmation
alone reads the miss as a wrong index. The worker's put, journaled by the index (``router.index.pool_restores``)
and read again once the confirmation is answered, makes it a forecast miss; a genuine wrong index stays one.

Real components: a ``mooncake_master``, one Mooncake client per worker (``workers.kv`` managers), each worker's KV
events over a real ZMQ PUB/SUB pair into the prefix index, the pool watcher over HTTP, and the request lifecycle's
mismatch count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import pytest

from events.publisher import KVEventPublisher, PublisherConfig
from events.subscriber import KVEventSubscriber, SubscriberConfig, WorkerSpec
from events.types import EventBatch, KVEvent, Medium, Resync
from loadgen.mooncake_master import MooncakeMaster
from router.block_hash import hash_token_blocks
from router.config import ModelConfig
from router.index import IndexConfig, PrefixIndex
from router.index.result import WorkerMatch
from router.lifecycle import RequestLifecycle
from router.metrics import GatewayMetrics
from router.pool_watch import PoolWatcher
from router.pool_watch_config import PoolWatchConfig
from router.request_view import PromptView
from router.routing import IndexTicket
from tests.mooncake_master import running_master

pytest.importorskip("mooncake.store")

from workers.config import KVCacheConfig  # noqa: E402
from workers.kv.manager import KVCacheManager, SequenceKV  # noqa: E402
from workers.kv.pool_tier import MooncakePoolStore, pool_key  # noqa: E402

pytestmark = pytest.mark.integration

BS = 4
PROMPT = [5000 + i for i in range(4 * BS)] + [1]  # 4 full blocks (singles in the pool) and one token
HASHES = hash_token_blocks(PROMPT, BS)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


class Member:
    """A worker attached to the pool: a KV manager with its own Mooncake client, its events on a ZMQ PUB."""

    def __init__(self, worker_id: str, master: MooncakeMaster) -> None:
        self.worker_id = worker_id
        self.store = MooncakePoolStore(master.address, global_segment_size=16 << 20, local_buffer_size=8 << 20)
        self.kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=32, block_size=BS), pool_store=self.store)
        self.pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", linger_s=0.0))
        self.seq_kv: list[SequenceKV] = []

    def serve(self, tokens: list[int]) -> tuple[int, list[KVEvent]]:
        """Serve a prompt as the engine does (lookup, restore of the pool hit, compute, write-through put); the
        cached tokens it reports and the events it will publish."""
        seq = SequenceKV(f"{self.worker_id}-{len(self.seq_kv)}")
        self.seq_kv.append(seq)
        assert self.kv.admit(seq, self.kv.find_prefix(seq, tokens, len(tokens)), len(tokens))
        for restore in self.kv.take_pool_copies()[1]:
            assert self.kv.complete_restore(restore.job_id) is seq
        num_cached_tokens = seq.num_cached_blocks * BS
        self.kv.cache_computed(seq, tokens, len(tokens), len(tokens))
        for job in self.kv.take_pool_copies()[0]:
            self.kv.complete_store(job.job_id)
        self.kv.free(seq)
        return num_cached_tokens, self.kv.take_events()

    def close(self) -> None:
        self.pub.close()
        self.store.close()


class GatedWatcher(PoolWatcher):
    """The pool watcher, whose confirmation answers only once ``answer_when()`` holds (``None``: at once)."""

    answer_when: Callable[[], bool] | None = None

    async def confirm_gone(self, model: str, block_hashes: Sequence[int]) -> int:
        gone = await super().confirm_gone(model, block_hashes)
        if self.answer_when is not None:
            await until(self.answer_when)
        return gone


class Gateway:
    """The gateway's side: the index fed by a ZMQ subscriber, the pool watcher, the mismatch counts."""

    def __init__(self, master: MooncakeMaster, members: Sequence[Member]) -> None:
        members_ids = [m.worker_id for m in members]
        self.index = PrefixIndex(IndexConfig(block_size=BS), pool_members={Medium.MOONCAKE: members_ids})
        self.sub = KVEventSubscriber(SubscriberConfig(default_block_size=BS), self._sink)
        self.members = members
        config = PoolWatchConfig(admin_url=master.admin_url, lease_ttl_s=2.0, entry_ttl_s=2.0, interval_s=0.5,
                                 request_timeout_s=2.0)  # fmt: skip
        self.pool_watcher = GatedWatcher(config, {"m": self.index})  # what ``RequestLifecycle`` reads of its router
        self.metrics = GatewayMetrics()
        self.lifecycle = RequestLifecycle(self, None, None, None, self.metrics)  # type: ignore[arg-type]

    def _sink(self, record: EventBatch | Resync) -> None:
        assert isinstance(record, EventBatch)
        self.index.apply(record)

    async def start(self) -> None:
        await self.sub.start()
        await self.pool_watcher.open()
        for member in self.members:
            self.sub.add_worker(WorkerSpec(worker_id=member.worker_id, endpoint=member.pub.endpoint))
            await until(lambda m=member: self._ping(m))  # ZMQ slow joiner: empty batches until one arrives

    def _ping(self, member: Member) -> bool:
        if self.sub.last_seq(member.worker_id) is not None:
            return True
        member.pub.publish([])
        return False

    def is_applied(self, member: Member) -> bool:
        """Whether the index applied every batch ``member`` published."""
        return self.sub.last_seq(member.worker_id) == member.pub.next_seq - 1

    async def publish(self, member: Member, events: list[KVEvent]) -> None:
        """Publish ``events`` as ``member`` and wait until the index applied them."""
        member.pub.publish(events)
        await until(lambda: self.is_applied(member))

    def ticket(self) -> IndexTicket:
        """The decision's ticket for ``PROMPT`` (its match stamps the journals)."""
        view = PromptView(num_tokens=len(PROMPT), block_hashes=tuple(HASHES), block_size=BS)
        ticket = IndexTicket(self.index, ModelConfig(name="m", block_size=BS), view, {})
        assert ticket.match() is not None
        return ticket

    async def counted(self) -> None:
        """Wait for the mismatch confirmations in flight."""
        await until(lambda: not self.lifecycle.mismatches._confirming)

    async def close(self) -> None:
        await self.pool_watcher.close()
        await self.sub.aclose()


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with running_master(lease_ttl_ms=1000) as m:
        yield m


@pytest.fixture
async def fleet(master: MooncakeMaster) -> AsyncIterator[tuple[Gateway, Member, Member]]:
    a, b = Member("a", master), Member("b", master)
    gw = Gateway(master, [a, b])
    await gw.start()
    try:
        yield gw, a, b
    finally:
        await gw.close()
        a.close()
        b.close()


async def test_a_block_the_master_evicted_and_the_worker_put_back_before_its_answer_is_a_forecast_miss(
    fleet: tuple[Gateway, Member, Member], master: MooncakeMaster,
):
    gw, a, b = fleet
    watcher = gw.pool_watcher
    _, events = a.serve(PROMPT)
    await gw.publish(a, events)
    assert gw.index.match(HASHES).get("b") == WorkerMatch("b", 0, 0, 0, 4)  # priced: 4 pool blocks, 16 tokens
    assert await watcher.sweep()
    ticket = gw.ticket()  # the decision for b
    a_hashes = a.seq_kv[0].block_hashes
    a.store.remove([pool_key(a_hashes[2]), pool_key(a_hashes[3])])  # the master evicts a's blocks 2-3, telling no one
    reported, b_events = b.serve(PROMPT)
    assert reported == 8  # b's lookup found blocks 0-1; it computed 2-3 and put them back (absent): no loss announced
    assert set(master.keys()) >= {pool_key(h) for h in a_hashes}  # present again when the watcher asks
    # The answer reaches the gateway before b's events: nothing explains the miss yet.
    assert ticket.mismatch_cause("b", 16, reported) == "index"
    watcher.answer_when = lambda: gw.is_applied(b)  # the master answers once b's events are in
    assert gw.lifecycle.count_mismatch("b", ticket, 16, reported)  # confirming: the decision's stamp stays open
    b.pub.publish(b_events)
    await gw.counted()
    assert (watcher.num_confirms, watcher.num_confirm_drops) == (1, 0)  # the master holds blocks 2-3 again
    assert gw.metrics.worker("b").num_mismatches == {"index": 0, "evicted": 1, "pending": 0, "late": 0}
    assert gw.index.state.windows.open == {}  # the confirmation closed the decision's stamp
    assert ticket.mismatch_cause("b", 16, reported) == "evicted"  # with b's events in, no master is needed


async def test_a_genuine_wrong_index_stays_one_though_the_worker_put_its_blocks(fleet: tuple[Gateway, Member, Member]):
    gw, a, b = fleet
    _, events = a.serve(PROMPT)
    await gw.publish(a, events)
    assert await gw.pool_watcher.sweep()
    ticket = gw.ticket()
    # b gets other tokens from block 2 on than the gateway hashed (a chat template or tokenizer that disagrees):
    # it finds blocks 0-1 in the pool, computes and puts its own blocks 2-3; a's blocks 2-3 stay in the master.
    reported, b_events = b.serve(PROMPT[: 2 * BS] + [9000 + i for i in range(2 * BS)] + [1])
    assert reported == 8
    await gw.publish(b, b_events)
    assert len(gw.index.state.worker_slots("b")[0].pool_stored) == 2  # b's two puts are journaled: other blocks
    assert gw.lifecycle.count_mismatch("b", ticket, 16, reported)
    await gw.counted()
    assert (gw.pool_watcher.num_confirms, gw.pool_watcher.num_confirm_drops) == (1, 0)
    assert gw.metrics.worker("b").num_mismatches == {"index": 1, "evicted": 0, "pending": 0, "late": 0}
    assert gw.index.state.windows.open == {}
