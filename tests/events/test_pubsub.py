"""Publisher and subscriber over real ZMQ sockets on 127.0.0.1 (ephemeral ports)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.counters import DropKind
from events.encode import encode_batch
from events.errors import EventsConfigError, PublisherClosedError
from events.publisher import KVEventPublisher, PublisherConfig, bind_or_connect, offset_endpoint
from events.subscriber import KVEventSubscriber, SubscriberConfig, WorkerSpec
from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, EventBatch, Resync
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex

pytestmark = pytest.mark.integration

END = b"\xff" * 8


def stored(*hashes: int) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(EngineBlockHash(x) for x in hashes),
        parent_block_hash=None,
        token_ids=tuple(range(4 * len(hashes))),
        block_size=4,
    )


def payload(tag: int) -> bytes:
    return encode_batch([stored(tag)], 1.0, 0)


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


class FakeEngine:
    """A hand-driven vLLM-style publisher: raw PUB + ROUTER, with scripted replay answers."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.buffer: dict[int, bytes] = {}
        self.replay_order = "in_order"  # or "reversed_with_duplicates"
        self.requests: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, empty, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            seqs = sorted(q for q in self.buffer if q >= start_seq)
            if self.replay_order == "silent":  # a replay endpoint that never answers
                continue
            if self.replay_order == "never_ending":  # replies outside the asked range, and no end marker
                for _ in range(1000):
                    await self.router.send_multipart([ident, b"", (0).to_bytes(8, "big"), b"stale"])
                    await asyncio.sleep(0.02)
                continue
            if self.replay_order != "in_order":
                seqs = list(reversed(seqs)) + seqs
            for q in seqs:
                await self.router.send_multipart([ident, b"", q.to_bytes(8, "big"), self.buffer[q]])
            await self.router.send_multipart([ident, b"", END, b""])

    async def send(self, seq: int, body: bytes, *, deliver: bool = True, topic: bytes = b"") -> None:
        self.buffer[seq] = body
        if deliver:
            await self.pub.send_multipart([topic, seq.to_bytes(8, "big"), body])

    async def restart_pub(self, ctx: zmq.asyncio.Context) -> None:
        """Close the PUB socket and bind a new one at the same address; the replay ROUTER and its buffer stay
        (the same publisher, seen by a subscriber as a disconnect and a reconnect)."""
        self.pub.close(linger=0)
        self.pub = ctx.socket(zmq.PUB)
        async with asyncio.timeout(5):
            while True:  # the closed socket may hold the port for a moment
                try:
                    self.pub.bind(self.endpoint)
                    return
                except zmq.ZMQError:
                    await asyncio.sleep(0.01)

    async def ping(self, sub: KVEventSubscriber, worker_id: str) -> None:
        """Send one-frame messages until the subscriber counts one: the subscription is then live."""
        async with asyncio.timeout(5):
            while not sub.counters.drops.get((worker_id, DropKind.FRAME_COUNT)):
                await self.pub.send(b"ping")
                await asyncio.sleep(0.01)
        sub.counters.drops.clear()

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def engine(ctx):
    fake = FakeEngine(ctx)
    yield fake
    await fake.close()


def make_sub(ctx, records, **cfg) -> KVEventSubscriber:
    config = SubscriberConfig(replay_timeout_s=cfg.pop("replay_timeout_s", 1.0), **cfg)
    return KVEventSubscriber(config, records.append, context=ctx)


async def joined_sub(ctx, engine, *, replay: bool = True, **cfg) -> tuple[KVEventSubscriber, list]:
    """A started subscriber following ``engine`` as worker ``w`` (with its replay endpoint when ``replay``),
    past the ZMQ join; returns it and the list its records go to."""
    records: list = []
    sub = make_sub(ctx, records, **cfg)
    await sub.start()
    replay_endpoint = engine.replay_endpoint if replay else None
    sub.add_worker(WorkerSpec(worker_id="w", endpoint=engine.endpoint, replay_endpoint=replay_endpoint))
    await engine.ping(sub, "w")
    return sub, records


