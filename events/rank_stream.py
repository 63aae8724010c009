"""One (worker, dp_rank) stream of the KV event subscriber: sequencing, replay and bounded delivery.

``events.subscriber.KVEventSubscriber`` reads the sockets, decodes each message and queues it on the stream of its
(worker, dp_rank) as a ``QueuedBatch`` (or a ``StreamMarker`` after a disconnect or a start-id change). One task a
stream runs ``StreamSequencer.run``: the sequencing rules, the replay through the worker's ROUTER, the ``Resync``
records and the sliced delivery to the sink are the ones the subscriber's module docstring states.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash
import zmq
import zmq.asyncio

from events.counters import DropKind, EventCounters
from events.decode import EventDecoder
from events.publisher import SEQ_END_MARKER
from events.subscriber_config import SubscriberConfig
from events.types import AllBlocksCleared, EventBatch, KVEvent, Resync

logger = logging.getLogger(__name__)

Sink = Callable[[EventBatch | Resync], None]
"""Consumer of the subscriber's output, called on the event loop thread."""


@dataclass(slots=True)
class QueuedBatch:
    """A received batch as queued on its stream."""

    seq: int
    digest: int
    batch: EventBatch | None  # None: unusable payload (counted), still consumes its seq


@dataclass(slots=True)
class StreamMarker:
    """A sign queued between batches: the socket disconnected, or the worker's start id changed."""

    kind: str  # "suspect" (socket disconnect) or "verify" (start id changed)


@dataclass(slots=True)
class RankStream:
    """The sequencing state of one (worker, dp_rank) stream, with its queue and its task."""

    worker_id: str
    dp_rank: int
    replay_endpoint: str | None
    block_size: int | None
    queue: asyncio.Queue[QueuedBatch | StreamMarker] = field(default_factory=asyncio.Queue)
    space: asyncio.Event = field(default_factory=asyncio.Event)
    last_seq: int | None = None
    last_digest: int = 0
    is_suspect: bool = False
    task: asyncio.Task[None] | None = None




