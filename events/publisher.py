"""ZMQ publisher of KV event batches, wire-compatible with vLLM's ``ZmqEventPublisher``.

Frames of one published batch (source: vLLM ``vllm/distributed/kv_events.py``; SGLang copies it)::

    PUB     [topic (UTF-8), seq (8 bytes, big-endian unsigned, 0, 1, 2, ...), payload (msgpack, events.encode)]

Replay (optional ROUTER, always bound), for a client that missed batches::

    request  (as the ROUTER sees it)  [client_identity, b"", start_seq (8 B BE)]
    replies                           [client_identity, b"", seq (8 B BE), payload]   every buffered seq >= start
    end marker                        [client_identity, b"", ff ff ff ff ff ff ff ff, b""]  (-1 signed, empty)

Requests with another frame count are logged and ignored. Only the last ``buffer_steps`` batches (vLLM's bound) and
at most ``buffer_max_bytes`` of payload (ours: a step's batch carries every stored block's token ids, so 10,000 steps
of long prompts hold hundreds of MB) are kept, the oldest dropped first; without a replay endpoint nothing is kept.

Endpoint rules (vLLM's): the PUB **binds** when the endpoint contains ``*`` or ``::``, or uses ``ipc://`` or
``inproc://``; otherwise it **connects** (the llm-d topology, where the gateway binds one SUB). Data-parallel rank
``r`` shifts a TCP port by ``r`` (5557, 5558, ...) and suffixes ``_dp<r>`` to ``ipc``/``inproc`` endpoints; the
replay endpoint is shifted the same way (``offset_endpoint``, the one copy of that rule: the gateway's config and
subscriptions use it too). A port given as ``*`` binds an ephemeral port (tests); the bound address
is then in ``KVEventPublisher.endpoint``.

Threading: ``publish()`` encodes on the caller's thread, appends to the replay buffer and sends with ``NOBLOCK``
under one lock; a PUB never blocks (beyond its high-water mark ZMQ drops, which subscribers see as a gap and
close through replay). It is safe to call from an asyncio event loop thread and from several threads. A daemon
thread serves the replay ROUTER.

Public API:
    PublisherConfig(...)                                  frozen msgspec config (kebab-case keys)
    KVEventPublisher(config, context=None)
        .publish(events, ts_s=None) -> int                the batch's seq
        .endpoint / .replay_endpoint                      resolved addresses (bound ports filled in)
        .num_published / .next_seq
        .num_buffered_batches / .num_buffered_bytes       the replay buffer
        .drop_buffered_before(seq) -> int                 forget batches a full clear made moot
        .close()                                          also a context manager
    bind_or_connect(endpoint) -> bool                     True: bind
    offset_endpoint(endpoint, dp_rank) -> str            (None -> None)
    SEQ_END_MARKER = b"\\xff" * 8
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Annotated, Literal, overload

import msgspec
import zmq

from events.encode import BatchEncoder
from events.errors import EventsConfigError, PublisherClosedError, PublisherError
from events.types import KVEvent

logger = logging.getLogger(__name__)

SEQ_END_MARKER = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker: -1 as 8-byte big-endian signed (``ff`` x 8), sent with an empty payload."""

_REPLAY_POLL_MS = 100


class PublisherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Configuration of one publisher (one per data-parallel rank). Field names follow vLLM's ``KVEventsConfig``."""

    endpoint: str = "tcp://*:5557"
    """PUB address before the dp-rank offset. Bound when it contains ``*``/``::`` or is ipc/inproc, else connected."""
    replay_endpoint: str | None = None
    """ROUTER address for replay before the dp-rank offset (always bound), or ``None`` for no replay."""
    topic: str = ""
    """Topic frame. Empty by default (vLLM); llm-d's bound topology uses ``kv@<worker>@<model>``."""
    buffer_steps: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    """Number of past batches kept for replay."""
    buffer_max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 20
    """Most payload bytes the replay buffer keeps (oldest batches dropped first; the newest is always kept). A gap
    is usually seconds of batches; a subscriber that asks for older seqs gets the buffered tail and resyncs."""
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    """ZMQ send high-water mark of the PUB socket, in messages (0: unlimited)."""
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Data-parallel rank: offsets the ports and is written into every batch."""
    wire_shape: Literal["vllm", "vllm-legacy"] = "vllm"
    """``vllm``: array batch with tagged-map events (vLLM >= 0.24); ``vllm-legacy``: all arrays."""
    linger_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    """How long ``close()`` lets queued messages drain, in seconds."""
    bind: bool | None = None
    """Force the PUB to bind (True) or connect (False); ``None`` applies vLLM's rule (``bind_or_connect``)."""