def hashes_of(records) -> list[object]:
    out: list[object] = []
    for r in records:
        if isinstance(r, Resync):
            out.append(("resync", r.reason))
        else:
            out.extend((r.seq, e.block_hashes[0]) for e in r.events)  # type: ignore[union-attr]
    return out


# --- publisher ------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_bind_or_connect_and_dp_offset():
    assert bind_or_connect("tcp://*:5557") and bind_or_connect("tcp://[::]:5557") and bind_or_connect("ipc:///x")
    assert not bind_or_connect("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"


def test_publisher_frames_and_replay_bytes():
    ctx = zmq.Context()
    pub = KVEventPublisher(
        PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-events",
                        buffer_steps=2, dp_rank=0),
        context=ctx,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(pub.endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while True:  # slow joiner: publish until the first message arrives
        seq = pub.publish([AllBlocksCleared()], ts_s=1.0)
        if poller.poll(20):
            first = sub.recv_multipart()
            break
    assert first[0] == b"kv-events" and len(first[1]) == 8
    assert first[2] == bytes.fromhex("93cb3ff00000000000009181a474797065b0416c6c426c6f636b73436c656172656400")
    while int.from_bytes(first[1], "big") != seq:  # drain warm-up copies
        first = sub.recv_multipart()
    seq = pub.publish([BlockRemoved(block_hashes=(EngineBlockHash(7),))], ts_s=2.0)
    frames = sub.recv_multipart()
    assert frames[1] == seq.to_bytes(8, "big")
    assert frames[2] == encode_batch([BlockRemoved(block_hashes=(EngineBlockHash(7),))], 2.0, 0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # buffer keeps only the last 2
    replies = [dealer.recv_multipart() for _ in range(3)]
    assert [r[1] for r in replies] == [(seq - 1).to_bytes(8, "big"), seq.to_bytes(8, "big"), END]
    assert replies[1][2] == frames[2] and replies[2] == [b"", END, b""]
    dealer.send_multipart([b"", b"bad"])  # wrong seq frame: ignored, the next request is still served
    dealer.send_multipart([b"", seq.to_bytes(8, "big")])
    assert dealer.recv_multipart()[1] == seq.to_bytes(8, "big")
    assert dealer.recv_multipart() == [b"", END, b""]
    dealer.close(linger=0)
    sub.close(linger=0)
    pub.close()
    with pytest.raises(PublisherClosedError):
        pub.publish([])
    ctx.term()


# --- subscriber: sequencing and replay -------------------------------------------------------------------------


async def test_gap_replayed_exactly_once_in_order(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    await engine.send(0, payload(100))
    await engine.send(1, payload(101), deliver=False)
    await engine.send(2, payload(102), deliver=False)
    await engine.send(3, payload(103))
    await engine.send(4, payload(104))
    await until(lambda: sub.last_seq("w") == 4)
    assert hashes_of(records) == [(0, 100), (1, 101), (2, 102), (3, 103), (4, 104)]
    assert engine.requests == [0]  # verified from the last applied seq
    assert sub.counters.num_replayed_batches["w"] == 2 and sub.counters.total_drops() == 0
    await engine.send(4, payload(104))  # a duplicate live batch
    await engine.send(5, payload(105))
    await until(lambda: sub.last_seq("w") == 5)
    assert hashes_of(records)[-1] == (5, 105)
    assert sub.counters.drops == {("w", DropKind.DUPLICATE_SEQ): 1}
    await sub.aclose()


async def test_reordered_and_duplicated_replay_applied_once(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    engine.replay_order = "reversed_with_duplicates"
    await engine.send(10, payload(10))
    for q in (11, 12, 13):
        await engine.send(q, payload(q), deliver=False)
    await engine.send(14, payload(14))
    await until(lambda: sub.last_seq("w") == 14)
    assert hashes_of(records) == [(10, 10), (11, 11), (12, 12), (13, 13), (14, 14)]
    await sub.aclose()


CHAIN_BLOCK_SIZE = 16


def chain_payload(i: int) -> bytes:
    """Batch of block ``i`` of one chain: engine hash 1000 + i, parent 1000 + i - 1, tokens 16 i .. 16 i + 15."""
    block = BlockStored(
        block_hashes=(EngineBlockHash(1000 + i),),
        parent_block_hash=EngineBlockHash(999 + i) if i else None,
        token_ids=tuple(range(CHAIN_BLOCK_SIZE * i, CHAIN_BLOCK_SIZE * (i + 1))),
        block_size=CHAIN_BLOCK_SIZE,
    )
    return encode_batch([block], 1.0 + i, 0)


def indexed_sub(
    ctx: zmq.asyncio.Context, records: list[EventBatch | Resync]
) -> tuple[KVEventSubscriber, PrefixIndex]:
    """A subscriber whose sink feeds a prefix index (as the gateway wires it) and appends to ``records``."""
    index = PrefixIndex(IndexConfig(block_size=CHAIN_BLOCK_SIZE))

    def sink(record: EventBatch | Resync) -> None:
        records.append(record)
        if isinstance(record, Resync):
            index.apply_resync(record)
        else:
            index.apply(record)

    config = SubscriberConfig(replay_timeout_s=1.0, default_block_size=CHAIN_BLOCK_SIZE)
    return KVEventSubscriber(config, sink, context=ctx), index


def num_cached_tokens(index: PrefixIndex, num_blocks: int) -> int:
    """Tokens of the first ``num_blocks`` chain blocks that the index says worker ``w`` holds on GPU."""
    hashes = hash_token_blocks(list(range(CHAIN_BLOCK_SIZE * num_blocks)), CHAIN_BLOCK_SIZE)
    match = index.match(hashes).get("w")
    return 0 if match is None else CHAIN_BLOCK_SIZE * match.num_gpu_blocks


async def test_old_batch_redelivered_is_dropped_and_keeps_the_index(ctx, engine):
    records: list = []
    sub, index = indexed_sub(ctx, records)
    await sub.start()
    sub.add_worker(WorkerSpec(worker_id="w", endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint))
    await engine.ping(sub, "w")
    for i in range(6):
        await engine.send(i, chain_payload(i))
    await until(lambda: sub.last_seq("w") == 5)
    assert num_cached_tokens(index, 7) == 96
    await engine.send(3, chain_payload(3))  # the seq-3 batch again (re-delivered); replay still holds seq 5
    await engine.send(6, chain_payload(6))
    await until(lambda: sub.last_seq("w") == 6)
    assert hashes_of(records) == [(i, 1000 + i) for i in range(7)]
    assert engine.requests == [5]  # the anchor asked for is the last applied seq
    assert sub.counters.resyncs == {}
    assert sub.counters.drops == {("w", DropKind.NON_MONOTONIC_SEQ): 1}
    assert sub.counters.num_replayed_batches == {}
    assert num_cached_tokens(index, 7) == 112
    assert index.stats().counters["num_resyncs"] == 0
    await sub.aclose()


async def test_last_batch_redelivered_after_reconnect_is_a_duplicate(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    for q in range(3):
        await engine.send(q, payload(q))
    await until(lambda: sub.last_seq("w") == 2)
    await engine.restart_pub(ctx)  # same publisher (replay buffer kept), new PUB connection
    await until(lambda: sub.counters.num_reconnects[engine.endpoint] >= 1)
    await engine.ping(sub, "w")
    await engine.send(2, payload(2))  # the last applied batch again, first after the reconnect
    await engine.send(3, payload(3))
    await until(lambda: sub.last_seq("w") == 3)
    assert hashes_of(records) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert engine.requests == [2]
    assert sub.counters.resyncs == {}
    assert sub.counters.drops == {("w", DropKind.DUPLICATE_SEQ): 1}
    await sub.aclose()


@pytest.mark.parametrize("replay", ["new_stream_short", "new_stream_past_last", "silent"])
async def test_restart_with_seq_back_resyncs_whatever_the_replay_answers(ctx, engine, replay):
    sub, records = await joined_sub(ctx, engine, replay_timeout_s=0.3)
    for q in range(6):
        await engine.send(q, payload(q))
    await until(lambda: sub.last_seq("w") == 5)
    engine.buffer = {}  # the restarted publisher's buffer
    if replay == "new_stream_past_last":  # it published 0..7 before our replay request reached it
        for q in range(8):
            engine.buffer[q] = payload(700 + q)
    elif replay == "silent":
        engine.replay_order = "silent"
    await engine.send(3, payload(703))
    await until(lambda: sub.last_seq("w") == 3)
    assert hashes_of(records) == [(q, q) for q in range(6)] + [("resync", "seq_backwards"), (3, 703)]
    assert engine.requests == [5]
    assert sub.counters.resyncs == {("w", "seq_backwards"): 1}
    assert sub.counters.drops == {}
    await sub.aclose()


async def test_unclosable_gap_resyncs_before_newer_batch(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    await engine.send(0, payload(1))
    engine.buffer[1] = payload(2)  # seq 2 is missing from the buffer too
    await engine.send(3, payload(4))
    await until(lambda: sub.last_seq("w") == 3)
    assert hashes_of(records) == [(0, 1), ("resync", "gap_unrecoverable"), (3, 4)]
    assert [r for r in records if isinstance(r, Resync)] == [Resync("w", "gap_unrecoverable", dp_rank=0)]
    assert sub.counters.resyncs == {("w", "gap_unrecoverable"): 1}
    await sub.aclose()


async def test_replay_that_never_ends_is_given_up_at_the_total_timeout(ctx, engine):
    sub, records = await joined_sub(ctx, engine, replay_timeout_s=1.0, replay_total_timeout_s=0.3)
    await engine.send(1, payload(1))
    engine.replay_order = "never_ending"
    await engine.send(3, payload(3))  # seq 2 is missing: the replay asked for it answers stale seqs forever
    await until(lambda: sub.last_seq("w") == 3, timeout_s=3.0)  # given up at 0.3 s, not held by the replies
    assert hashes_of(records) == [(1, 1), ("resync", "gap_unrecoverable"), (3, 3)]
    await sub.aclose()


async def test_no_replay_configured_gap_and_backwards_resync(ctx, engine):
    sub, records = await joined_sub(ctx, engine, replay=False)
    await engine.send(5, payload(5))
    await engine.send(7, payload(7))
    await engine.send(0, payload(50))
    await until(lambda: sub.last_seq("w") == 0)
    assert hashes_of(records) == [(5, 5), ("resync", "gap_no_replay"), (7, 7), ("resync", "seq_backwards"), (0, 50)]
    assert engine.requests == []
    await sub.aclose()


async def test_restart_detected_when_seq_goes_back_with_replay(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    for q in range(4):
        await engine.send(q, payload(q))
    await until(lambda: sub.last_seq("w") == 3)
    engine.buffer = {}  # the restarted publisher's buffer
    await engine.send(0, payload(900))
    await until(lambda: sub.last_seq("w") == 0)
    assert hashes_of(records)[-2:] == [("resync", "seq_backwards"), (0, 900)]
    await sub.aclose()


async def test_restart_past_last_seq_detected_through_replay(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    for q in range(3):
        await engine.send(q, payload(q))
    await until(lambda: sub.last_seq("w") == 2)
    engine.buffer = {}  # restarted publisher: published 0..7 while we saw nothing, then 8 arrives
    for q in range(8):
        await engine.send(q, payload(500 + q), deliver=False)
    await engine.send(8, payload(508))
    await until(lambda: sub.last_seq("w") == 8)
    assert hashes_of(records) == [(0, 0), (1, 1), (2, 2), ("resync", "gap_unrecoverable"), (8, 508)]
    assert engine.requests == [2]
    await sub.aclose()


async def test_real_publisher_restart_at_same_address(ctx):
    records: list = []
    sub = make_sub(ctx, records)
    await sub.start()
    old = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"))
    endpoint, replay = old.endpoint, old.replay_endpoint
    sub.add_worker(WorkerSpec(worker_id="w", endpoint=endpoint, replay_endpoint=replay))
    async with asyncio.timeout(5):
        while not records:
            old.publish([stored(1)])
            await asyncio.sleep(0.01)
    await until(lambda: sub.last_seq("w") == old.next_seq - 1)
    seen_old = len(records)
    old.close()
    await until(lambda: sub.counters.num_disconnects[endpoint] >= 1)
    new = KVEventPublisher(PublisherConfig(endpoint=endpoint, replay_endpoint=replay, bind=True))
    for _ in range(old.next_seq + 3):  # publishes past the last seq we saw, before we are back
        new.publish([stored(2)])
    await until(lambda: sub.counters.num_reconnects[endpoint] >= 1)
    async with asyncio.timeout(5):
        while len(records) == seen_old:
            new.publish([stored(2)])
            await asyncio.sleep(0.01)
    await until(lambda: sub.last_seq("w") == new.next_seq - 1)
    after = records[seen_old:]
    assert isinstance(after[0], Resync) and after[0].reason in ("reconnect", "seq_backwards")
    assert all(isinstance(r, EventBatch) and r.events[0].block_hashes == (2,) for r in after[1:])  # type: ignore[union-attr]
    new.close()
    await sub.aclose()


async def test_start_id_change_resyncs(ctx, engine):
    records: list = []
    sub = make_sub(ctx, records)
    await sub.start()
    sub.add_worker(WorkerSpec(worker_id="w", endpoint=engine.endpoint))
    sub.notify_start_id("w", "epoch-1")
    await engine.ping(sub, "w")
    await engine.send(0, payload(1))
    await until(lambda: sub.last_seq("w") == 0)
    sub.notify_start_id("w", "epoch-1")
    sub.notify_start_id("w", "epoch-2")
    await until(lambda: sub.last_seq("w") is None)
    await engine.send(0, payload(2))  # the new publisher's first batch: accepted as the baseline
    await until(lambda: sub.last_seq("w") == 0 and len(records) == 3)
    assert hashes_of(records) == [(0, 1), ("resync", "start_id_changed"), (0, 2)]
    await sub.aclose()


# --- subscriber: topologies, bad frames, workers ---------------------------------------------------------------


async def test_bound_topology_topic_names_worker(ctx):
    records: list = []
    sub = make_sub(ctx, records, bind_endpoint="tcp://127.0.0.1:*")
    await sub.start()
    sub.add_worker(WorkerSpec(worker_id="pod-a", block_size=4))
    pub = KVEventPublisher(
        PublisherConfig(endpoint=sub.bound_endpoint or "", topic="kv@pod-a@llama"), context=None
    )
    assert not bind_or_connect(pub.endpoint)  # loopback address: the publisher connects
    async with asyncio.timeout(5):
        while not records:
            pub.publish([stored(3)])
            await asyncio.sleep(0.01)
    assert records[0].worker_id == "pod-a" and records[0].events == (stored(3),)
    stranger = ctx.socket(zmq.PUB)
    stranger.connect(sub.bound_endpoint)
    async with asyncio.timeout(5):
        while not sub.counters.drops.get(("pod-b", DropKind.UNKNOWN_WORKER)):
            await stranger.send_multipart([b"kv@pod-b@llama\x00sgl-kv-epoch=1", (0).to_bytes(8, "big"), payload(1)])
            await asyncio.sleep(0.01)
    assert all(r.worker_id == "pod-a" for r in records)
    stranger.close(linger=0)
    pub.close()
    await sub.aclose()


async def test_bad_frames_counted_nothing_emitted(ctx, engine):
    sub, records = await joined_sub(ctx, engine, replay=False, default_block_size=4)
    await engine.pub.send_multipart([b"", b"\x00" * 8])  # 2 frames
    await engine.pub.send_multipart([b"", b"\x01", payload(1)])  # short seq frame
    await engine.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\x93\xcb\x00"])  # truncated msgpack
    bad_size = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                              "token_ids": list(range(8)), "block_size": 8}], 0])
    await engine.pub.send_multipart([b"", (1).to_bytes(8, "big"), bad_size])
    await until(lambda: sub.last_seq("w") == 1)
    assert records == []
    assert sub.counters.drops == {
        ("w", DropKind.FRAME_COUNT): 1,
        ("w", DropKind.BAD_SEQ_FRAME): 1,
        ("w", DropKind.MALFORMED_PAYLOAD): 1,
        ("w", DropKind.BLOCK_SIZE_MISMATCH): 1,
    }
    await sub.aclose()


async def test_batches_of_unconfigured_dp_ranks_dropped_and_create_no_stream(ctx, engine, caplog):
    sub, records = await joined_sub(ctx, engine, replay=False)
    with caplog.at_level("DEBUG", logger="events.counters"):
        for seq, rank in enumerate((*range(1, 51), 2**40), start=1):  # each consumes its seq on rank 0's stream
            await engine.send(seq, encode_batch([stored(rank)], 1.0, rank))
        await engine.send(52, encode_batch([stored(7)], 1.0, 0))
        await until(lambda: sub.last_seq("w") == 52)
    assert hashes_of(records) == [(52, 7)]
    assert sub.counters.drops == {("w", DropKind.UNKNOWN_DP_RANK): 51}
    assert list(sub._streams) == [("w", 0)]
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if "unknown_dp_rank" in r.getMessage()]
    assert [level for level, _ in logged] == ["WARNING"] + ["DEBUG"] * 50
    assert logged[0][1] == (
        "kv events from worker w: dropped (unknown_dp_rank): batch 1 of dp rank 1; the worker's ranks are [0] "
        "(further drops of this kind are logged at debug)"
    )
    await sub.aclose()


async def test_bound_topology_accepts_only_added_dp_ranks(ctx):
    records: list = []
    sub = make_sub(ctx, records, bind_endpoint="tcp://127.0.0.1:*")
    await sub.start()
    sub.add_worker(WorkerSpec(worker_id="pod-a", dp_rank=0))
    sub.add_worker(WorkerSpec(worker_id="pod-a", dp_rank=1))
    pub = ctx.socket(zmq.PUB)
    pub.connect(sub.bound_endpoint)
    topic = b"kv@pod-a@llama"
    async with asyncio.timeout(5):  # past the ZMQ join: a message without a seq frame is counted
        while not sub.counters.drops.get(("?", DropKind.FRAME_COUNT)):
            await pub.send_multipart([topic, b""])
            await asyncio.sleep(0.01)
    sub.counters.drops.clear()
    for tag, (rank, seq) in enumerate(((0, 0), (1, 0), (2, 0), (3, 0), (1, 1))):  # seqs count per rank
        await pub.send_multipart([topic, seq.to_bytes(8, "big"), encode_batch([stored(10 + tag)], 1.0, rank)])
    await until(lambda: sub.last_seq("pod-a", 1) == 1)
    assert [(r.dp_rank, r.seq, r.events[0].block_hashes) for r in records] == [(0, 0, (10,)), (1, 0, (11,)),
                                                                              (1, 1, (14,))]
    assert sub.counters.drops == {("pod-a", DropKind.UNKNOWN_DP_RANK): 2}
    assert sorted(sub._streams) == [("pod-a", 0), ("pod-a", 1)]
    pub.close(linger=0)
    await sub.aclose()


async def test_replayed_batch_of_another_dp_rank_dropped(ctx, engine):
    sub, records = await joined_sub(ctx, engine)
    await engine.send(0, encode_batch([stored(100)], 1.0, 0))
    await engine.send(1, encode_batch([stored(101)], 1.0, 5), deliver=False)
    await engine.send(2, encode_batch([stored(102)], 1.0, 0))
    await until(lambda: sub.last_seq("w") == 2)
    assert hashes_of(records) == [(0, 100), (2, 102)]
    assert sub.counters.drops == {("w", DropKind.UNKNOWN_DP_RANK): 1}
    assert sub.counters.num_replayed_batches["w"] == 1 and sub.counters.resyncs == {}
    await sub.aclose()


async def test_add_remove_worker_at_runtime_and_slices(ctx, engine):
    sub, records = await joined_sub(ctx, engine, replay=False, max_blocks_per_slice=3)
    big = encode_batch([stored(1, 2), stored(3, 4), stored(5)], 1.0, 0)
    await engine.send(0, big)
    await until(lambda: sub.last_seq("w") == 0)
    assert [tuple(e.block_hashes for e in r.events) for r in records] == [((1, 2),), ((3, 4), (5,))]
    assert {r.seq for r in records} == {0}
    assert sub.remove_worker("w") and not sub.remove_worker("w")
    assert sub.last_seq("w") is None
    await sub.aclose()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", ("tcp://*:5557", "tcp://*:5558", "tcp://*:5559")),
        ("tcp://10.0.0.5:5557", ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5559")),
        ("tcp://[::1]:6000", ("tcp://[::1]:6000", "tcp://[::1]:6001", "tcp://[::1]:6002")),
        ("ipc:///tmp/kv-events", ("ipc:///tmp/kv-events", "ipc:///tmp/kv-events_dp1", "ipc:///tmp/kv-events_dp2")),
        ("inproc://kv", ("inproc://kv", "inproc://kv_dp1", "inproc://kv_dp2")),
        ("tcp://inproc-host:7000", ("tcp://inproc-host:7000", "tcp://inproc-host:7001", "tcp://inproc-host:7002")),
        ("tcp://127.0.0.1:*", ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")),
    ],
)
def test_offset_endpoint_ranks_0_1_2(endpoint, expected):
    assert tuple(offset_endpoint(endpoint, rank) for rank in (0, 1, 2)) == expected
    assert offset_endpoint(None, 2) is None


@pytest.mark.unit
def test_offset_endpoint_refuses_what_a_rank_cannot_use():
    with pytest.raises(EventsConfigError, match="dp_rank must be >= 0, got -1"):
        offset_endpoint("tcp://*:5557", -1)
    with pytest.raises(EventsConfigError, match="rank 2 would use port 65537, over 65535"):
        offset_endpoint("tcp://*:65535", 2)
    assert offset_endpoint("tcp://*:65535", 0) == "tcp://*:65535"
    for bad in ("tcp://host", "tcp://host:port", "udp://host:5557", "http://host:80"):
        with pytest.raises(EventsConfigError):
            offset_endpoint(bad, 1)


def test_ipc_ranks_publish_where_their_subscribers_listen(tmp_path):
    """Ranks 0, 1 and 2 of one ipc:// endpoint: each rank's publisher binds offset_endpoint(endpoint, rank) and a SUB
    connected to the same offset address receives that rank's batch and no other's."""
    ctx = zmq.Context()
    base = f"ipc://{tmp_path}/kv"
    pubs = [KVEventPublisher(PublisherConfig(endpoint=base, dp_rank=rank, linger_s=0.0), context=ctx)
            for rank in range(3)]
    subs = []
    try:
        assert [p.endpoint for p in pubs] == [base, f"{base}_dp1", f"{base}_dp2"]
        for rank in range(3):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 5000)
            sub.connect(offset_endpoint(base, rank))
            subs.append(sub)
        got: list[bytes] = []
        for rank, (pub, sub) in enumerate(zip(pubs, subs, strict=True)):
            deadline = time.monotonic() + 5.0
            while True:  # PUB drops until the SUB's subscription arrives: publish until one lands
                pub.publish([AllBlocksCleared()], ts_s=float(rank))
                if sub.poll(100):
                    break
                assert time.monotonic() < deadline, f"rank {rank} never reached its subscriber"
            got.append(sub.recv_multipart()[2])
        decoded = [msgspec.msgpack.decode(payload) for payload in got]
        assert [batch[2] for batch in decoded] == [0, 1, 2]  # each SUB hears only its own rank
    finally:
        for sub in subs:
            sub.close(linger=0)
        for pub in pubs:
            pub.close()
        ctx.term()


@pytest.mark.unit
def test_offset_endpoint_rank_0_refuses_only_a_port_out_of_range():
    assert offset_endpoint("udp://anything", 0) == "udp://anything"
    assert offset_endpoint("tcp://host:port", 0) == "tcp://host:port"
    with pytest.raises(EventsConfigError, match="rank 0 would use port 70000, over 65535"):
        offset_endpoint("tcp://127.0.0.1:70000", 0)
