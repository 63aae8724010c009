"""Adversarial event streams over real ZMQ sockets on 127.0.0.1: what one worker sends (or how it is removed)
never stalls the subscriber for the others, and malformed input leaves the index exactly as it was."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.counters import DropKind
from events.encode import encode_batch
from events.subscriber import KVEventSubscriber, SubscriberConfig, WorkerSpec
from events.types import BlockStored, EngineBlockHash, EventBatch, Resync
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BLOCK_SIZE = 4


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(EngineBlockHash(x) for x in hashes),
        parent_block_hash=None if parent is None else EngineBlockHash(parent),
        token_ids=tuple(range(BLOCK_SIZE * len(hashes))),
        block_size=BLOCK_SIZE,
    )


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_bound_topology_keeps_reading_after_removing_a_worker_whose_queue_was_full(ctx):
    """Worker ``slow`` fills its stream's queue while a replay of its gap hangs (its replay ROUTER never answers),
    so the shared reader of the bound SUB waits for room in that queue. Removing ``slow`` must release the reader:
    the other worker's batches keep arriving."""
    records: list[EventBatch | Resync] = []
    config = SubscriberConfig(bind_endpoint="tcp://127.0.0.1:*", replay_timeout_s=60.0, max_pending_batches=2)
    sub = KVEventSubscriber(config, records.append, context=ctx)
    await sub.start()
    silent = ctx.socket(zmq.ROUTER)  # accepts the replay request, never answers
    silent.bind("tcp://127.0.0.1:*")
    sub.add_worker(WorkerSpec(worker_id="slow", replay_endpoint=silent.getsockopt(zmq.LAST_ENDPOINT).decode()))
    sub.add_worker(WorkerSpec(worker_id="other"))
    pub = ctx.socket(zmq.PUB)
    pub.connect(sub.bound_endpoint)
    try:
        async with asyncio.timeout(5):  # past the ZMQ join
            while sub.last_seq("slow") is None:
                await pub.send_multipart([b"kv@slow@m", (0).to_bytes(8, "big"), encode_batch([stored(1)], 1.0, 0)])
                await asyncio.sleep(0.01)
        # A gap (seq 5 after 0): the stream asks the silent replay endpoint and waits; then its queue fills.
        for seq in range(5, 10):
            await pub.send_multipart([b"kv@slow@m", seq.to_bytes(8, "big"), encode_batch([stored(seq)], 1.0, 0)])
        await until(lambda: sub.counters.num_replay_requests["slow"] == 1)
        await until(lambda: not sub._streams[("slow", 0)].space.is_set())
        assert sub.remove_worker("slow") is True
        await pub.send_multipart([b"kv@other@m", (0).to_bytes(8, "big"), encode_batch([stored(42)], 1.0, 0)])
        await until(lambda: sub.last_seq("other") == 0)
        assert [(r.worker_id, r.seq, r.events) for r in records if isinstance(r, EventBatch)] == [
            ("slow", 0, (stored(1),)), ("other", 0, (stored(42),))]
    finally:
        pub.close(linger=0)
        silent.close(linger=0)
        await sub.aclose()


def make_index_sink(index: PrefixIndex):
    def sink(record: EventBatch | Resync) -> None:
        if isinstance(record, Resync):
            index.apply_resync(record)
        else:
            index.apply(record)

    return sink


def stored_map(hashes: list[object], parent: object, token_ids: list[object], block_size: object = BLOCK_SIZE,
               **extra: object) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, **extra}