def bind_or_connect(endpoint: str) -> bool:
    """vLLM's rule: True (bind) for ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, else False (connect)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


MAX_PORT = 65535
"""The largest TCP port a data-parallel rank can be shifted to."""


@overload
def offset_endpoint(endpoint: str, dp_rank: int) -> str: ...


@overload
def offset_endpoint(endpoint: None, dp_rank: int) -> None: ...


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``dp_rank``, for a rank's publisher and for the subscriber alike.

    vLLM's convention (``ZmqEventPublisher.offset_endpoint_port`` in ``vllm/distributed/kv_events.py``): rank 0
    uses the endpoint as configured; rank ``r`` shifts a TCP port by ``r`` and suffixes ``_dp<r>`` to an
    ``inproc://`` name. vLLM itself refuses an ``ipc://`` endpoint at ranks >= 1 (it knows only ``inproc`` and
    ``tcp``); ranks of an ``ipc://`` endpoint get the ``_dp<r>`` suffix of ``inproc://`` here (as TensorRT-LLM's
    publisher does), since an ipc path has no port and each rank needs its own socket file::

        endpoint                 rank 0                   rank 1                     rank 2
        tcp://*:5557             tcp://*:5557             tcp://*:5558               tcp://*:5559
        tcp://10.0.0.5:5557      tcp://10.0.0.5:5557      tcp://10.0.0.5:5558        tcp://10.0.0.5:5559
        ipc:///tmp/kv            ipc:///tmp/kv            ipc:///tmp/kv_dp1          ipc:///tmp/kv_dp2
        inproc://kv              inproc://kv              inproc://kv_dp1            inproc://kv_dp2
        tcp://127.0.0.1:*        unchanged (an ephemeral port: tests bind one socket per rank themselves)

    The scheme is matched as a prefix (``ipc://``, ``inproc://``, ``tcp://``), never as a substring, so a host
    named ``inproc-1`` is not mistaken for an inproc endpoint.

    Args:
        endpoint: ``tcp://host:port``, ``ipc://path`` or ``inproc://name``, or ``None`` (no endpoint: ``None``).
        dp_rank: the rank, >= 0 (0 returns the endpoint unchanged; only a tcp port over 65535 is refused).

    Returns:
        The rank's endpoint, as in the table above.

    Raises:
        EventsConfigError: a negative rank; a tcp port (shifted by the rank) over 65535; for a rank >= 1, a tcp
            endpoint without a numeric port or another scheme.
    """
    if dp_rank < 0:
        raise EventsConfigError(f"dp_rank must be >= 0, got {dp_rank}")
    if endpoint is None:
        return None
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if not port.isdigit():
            if dp_rank == 0:
                return endpoint
            raise EventsConfigError(f"tcp endpoint without a numeric port: {endpoint!r}", endpoint=endpoint)
        shifted = int(port) + dp_rank
        if shifted > MAX_PORT:
            raise EventsConfigError(
                f"rank r uses port {int(port)} + r, so rank {dp_rank} would use port {shifted}, over {MAX_PORT}",
                endpoint=endpoint,
            )
        return endpoint if dp_rank == 0 else f"{host}:{shifted}"
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{dp_rank}"
    raise EventsConfigError(
        f"unsupported endpoint scheme: {endpoint!r} (tcp://, ipc:// or inproc://)", endpoint=endpoint
    )


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


