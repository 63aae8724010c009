"""Asyncio subscriber of KV event streams: sequencing, replay, restart detection, bounded delivery.

Topologies (both wire-compatible with vLLM / SGLang publishers, see ``events.publisher``)::

    connect (default, several gateway replicas)      bound (llm-d style, ONE gateway replica)
    gateway SUB --connect--> worker PUB (bound)      worker PUB --connect--> gateway SUB (bound)
    one SUB per added WorkerSpec.endpoint            one SUB on SubscriberConfig.bind_endpoint; the worker is
    worker id from the spec                          named by the topic kv@<worker>@<model> (prefix-matched, so
                                                     SGLang's "\\x00sgl-kv-epoch=..." suffix is fine)

An engine's PUB connects to one address only, so the bound topology serves one gateway replica. With several
replicas, each replica connects its own SUB to every worker's PUB (PUB/SUB fans out); use the connect topology.

Sequencing, per (worker_id, dp_rank) stream (dp_rank from the batch, else the ``WorkerSpec.dp_rank`` of the
endpoint it came from). A stream is created on a rank's first batch, and only for the ranks added with
``add_worker`` (a worker accepted through ``accept_unknown_workers`` has rank 0 only): a batch of any other rank is
dropped whole, counted ``unknown_dp_rank`` and logged (a warning once per worker), so a publisher cannot make
streams or index slots without bound. In the connect topology such a batch still consumes its seq on the stream
of the endpoint's rank (its publisher has one seq counter), as a refused replayed batch does; in the bound
topology it cannot be attributed to a stream. A replayed batch must carry the rank of the stream that asked for
it.

    first batch (or after a Resync)       accepted as the baseline
    seq == last + 1                       applied
    seq == last                           dropped, counted ``duplicate_seq``
    seq > last + 1 (gap), seq < last,     verified through replay: ask the worker's replay ROUTER (DEALER,
    or any batch after a socket           ``[b"", last (8 B BE)]``) and compare the digest (xxh3-64) of the
    disconnect                            replayed batch ``last`` with the one we applied. Same publisher: apply
                                          each missing batch exactly once, in seq order (replies out of order or
                                          repeated are deduplicated by seq), then the live one; an older or
                                          repeated live seq is dropped (``non_monotonic_seq``/``duplicate_seq``).
                                          Different publisher, missing batches, timeout, or no replay endpoint:
                                          emit ``Resync(worker_id, reason)`` and take the live batch as the new
                                          baseline.

Reasons: ``seq_backwards``, ``gap_unrecoverable``, ``gap_no_replay``, ``reconnect`` (after a disconnect that
replay could not vouch for), ``start_id_changed`` (``notify_start_id`` reported a new start id and replay could
not show we already follow the new publisher). A ``Resync`` always reaches the sink BEFORE any later batch of that
worker and means: clear everything known about the worker (all its dp ranks, all its own tiers). A worker with
several dp ranks gets one ``Resync`` per rank stream that detected the restart.

What replay can prove: the replayed batch at ``last`` (the anchor) decides alone. The same bytes (payloads carry
the publish time) show that the publisher answering is the one whose batches we applied, so a live seq at or
below ``last`` is a re-delivered old batch: it is dropped, never applied, and nothing is cleared (an index cleared
there could not be rebuilt: vLLM and SGLang serve no snapshot, and the next stores would name parents that are
gone). For such a seq only the anchor is kept from the replay, and the old batch's content is not compared with
anything: neither could change the verdict. A restarted publisher answers no batch at ``last`` yet, or one with
other bytes, and a replay that times out proves nothing: each resyncs (``seq_backwards``, or ``reconnect`` for
seq == last after a disconnect). A publisher that restarts and publishes past the last seq we saw looks like a
forward gap and is caught the same way.

ZMQ reconnects by itself (``reconnect_interval_s``); the socket monitor's disconnects mark the worker's streams
suspect (bound topology: every stream, since a peer cannot be attributed).

A malformed message never raises: it is counted by kind in ``counters`` (``events.counters.EventCounters``) and
logged once per worker and kind. A batch whose payload is unusable still consumes its seq (nothing to replay it
into). Batches whose events were all refused are not delivered.

Delivery: ``sink(item)`` is a plain callable taking ``EventBatch | Resync``, called on the event loop thread. A
batch carrying more than ``max_blocks_per_slice`` blocks is split into several ``EventBatch`` with the same seq,
and the loop is yielded to (``await asyncio.sleep(0)``) after every ``max_blocks_per_slice`` blocks delivered,
so the request path is never held for long. An exception from the sink is logged and the stream continues.

Public API::

    WorkerSpec(worker_id, endpoint=None, replay_endpoint=None, dp_rank=0, topic="", block_size=None)
    SubscriberConfig(bind_endpoint=None, bind_topic_prefix="kv@", accept_unknown_workers=False,
                     replay_timeout_s=2.0, max_replay_batches=10_000, reconnect_interval_s=0.1,
                     reconnect_interval_max_s=5.0, rcvhwm=100_000, max_blocks_per_slice=4096,
                     max_pending_batches=1024, default_block_size=None)
    sub = KVEventSubscriber(config, sink, counters=None, context=None)
    await sub.start()                       # binds (bound topology) and starts the specs added so far
    sub.add_worker(spec)                    # at any time; one spec per (worker, dp rank) endpoint
    sub.remove_worker(worker_id) -> bool    # closes its sockets and forgets its streams (no Resync emitted)
    sub.notify_start_id(worker_id, start_id)   # from the gateway's load poller
    sub.bound_endpoint -> str | None        # resolved bind address (ephemeral ports filled in)
    sub.last_seq(worker_id, dp_rank=0) -> int | None
    sub.counters                            # EventCounters, for Prometheus
    await sub.aclose()

Modules: this one reads the sockets, names each message's worker and rank stream and queues it;
``events.rank_stream`` sequences each stream (replay, ``Resync``, sliced delivery); ``events.subscriber_config``
holds ``SubscriberConfig`` and ``WorkerSpec`` (re-exported here).

Typical gateway wiring (aiohttp cleanup_ctx)::

    sub = KVEventSubscriber(cfg, index.apply)      # index.apply(EventBatch | Resync) -> None
    await sub.start()
    for spec in specs: sub.add_worker(spec)
    yield
    await sub.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.counters import DropKind, EventCounters
from events.decode import EventDecoder
from events.errors import EventsConfigError
from events.rank_stream import QueuedBatch, RankStream, Sink, StreamMarker, StreamSequencer
from events.subscriber_config import SubscriberConfig, WorkerSpec

__all__ = ["KVEventSubscriber", "Sink", "SubscriberConfig", "WorkerSpec"]

logger = logging.getLogger(__name__)


def _has_input(sock: zmq.asyncio.Socket) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


@dataclass(slots=True)
class _Source:
    endpoint: str
    worker_id: str | None  # None: bound topology (worker named by topic)
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    spec: WorkerSpec | None = None  # connect topology: the one rank publishing here (its seqs, its default rank)
    task: asyncio.Task[None] | None = None
    was_disconnected: bool = False


class KVEventSubscriber:
    """Receives KV event batches from many workers and hands normalized, sequenced records to a sink.

    See the module docstring for the protocol, the topologies and the guarantees.

    Args:
        config: subscriber configuration.
        sink: consumer of ``EventBatch`` and ``Resync`` records (sync, called on the loop thread).
        counters: counters to update (a new ``EventCounters`` when ``None``); read them for metrics.
        context: a ``zmq.asyncio.Context`` to share; a private one is made (and terminated) when ``None``.
    """

    def __init__(
        self,
        config: SubscriberConfig,
        sink: Sink,
        *,
        counters: EventCounters | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.counters = EventCounters() if counters is None else counters
        self._own_context = context is None
        self._ctx = zmq.asyncio.Context() if context is None else context
        if context is None:  # libzmq's default of 1,023 sockets is 341 rank streams (events.capacity)
            self._ctx.set(zmq.MAX_SOCKETS, self._ctx.get(zmq.SOCKET_LIMIT))
        self._decoder = EventDecoder(self.counters)
        self._sequencer = StreamSequencer(config, sink, self.counters, self._decoder, self._ctx)
        self._specs: dict[str, dict[int, WorkerSpec]] = {}
        self._sources: dict[tuple[str, int], _Source] = {}
        self._streams: dict[tuple[str, int], RankStream] = {}
        self._start_ids: dict[str, object] = {}
        self._bound: _Source | None = None
        self.bound_endpoint: str | None = None
        self._started = False
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def max_sockets(self) -> int:
        """The ZMQ context's socket limit (``ZMQ_MAX_SOCKETS``; 3 a followed rank stream, ``events.capacity``)."""
        return int(self._ctx.get(zmq.MAX_SOCKETS))

    async def start(self) -> None:
        """Bind the shared SUB (bound topology) and start reading every spec added so far.

        Raises:
            EventsConfigError: if ``bind_endpoint`` cannot be bound.
        """
        if self._started:
            return
        self._started = True
        if self.config.bind_endpoint is not None:
            sock = self._new_sub()
            try:
                sock.bind(self.config.bind_endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise EventsConfigError(
                    f"cannot bind {self.config.bind_endpoint}: {exc}", endpoint=self.config.bind_endpoint
                ) from exc
            sock.setsockopt(zmq.SUBSCRIBE, self.config.bind_topic_prefix.encode())
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            self.bound_endpoint = last.decode() if isinstance(last, bytes) else self.config.bind_endpoint
            self._bound = self._start_source(sock, self.bound_endpoint, None)
            logger.info("kv event subscriber bound on %s", self.bound_endpoint)
        for by_rank in self._specs.values():
            for spec in by_rank.values():
                if spec.endpoint is not None:
                    self._connect(spec)

    async def aclose(self) -> None:
        """Cancel every task and close every socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        sources = list(self._sources.values()) + ([self._bound] if self._bound is not None else [])
        tasks = [s.task for s in sources if s.task is not None]
        tasks += [s.task for s in self._streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for source in sources:
            self._close_source(source)
        self._sources.clear()
        self._streams.clear()
        if self._own_context:
            self._ctx.term()

    # -- workers -----------------------------------------------------------------------------------------------

    def add_worker(self, spec: WorkerSpec) -> None:
        """Start following one worker rank. Callable before or after ``start()`` (on the loop thread).

        Raises:
            EventsConfigError: if (worker_id, dp_rank) is already added, or the endpoint cannot be connected.
        """
        by_rank = self._specs.setdefault(spec.worker_id, {})
        if spec.dp_rank in by_rank:
            raise EventsConfigError(
                f"worker {spec.worker_id} dp_rank {spec.dp_rank} already added", worker_id=spec.worker_id
            )
        by_rank[spec.dp_rank] = spec
        if self._started and spec.endpoint is not None:
            try:
                self._connect(spec)
            except EventsConfigError:
                del by_rank[spec.dp_rank]
                raise
        logger.info("kv events: following worker %s rank %d at %s", spec.worker_id, spec.dp_rank, spec.endpoint)

    def remove_worker(self, worker_id: str) -> bool:
        """Stop following a worker: close its sockets and forget its streams. No ``Resync`` is emitted (the caller
        drops the worker from the index itself).

        Returns:
            Whether the worker was known.
        """
        by_rank = self._specs.pop(worker_id, None)
        self._start_ids.pop(worker_id, None)
        for key in [k for k in self._sources if k[0] == worker_id]:
            source = self._sources.pop(key)
            if source.task is not None:
                source.task.cancel()
            self._close_source(source)
        for key in [k for k in self._streams if k[0] == worker_id]:
            stream = self._streams.pop(key)
            if stream.task is not None:
                stream.task.cancel()
            stream.space.set()  # a shared (bound) reader waiting for room in this queue goes on
        if by_rank is not None:
            logger.info("kv events: stopped following worker %s", worker_id)
        return by_rank is not None

    def notify_start_id(self, worker_id: str, start_id: object) -> None:
        """Report the worker's current start id / epoch (from its load endpoint).

        The first report is recorded. A different one means the worker restarted: each of its streams (one per
        added dp rank, also a rank that sent no batch yet) verifies through replay that it already follows the new
        publisher, else emits ``Resync(worker_id, "start_id_changed")`` before any later batch.
        """
        previous = self._start_ids.get(worker_id)
        self._start_ids[worker_id] = start_id
        if previous is None or previous == start_id:
            return
        logger.info("kv events: worker %s start id changed (%r -> %r)", worker_id, previous, start_id)
        streams = {key: s for key, s in self._streams.items() if s.worker_id == worker_id}
        for dp_rank in self._specs.get(worker_id, {}):  # a rank with no batch yet: its index may hold a snapshot
            if (worker_id, dp_rank) not in streams:
                streams[(worker_id, dp_rank)] = self._stream_for(worker_id, dp_rank)
        for stream in streams.values():
            stream.queue.put_nowait(StreamMarker("verify"))

    def last_seq(self, worker_id: str, dp_rank: int = 0) -> int | None:
        """The last seq applied for a stream, or ``None`` (no baseline yet, or just resynced)."""
        stream = self._streams.get((worker_id, dp_rank))
        return None if stream is None else stream.last_seq

    # -- sockets -----------------------------------------------------------------------------------------------

    def _new_sub(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.config.reconnect_interval_s * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.config.reconnect_interval_max_s * 1000))
        return sock

    def _connect(self, spec: WorkerSpec) -> None:
        assert spec.endpoint is not None  # checked by the callers
        sock = self._new_sub()
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        try:
            sock.connect(spec.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise EventsConfigError(
                f"cannot connect {spec.endpoint}: {exc}", worker_id=spec.worker_id, endpoint=spec.endpoint
            ) from exc
        self._sources[(spec.worker_id, spec.dp_rank)] = self._start_source(sock, spec.endpoint, spec.worker_id, spec)

    def _start_source(
        self, sock: zmq.asyncio.Socket, endpoint: str, worker_id: str | None, spec: WorkerSpec | None = None
    ) -> _Source:
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        source = _Source(endpoint=endpoint, worker_id=worker_id, socket=sock, monitor=monitor, spec=spec)
        source.task = asyncio.get_running_loop().create_task(self._read(source), name=f"kv-events-read {endpoint}")
        return source

    @staticmethod
    def _close_source(source: _Source) -> None:
        with contextlib.suppress(zmq.ZMQError):
            source.socket.disable_monitor()
        source.monitor.close(linger=0)
        source.socket.close(linger=0)

    async def _read(self, source: _Source) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(source.monitor, zmq.POLLIN)
        poller.register(source.socket, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            # Monitor first: a disconnect must mark the streams before any message of the next connection.
            if source.monitor in ready:
                while _has_input(source.monitor):
                    self._on_monitor(source, parse_monitor_message(await source.monitor.recv_multipart()))
            if source.socket in ready:
                for _ in range(64):
                    if not _has_input(source.socket):
                        break
                    await self._on_message(source, await source.socket.recv_multipart())
                await asyncio.sleep(0)

    def _on_monitor(self, source: _Source, event: Mapping[str, object]) -> None:
        kind = event.get("event")
        if kind == zmq.EVENT_DISCONNECTED:
            self.counters.num_disconnects[source.endpoint] += 1
            source.was_disconnected = True
            logger.info("kv events: disconnected from %s; its streams will be verified", source.endpoint)
            for stream in self._streams.values():
                if source.worker_id is None or stream.worker_id == source.worker_id:
                    stream.queue.put_nowait(StreamMarker("suspect"))
        elif kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED) and source.was_disconnected:
            source.was_disconnected = False
            self.counters.num_reconnects[source.endpoint] += 1
            logger.info("kv events: reconnected to %s", source.endpoint)

    # -- messages ----------------------------------------------------------------------------------------------

    def _worker_of(self, source: _Source, topic: bytes) -> str | None:
        if source.worker_id is not None:
            return source.worker_id
        prefix = self.config.bind_topic_prefix
        try:
            text = topic.split(b"\x00", 1)[0].decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        worker_id = text[len(prefix) :].split("@", 1)[0] if text.startswith(prefix) else ""
        if not worker_id:
            self.counters.drop("?", DropKind.BAD_TOPIC, f"topic {topic[:80]!r}")
            return None
        if worker_id not in self._specs:
            if not self.config.accept_unknown_workers:
                self.counters.drop(worker_id, DropKind.UNKNOWN_WORKER, f"topic {text!r} names no added worker")
                return None
            self._specs[worker_id] = {0: WorkerSpec(worker_id=worker_id)}
        return worker_id

    async def _on_message(self, source: _Source, frames: list[bytes]) -> None:
        label = source.worker_id or "?"
        if len(frames) != 3:
            self.counters.drop(label, DropKind.FRAME_COUNT, f"{len(frames)} frames from {source.endpoint}")
            return
        topic, seq_frame, payload = frames
        if len(seq_frame) != 8:
            self.counters.drop(label, DropKind.BAD_SEQ_FRAME, f"seq frame of {len(seq_frame)} bytes")
            return
        worker_id = self._worker_of(source, topic)
        if worker_id is None:
            return
        by_rank = self._specs[worker_id]
        spec = source.spec or by_rank.get(0) or next(iter(by_rank.values()))
        seq = int.from_bytes(seq_frame, "big")
        block_size = spec.block_size or self.config.default_block_size
        batch = self._decoder.decode(
            payload, worker_id=worker_id, seq=seq, block_size=block_size, default_dp_rank=spec.dp_rank
        )
        dp_rank = spec.dp_rank if batch is None else batch.dp_rank
        if dp_rank not in by_rank:
            self.counters.drop(
                worker_id,
                DropKind.UNKNOWN_DP_RANK,
                f"batch {seq} of dp rank {dp_rank}; the worker's ranks are {sorted(by_rank)}",
            )
            if source.spec is None:
                return
            # Connect topology: one publisher, one seq counter; the batch still consumes its seq on its rank.
            dp_rank, batch = source.spec.dp_rank, None
        stream = self._stream_for(worker_id, dp_rank)
        stream.queue.put_nowait(QueuedBatch(seq=seq, digest=xxhash.xxh3_64_intdigest(payload), batch=batch))
        if stream.queue.qsize() >= self.config.max_pending_batches:
            stream.space.clear()
            await stream.space.wait()

    def _stream_for(self, worker_id: str, dp_rank: int) -> RankStream:
        key = (worker_id, dp_rank)
        stream = self._streams.get(key)
        if stream is None:
            by_rank = self._specs[worker_id]
            spec = by_rank.get(dp_rank)
            stream = RankStream(
                worker_id=worker_id,
                dp_rank=dp_rank,
                replay_endpoint=None if spec is None else spec.replay_endpoint,
                block_size=(spec.block_size if spec is not None else None) or self.config.default_block_size,
            )
            stream.space.set()
            stream.task = asyncio.get_running_loop().create_task(
                self._sequencer.run(stream), name=f"kv-events-stream {worker_id}/{dp_rank}"
            )
            self._streams[key] = stream
        return stream
