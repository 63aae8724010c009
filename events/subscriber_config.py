"""The subscriber's configuration: ``SubscriberConfig`` (the gateway's ``events.subscriber`` section) and
``WorkerSpec`` (one followed event source: a worker's publisher for one data-parallel rank).

Both are frozen msgspec structs validated on decode (``router.config``); ``events.subscriber`` re-exports them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """One event source: a worker's publisher for one data-parallel rank."""

    worker_id: str
    """The worker this stream belongs to (the id the index and the policies use)."""
    endpoint: str | None = None
    """Connect topology: the worker's PUB address, e.g. ``tcp://10.0.0.5:5557`` (dp-rank offset already applied).
    ``None`` in the bound topology (the worker connects to us with topic ``kv@<worker_id>@<model>``)."""
    replay_endpoint: str | None = None
    """The worker's replay ROUTER address for this rank, or ``None`` (gaps then force a resync)."""
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Rank assumed for batches that carry none."""
    topic: str = ""
    """Connect topology: topic prefix to subscribe to (``""`` receives everything)."""
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """The worker's GPU block size in tokens; GPU-tier stores with another size are refused. ``None``: use
    ``SubscriberConfig.default_block_size``."""


class SubscriberConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Configuration of the subscriber (the gateway's ``events.subscriber`` section; keys are the field names)."""

    bind_endpoint: str | None = None
    """Bound topology: address our SUB binds (e.g. ``tcp://*:5557``); ``None`` for the connect topology only."""
    bind_topic_prefix: str = "kv@"
    """Bound topology: topic prefix subscribed to; the worker id is the topic's next ``@``-separated part."""
    accept_unknown_workers: bool = False
    """Bound topology: accept batches from workers never added (with default settings) instead of dropping them."""
    replay_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """Longest wait for the next replay reply, in seconds."""
    replay_total_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Longest whole replay, in seconds: a replay endpoint that keeps answering without ending (replies out of
    the asked range, say) cannot hold the stream; past it the gap is given up like a timed-out replay."""
    max_replay_batches: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    """A gap longer than this many batches is not replayed (resync instead)."""
    reconnect_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    """First ZMQ reconnect interval, in seconds."""
    reconnect_interval_max_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    """Upper bound of ZMQ's reconnect back-off, in seconds."""
    rcvhwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    """ZMQ receive high-water mark, in messages (beyond it ZMQ drops; replay closes the gap)."""
    max_blocks_per_slice: Annotated[int, msgspec.Meta(ge=1)] = 4096
    """Blocks delivered to the sink between two yields to the event loop."""
    max_pending_batches: Annotated[int, msgspec.Meta(ge=1)] = 1024
    """Decoded batches queued per stream before the reader waits (backpressure to the socket)."""
    default_block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """GPU block size for specs that give none; ``None`` accepts any (token counts are still checked)."""

