"""The publisher's replay buffer is bounded in batches and in payload bytes (``PublisherConfig.buffer_steps``,
``buffer_max_bytes``), and holds nothing without a replay endpoint; a replay over the real ROUTER returns exactly
the batches still buffered."""

from __future__ import annotations

import zmq

from events.encode import encode_batch
from events.publisher import SEQ_END_MARKER, KVEventPublisher, PublisherConfig
from events.types import AllBlocksCleared, BlockRemoved, EngineBlockHash


def _removed(n: int) -> list[BlockRemoved]:
    return [BlockRemoved(block_hashes=tuple(EngineBlockHash(i) for i in range(n)))]


def test_buffer_bounded_in_bytes_and_replayed_exactly():
    one = len(encode_batch(_removed(100), 1.0, 0))
    ctx = zmq.Context()
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                           buffer_max_bytes=3 * one + one // 2), context=ctx)
    seqs = [pub.publish(_removed(100), ts_s=1.0) for _ in range(10)]
    assert pub.num_buffered_batches == 3 and pub.num_buffered_bytes == 3 * one
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies = [dealer.recv_multipart() for _ in range(4)]
    assert [int.from_bytes(r[1], "big") for r in replies[:3]] == seqs[-3:]
    assert all(r[2] == encode_batch(_removed(100), 1.0, 0) for r in replies[:3])
    assert replies[3] == [b"", SEQ_END_MARKER, b""]
    # A batch larger than the whole bound is still kept (alone): a replay right after it can serve it.
    big = pub.publish(_removed(1000), ts_s=1.0)
    assert pub.num_buffered_batches == 1 and pub.num_buffered_bytes == len(encode_batch(_removed(1000), 1.0, 0))
    dealer.send_multipart([b"", big.to_bytes(8, "big")])
    assert int.from_bytes(dealer.recv_multipart()[1], "big") == big
    dealer.close(linger=0)
    pub.close()
    ctx.term()


def test_buffer_bounded_in_steps_and_empty_without_replay():
    ctx = zmq.Context()
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                           buffer_steps=4), context=ctx)
    for _ in range(9):
        pub.publish(_removed(3), ts_s=1.0)
    assert pub.num_buffered_batches == 4
    assert pub.num_buffered_bytes == 4 * len(encode_batch(_removed(3), 1.0, 0))
    pub.close()
    no_replay = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*"), context=ctx)
    for _ in range(5):
        no_replay.publish(_removed(3), ts_s=1.0)
    assert no_replay.num_buffered_batches == 0 and no_replay.num_buffered_bytes == 0
    no_replay.close()
    ctx.term()


def test_drop_buffered_before_a_clear():
    ctx = zmq.Context()
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"),
                           context=ctx)
    for _ in range(6):
        pub.publish(_removed(10), ts_s=1.0)
    clear_seq = pub.publish([AllBlocksCleared()], ts_s=1.0)
    assert pub.drop_buffered_before(clear_seq) == 6
    assert pub.num_buffered_batches == 1 and pub.num_buffered_bytes == len(encode_batch([AllBlocksCleared()], 1.0, 0))
    assert pub.drop_buffered_before(clear_seq) == 0
    pub.close()
    ctx.term()