class KVEventPublisher:
    """Publishes batches of normalized KV events on ZMQ, with an optional replay ROUTER.

    Invariants: seqs are assigned 0, 1, 2, ... in ``publish()`` call order, with no holes; with a replay endpoint the
    replay buffer holds the last (seq, payload) pairs in seq order, each exactly as it was sent: at most
    ``buffer_steps`` of them and at most ``buffer_max_bytes`` of payload in all (the newest batch always), and
    ``num_buffered_bytes`` is their payload size; without one it holds nothing.

    Args:
        config: the publisher configuration.
        context: a ZMQ context to share; a private one is created (and terminated on close) when ``None``.

    Raises:
        EventsConfigError: for an endpoint ZMQ cannot bind or connect.
    """

    def __init__(self, config: PublisherConfig, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.config = config
        self._own_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if context is None else context
        self._topic = config.topic.encode("utf-8")
        self._encoder = BatchEncoder(config.wire_shape)
        self._lock = threading.Lock()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque()
        self._is_buffering = config.replay_endpoint is not None
        self.num_buffered_bytes = 0
        self._next_seq = 0
        self._closed = False
        self._is_dropping_sends = False
        self._is_refusing_replay = False
        self._stop = threading.Event()
        self._router: zmq.Socket[bytes] | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, int(config.linger_s * 1000))
        pub_endpoint = offset_endpoint(config.endpoint, config.dp_rank)
        do_bind = bind_or_connect(pub_endpoint) if config.bind is None else config.bind
        self.endpoint = self._open(self._pub, pub_endpoint, do_bind)
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if config.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            replay = offset_endpoint(config.replay_endpoint, config.dp_rank)
            self.replay_endpoint = self._open(self._router, replay, True)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()
        logger.info(
            "kv event publisher %s %s (replay %s, topic %r, dp_rank %d, shape %s)",
            "bound to" if do_bind else "connecting to (a subscriber must bind this address)",
            self.endpoint,
            self.replay_endpoint,
            config.topic,
            config.dp_rank,
            config.wire_shape,
        )

    def _open(self, sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
        try:
            if bind:
                sock.bind(endpoint)
                last = sock.getsockopt(zmq.LAST_ENDPOINT)
                return last.decode() if isinstance(last, bytes) else endpoint
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            self._close_sockets()
            verb = "bind" if bind else "connect"
            raise EventsConfigError(f"cannot {verb} {endpoint}: {exc}", endpoint=endpoint) from exc

    @property
    def next_seq(self) -> int:
        """The seq the next ``publish()`` will use (= number of batches published so far)."""
        return self._next_seq

    @property
    def num_published(self) -> int:
        """Number of batches published since construction."""
        return self._next_seq

    def set_faults(self, *, drop_sends: bool, refuse_replay: bool) -> None:
        """Fault injection for chaos tests (the sim worker's ``/debug/faults``).

        Args:
            drop_sends: number each batch and keep it for replay, but do not send it (as when the send queue is
                full), so a subscriber sees a gap at the next batch sent.
            refuse_replay: read replay requests and answer none.
        """
        with self._lock:
            self._is_dropping_sends = drop_sends
            self._is_refusing_replay = refuse_replay

    def publish(self, events: Sequence[KVEvent], ts_s: float | None = None) -> int:
        """Publish one batch. Never blocks on the network.

        Args:
            events: normalized events, in the order they happened.
            ts_s: wall-clock time of the batch in seconds; ``time.time()`` when ``None``.

        Returns:
            The batch's seq (0 for the first batch of this publisher).

        Raises:
            PublisherClosedError: after ``close()``.
            PublisherError: if ZMQ refuses the message for a reason other than a full queue.
            TypeError: if an element of ``events`` is not a normalized KV event.
        """
        ts = time.time() if ts_s is None else ts_s
        with self._lock:
            if self._closed:
                raise PublisherClosedError("publisher is closed", endpoint=self.endpoint)
            payload = self._encoder.encode(events, ts, self.config.dp_rank)
            seq = self._next_seq
            self._next_seq = seq + 1
            if self._is_buffering:
                self._keep(seq, payload)
            if self._is_dropping_sends:
                return seq
            try:
                self._pub.send_multipart((self._topic, _seq_bytes(seq), payload), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.debug("kv event publisher %s: send queue full, seq %d left to replay", self.endpoint, seq)
            except zmq.ZMQError as exc:
                raise PublisherError(f"send failed: {exc}", endpoint=self.endpoint) from exc
        return seq

    def _keep(self, seq: int, payload: bytes) -> None:
        """Append to the replay buffer, then drop its oldest batches past ``buffer_steps`` or ``buffer_max_bytes``
        (under the lock)."""
        buffer = self._buffer
        buffer.append((seq, payload))
        self.num_buffered_bytes += len(payload)
        max_steps, max_bytes = self.config.buffer_steps, self.config.buffer_max_bytes
        while len(buffer) > 1 and (len(buffer) > max_steps or self.num_buffered_bytes > max_bytes):
            self.num_buffered_bytes -= len(buffer.popleft()[1])

    def drop_buffered_before(self, seq: int) -> int:
        """Forget the buffered batches before ``seq``; returns how many went. For a batch that made them moot (an
        ``AllBlocksCleared`` of every tier): a subscriber whose last seq is older finds no anchor in a replay and
        resyncs from the snapshot, the state those batches would have led to."""
        with self._lock:
            buffer = self._buffer
            num = 0
            while buffer and buffer[0][0] < seq:
                self.num_buffered_bytes -= len(buffer.popleft()[1])
                num += 1
            return num

    @property
    def num_buffered_batches(self) -> int:
        """Batches the replay buffer holds."""
        return len(self._buffer)

    def _replay_batches(self, start_seq: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None  # set before the thread starts
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_REPLAY_POLL_MS):
                    continue
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("kv event replay on %s: receive failed", self.replay_endpoint)
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "kv event replay on %s: ignored a request of %d frames (expected [id, b'', seq8])",
                    self.replay_endpoint,
                    len(frames),
                )
                continue
            if self._is_refusing_replay:
                logger.debug("kv event replay on %s: request left unanswered (fault injection)", self.replay_endpoint)
                continue
            identity = frames[0]
            start_seq = int.from_bytes(frames[2], "big")
            batches = self._replay_batches(start_seq)
            logger.debug("kv event replay on %s: %d batches from seq %d", self.replay_endpoint, len(batches), start_seq)
            try:
                for seq, payload in batches:
                    router.send_multipart((identity, b"", _seq_bytes(seq), payload), copy=False)
                router.send_multipart((identity, b"", SEQ_END_MARKER, b""))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("kv event replay on %s: reply failed", self.replay_endpoint)

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._router is not None:
            self._router.close()
        if self._own_context:
            self._ctx.term()

    def close(self) -> None:
        """Stop the replay thread and close the sockets (queued PUB messages get ``linger_s`` to drain).

        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