class StreamSequencer:
    """Runs the rank streams of one subscriber: each stream's task is ``run(stream)``.

    Args:
        config: the subscriber's configuration (replay timeouts and limits, slice size).
        sink: consumer of ``EventBatch`` and ``Resync`` records (sync, called on the loop thread).
        counters: the subscriber's counters.
        decoder: decodes replayed payloads (the subscriber's own decoder, sharing its counters).
        context: the ZMQ context replay DEALERs are made in.
    """

    def __init__(self, config: SubscriberConfig, sink: Sink, counters: EventCounters, decoder: EventDecoder,
                 context: zmq.asyncio.Context) -> None:
        self.config = config
        self.counters = counters
        self._sink = sink
        self._decoder = decoder
        self._ctx = context
        self._blocks_since_yield = 0

    async def run(self, stream: RankStream) -> None:
        """Sequence and deliver ``stream``'s queued batches and markers, forever (the stream's task; cancel it).

        A failure in one item is logged and resyncs the stream; the loop goes on.
        """
        while True:
            item = await stream.queue.get()
            if stream.queue.qsize() < self.config.max_pending_batches // 2 + 1:
                stream.space.set()
            try:
                if isinstance(item, StreamMarker):
                    if item.kind == "suspect":
                        stream.is_suspect = stream.last_seq is not None
                    else:
                        await self._verify_start_id(stream)
                else:
                    await self._on_item(stream, item)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("kv events: stream %s/%d failed; resyncing", stream.worker_id, stream.dp_rank)
                self._resync(stream, "internal_error")

    async def _verify_start_id(self, stream: RankStream) -> None:
        """A new start id: resync unless replay shows the stream already follows the new publisher. With no
        batch applied yet (``last_seq`` is ``None``: none since the start or the last resync) there is nothing to
        check the new publisher against, but the index may still hold the old one's snapshot: resync too."""
        if stream.last_seq is not None and stream.replay_endpoint is not None:
            replies, _ = await self._replay(stream, stream.last_seq)
            got = replies.get(stream.last_seq)
            if got is not None and got[0] == stream.last_digest:
                return  # we already follow the new publisher (its restart was caught by seq)
        self._resync(stream, "start_id_changed")

    async def _on_item(self, stream: RankStream, item: QueuedBatch) -> None:
        last = stream.last_seq
        seq = item.seq
        if last is None:
            await self._apply(stream, item)
            return
        if not stream.is_suspect:
            if seq == last + 1:
                await self._apply(stream, item)
                return
            if seq == last:
                self.counters.drop(stream.worker_id, DropKind.DUPLICATE_SEQ, f"seq {seq} seen twice")
                return
        if seq > last + 1:
            self.counters.num_gaps[stream.worker_id] += 1
        if stream.replay_endpoint is None:
            reason = "seq_backwards" if seq < last else "reconnect" if stream.is_suspect else "gap_no_replay"
            self._resync(stream, reason)
            await self._apply(stream, item)
            return
        missing = max(0, seq - last - 1)
        if missing > self.config.max_replay_batches:
            self._resync(stream, "gap_unrecoverable")
            await self._apply(stream, item)
            return
        # Keep the anchor ``last`` whatever the live seq: for an old or repeated seq (``seq <= last``) it is the
        # only reply needed, and without it such a batch could never be told from a restart.
        replies, _ = await self._replay(stream, last, stop_before=max(seq, last + 1))
        anchor = replies.get(last)
        if anchor is None or anchor[0] != stream.last_digest:
            reason = "seq_backwards" if seq < last else "reconnect" if stream.is_suspect else "gap_unrecoverable"
            self._resync(stream, reason)
            await self._apply(stream, item)
            return
        stream.is_suspect = False
        if seq <= last:
            kind = DropKind.DUPLICATE_SEQ if seq == last else DropKind.NON_MONOTONIC_SEQ
            self.counters.drop(stream.worker_id, kind, f"seq {seq} after {last}; replay shows no restart")
            return
        if any(q not in replies for q in range(last + 1, seq)):
            self._resync(stream, "gap_unrecoverable")
            await self._apply(stream, item)
            return
        for q in range(last + 1, seq):
            digest, payload = replies[q]
            batch = self._decoder.decode(
                payload,
                worker_id=stream.worker_id,
                seq=q,
                block_size=stream.block_size,
                default_dp_rank=stream.dp_rank,
            )
            self.counters.num_replayed_batches[stream.worker_id] += 1
            if batch is not None and batch.dp_rank != stream.dp_rank:
                self.counters.drop(
                    stream.worker_id,
                    DropKind.UNKNOWN_DP_RANK,
                    f"replayed batch {q} of dp rank {batch.dp_rank} on the stream of rank {stream.dp_rank}",
                )
                batch = None  # still consumes its seq
            await self._apply(stream, QueuedBatch(seq=q, digest=digest, batch=batch))
        await self._apply(stream, item)

    async def _replay(
        self, stream: RankStream, start_seq: int, stop_before: int | None = None
    ) -> tuple[dict[int, tuple[int, bytes]], bool]:
        """Ask the stream's replay ROUTER for every batch from ``start_seq``.

        Args:
            stream: the stream to replay (it must have a replay endpoint).
            start_seq: first seq asked for; the callers pass the last applied seq (the anchor).
            stop_before: replies at this seq or later are not kept; ``None`` keeps every one. Greater than
                ``start_seq``, so that the anchor is always kept.

        Returns:
            ({seq: (xxh3-64 digest, payload)} for ``start_seq <= seq < stop_before``, first copy of each seq),
            and whether the end marker arrived before ``replay_timeout_s`` of silence and within
            ``replay_total_timeout_s`` in all.

        Raises:
            ValueError: ``stop_before <= start_seq``.
        """
        if stop_before is not None and stop_before <= start_seq:
            raise ValueError(f"stop_before ({stop_before}) must be greater than start_seq ({start_seq})")
        assert stream.replay_endpoint is not None
        self.counters.num_replay_requests[stream.worker_id] += 1
        replies: dict[int, tuple[int, bytes]] = {}
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(stream.replay_endpoint)
            await dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            loop = asyncio.get_running_loop()
            end_s = loop.time() + self.config.replay_total_timeout_s
            while True:
                wait_s = min(self.config.replay_timeout_s, end_s - loop.time())
                try:
                    if wait_s <= 0.0:
                        raise TimeoutError
                    async with asyncio.timeout(wait_s):  # a cancel is never swallowed (asyncio.wait_for on 3.11)
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    logger.warning(
                        "kv events: replay from %s timed out after %d batches", stream.replay_endpoint, len(replies)
                    )
                    return replies, False
                if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                    self.counters.drop(stream.worker_id, DropKind.FRAME_COUNT, f"replay reply of {len(frames)} frames")
                    continue
                if frames[1] == SEQ_END_MARKER:
                    return replies, True
                seq = int.from_bytes(frames[1], "big")
                if seq >= start_seq and (stop_before is None or seq < stop_before) and seq not in replies:
                    replies[seq] = (xxhash.xxh3_64_intdigest(frames[2]), frames[2])
        except zmq.ZMQError as exc:
            logger.warning("kv events: replay from %s failed: %s", stream.replay_endpoint, exc)
            return replies, False
        finally:
            dealer.close(linger=0)


    def _resync(self, stream: RankStream, reason: str) -> None:
        logger.warning("kv events: resync worker %s (rank %d): %s", stream.worker_id, stream.dp_rank, reason)
        self.counters.resyncs[(stream.worker_id, reason)] += 1
        stream.last_seq = None
        stream.is_suspect = False
        self._emit(Resync(worker_id=stream.worker_id, reason=reason, dp_rank=stream.dp_rank))

    # -- delivery ----------------------------------------------------------------------------------------------

    def _emit(self, record: EventBatch | Resync) -> None:
        try:
            self._sink(record)
        except Exception:
            logger.exception("kv events: sink failed on a record of worker %s", record.worker_id)

    async def _apply(self, stream: RankStream, item: QueuedBatch) -> None:
        stream.last_seq = item.seq
        stream.last_digest = item.digest
        batch = item.batch
        if batch is None or not batch.events:
            return
        limit = self.config.max_blocks_per_slice
        counters = self.counters
        worker_id = batch.worker_id
        counters.num_batches[worker_id] += 1
        counters.num_events[worker_id] += len(batch.events)
        chunk: list[KVEvent] = []
        chunk_blocks = 0
        for event in batch.events:
            num_blocks = 1 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)
            if chunk and chunk_blocks + num_blocks > limit:
                await self._deliver(batch, chunk, chunk_blocks)
                chunk, chunk_blocks = [], 0
            chunk.append(event)
            chunk_blocks += num_blocks
        await self._deliver(batch, chunk, chunk_blocks)

    async def _deliver(self, batch: EventBatch, chunk: list[KVEvent], num_blocks: int) -> None:
        if len(chunk) == len(batch.events):
            self._emit(batch)
        else:
            self._emit(
                EventBatch(
                    worker_id=batch.worker_id,
                    dp_rank=batch.dp_rank,
                    seq=batch.seq,
                    ts_s=batch.ts_s,
                    events=tuple(chunk),
                )
            )
        self.counters.num_blocks[batch.worker_id] += num_blocks
        self._blocks_since_yield += num_blocks
        if self._blocks_since_yield >= self.config.max_blocks_per_slice:
            self._blocks_since_yield = 0
            await asyncio.sleep(0)