async def test_malformed_input_is_counted_by_kind_and_leaves_the_index_exactly_as_it_was(ctx):
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE))
    sub = KVEventSubscriber(SubscriberConfig(default_block_size=BLOCK_SIZE), make_index_sink(index), context=ctx)
    await sub.start()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    sub.add_worker(WorkerSpec(worker_id="w", endpoint=pub.getsockopt(zmq.LAST_ENDPOINT).decode()))

    async def send(seq: int, body: object) -> None:
        raw = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), raw])

    try:
        async with asyncio.timeout(5):  # past the ZMQ join: one good batch of 2 blocks (engine hashes 11, 12)
            while sub.last_seq("w") is None:
                await send(0, [1.0, [stored_map([11, 12], None, list(range(8)))], 0])
                await asyncio.sleep(0.01)
        ours = hash_token_blocks(list(range(8)), BLOCK_SIZE)
        dump = index.dump_worker("w")
        assert [c.block_hashes for c in dump] == [tuple(ours)]
        stats = index.stats()
        bad: list[object] = [
            b"\xc1garbage",                                                      # never valid msgpack
            msgspec.msgpack.encode([1.0, [stored_map([13], 12, list(range(4)))], 0])[:-3],  # truncated
            [1.0, [["NewKindOfEvent", [13]], {"type": "Evicted", "block_hashes": [13]}], 0],  # unknown tags
            [1.0, [stored_map([13, 14], 12, list(range(5)))], 0],              # 5 tokens for 2 blocks of 4
            [1.0, [stored_map([13], 12, list(range(8)), block_size=8)], 0],    # another GPU block size
            [1.0, [stored_map([13, 13], 12, list(range(8)))], 0],              # a repeated hash
            [1.0, [stored_map([13], 12, [-1, 0, 1, 2])], 0],                   # a token id out of range
            [1.0, [stored_map([13], 12, list(range(4)), medium="VRAM")], 0],   # an unknown medium
            [1.0, [stored_map([13], 12, list(range(4)))], 7],                  # a dp rank the worker lacks
            [1.0, [stored_map([13], 12, list(range(4)))], -1],                 # a negative dp rank
            [1.0, [stored_map([13], 12, list(range(4)), locality="REMOTE")], 0],  # blocks not on this worker
            [1.0, [{"type": "BlockStored", "block_hashes": [13]}], 0],         # fields missing
            {"events": []},                                                    # no ts
            "a string",                                                        # wrong outer shape
        ]
        for seq, body in enumerate(bad, start=1):
            await send(seq, body)
        await until(lambda: sub.counters.total_drops() >= 15)
        await asyncio.sleep(0.05)  # nothing else arrives
        assert dict(sub.counters.drops) == {
            ("w", DropKind.MALFORMED_PAYLOAD): 4,
            ("w", DropKind.UNKNOWN_EVENT): 2,
            ("w", DropKind.TOKEN_COUNT_MISMATCH): 1,
            ("w", DropKind.BLOCK_SIZE_MISMATCH): 1,
            ("w", DropKind.REPEATED_HASH): 1,
            ("w", DropKind.MALFORMED_EVENT): 2,
            ("w", DropKind.UNKNOWN_MEDIUM): 1,
            ("w", DropKind.UNKNOWN_DP_RANK): 2,
            ("w", DropKind.REMOTE_LOCALITY): 1,
        }
        assert sub.counters.resyncs == {}
        # Every refused batch consumed its seq (those of unknown ranks too: one endpoint, one publisher), so there
        # was no gap and no resync: the stream is at 14, not stalled, and the next good batch extends the chain.
        assert sub.last_seq("w") == 14
        assert index.dump_worker("w") == dump and index.stats() == stats
        index.check_invariants()
        await send(15, [1.0, [stored_map([13], 12, list(range(8, 12)))], 0])
        await until(lambda: sub.last_seq("w") == 15)
        assert [c.block_hashes for c in index.dump_worker("w")] == [tuple(hash_token_blocks(list(range(12)),
                                                                                             BLOCK_SIZE))]
    finally:
        pub.close(linger=0)
        await sub.aclose()


async def test_rankless_batches_take_the_rank_of_the_endpoint_they_came_from(ctx):
    """vLLM before 0.10 sends ``[ts, events]`` without a dp rank; with data parallelism each rank publishes on its
    own port with its own seqs. Rank 1's batches must go to rank 1's stream, not interleave with rank 0's."""
    records: list[EventBatch | Resync] = []
    sub = KVEventSubscriber(SubscriberConfig(default_block_size=BLOCK_SIZE), records.append, context=ctx)
    await sub.start()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    for rank, pub in enumerate(pubs):
        pub.bind("tcp://127.0.0.1:*")
        sub.add_worker(WorkerSpec(worker_id="w", endpoint=pub.getsockopt(zmq.LAST_ENDPOINT).decode(), dp_rank=rank))
    try:
        async with asyncio.timeout(5):  # past the ZMQ join of both
            for rank, pub in enumerate(pubs):
                while sub.last_seq("w", rank) is None:
                    await pub.send_multipart([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, []])])
                    await asyncio.sleep(0.01)
        for seq in (1, 2, 3):
            for rank, pub in enumerate(pubs):
                body = msgspec.msgpack.encode([1.0, [stored_map([100 * rank + seq], None, list(range(4)))]])
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), body])
        await until(lambda: sub.last_seq("w", 0) == 3 and sub.last_seq("w", 1) == 3)
        assert sub.counters.resyncs == {} and sub.counters.drops == {}
        got = sorted((r.dp_rank, r.seq, r.events[0].block_hashes) for r in records if isinstance(r, EventBatch))
        assert got == [(0, 1, (1,)), (0, 2, (2,)), (0, 3, (3,)), (1, 1, (101,)), (1, 2, (102,)), (1, 3, (103,))]
    finally:
        for pub in pubs:
            pub.close(linger=0)
        await sub.aclose()
