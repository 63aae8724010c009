"""Counters of the KV event pipeline, and log-once bookkeeping for bad input.

``EventCounters`` is a plain object owned by one subscriber (no module-level state). The gateway reads it when
Prometheus scrapes and turns each mapping into a labelled metric:

    drops[(worker_id, kind)]            events or messages refused, by ``DropKind``
    resyncs[(worker_id, reason)]        ``Resync`` records emitted, by reason
    num_batches / num_events / num_blocks[worker_id]   delivered to the sink
    num_gaps / num_replay_requests / num_replayed_batches[worker_id]
    num_disconnects / num_reconnects[endpoint]

Everything counted as a drop is also logged: a warning the first time a (worker, kind) pair is seen, debug after.
"""

from __future__ import annotations

import logging
from collections import Counter
from enum import StrEnum

logger = logging.getLogger(__name__)


class DropKind(StrEnum):
    """Why a message, an event or a field was refused. Values are the Prometheus label values."""

    FRAME_COUNT = "frame_count"
    """A multipart message without exactly 3 frames ``[topic, seq, payload]``."""
    BAD_SEQ_FRAME = "bad_seq_frame"
    """A sequence frame that is not 8 bytes."""
    BAD_TOPIC = "bad_topic"
    """A topic that does not name a worker as ``kv@<worker>@<model>`` (bound topology)."""
    UNKNOWN_WORKER = "unknown_worker"
    """A topic naming a worker that was never added (bound topology)."""
    UNKNOWN_DP_RANK = "unknown_dp_rank"
    """A batch whose dp rank is not one of the worker's added ranks (or, from replay, not the replayed stream's):
    the whole batch is dropped and creates no stream."""
    MALFORMED_PAYLOAD = "malformed_payload"
    """Truncated or garbage msgpack, or an outer batch of the wrong shape: the whole batch is dropped."""
    MALFORMED_EVENT = "malformed_event"
    """An event with a missing or wrongly typed field: that event is dropped."""
    UNKNOWN_EVENT = "unknown_event"
    """An event tag no engine is known to send: that event is skipped."""
    UNKNOWN_FIELD = "unknown_field"
    """A field name we do not know in a map event or map batch: the field is skipped, the event kept."""
    UNKNOWN_MEDIUM = "unknown_medium"
    """A ``medium`` string no engine is known to send: that event is dropped."""
    TOKEN_COUNT_MISMATCH = "token_count_mismatch"
    """A GPU-tier BlockStored whose token count is not ``block_size * len(block_hashes)``."""
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    """A GPU-tier block size other than the worker's configured one (or an offload block size that is not a
    multiple of it)."""
    REPEATED_HASH = "repeated_hash"
    """A hash repeated inside one event (or equal to its parent)."""
    REMOTE_LOCALITY = "remote_locality"
    """An event with ``locality`` other than ``LOCAL`` (blocks that do not live on this worker)."""
    DUPLICATE_SEQ = "duplicate_seq"
    """A batch whose seq was already applied."""
    NON_MONOTONIC_SEQ = "non_monotonic_seq"
    """A batch whose seq went back while replay proved the publisher had not restarted."""
    STALE_BATCH = "stale_batch"
    """A batch held while the worker's snapshot was fetched, that arrived before the fetch began and yet lies past
    the snapshot's last seq: its publisher's earlier run sent it (``router.index.recovery``)."""


class EventCounters:
    """Counters of one event pipeline. Not thread-safe: updated from the event loop thread only.

    Attributes:
        drops: refusals by (worker_id, kind).
        resyncs: ``Resync`` records by (worker_id, reason).
        num_batches: batches delivered, by worker.
        num_events: events delivered, by worker.
        num_blocks: blocks carried by delivered BlockStored/BlockRemoved events, by worker.
        num_gaps: forward seq gaps seen, by worker.
        num_replay_requests: replay requests sent, by worker.
        num_replayed_batches: batches applied from replay, by worker.
        num_disconnects: socket monitor disconnects, by endpoint.
        num_reconnects: socket monitor (re)connects after a disconnect, by endpoint.
    """

    def __init__(self) -> None:
        self.drops: Counter[tuple[str, DropKind]] = Counter()
        self.resyncs: Counter[tuple[str, str]] = Counter()
        self.num_batches: Counter[str] = Counter()
        self.num_events: Counter[str] = Counter()
        self.num_blocks: Counter[str] = Counter()
        self.num_gaps: Counter[str] = Counter()
        self.num_replay_requests: Counter[str] = Counter()
        self.num_replayed_batches: Counter[str] = Counter()
        self.num_disconnects: Counter[str] = Counter()
        self.num_reconnects: Counter[str] = Counter()

    def drop(self, worker_id: str, kind: DropKind, detail: str, num: int = 1) -> None:
        """Count ``num`` refusals of ``kind`` for ``worker_id`` and log (warning once per pair, then debug).

        Args:
            worker_id: the worker the input came from (``"?"`` when unknown).
            kind: why it was refused.
            detail: a short human description for the log line.
            num: how many refusals to count.
        """
        key = (worker_id, kind)
        first = key not in self.drops
        self.drops[key] += num
        if first:
            logger.warning(
                "kv events from worker %s: dropped (%s): %s (further drops of this kind are logged at debug)",
                worker_id,
                kind.value,
                detail,
            )
        else:
            logger.debug("kv events from worker %s: dropped (%s): %s", worker_id, kind.value, detail)

    def drops_by_kind(self) -> dict[DropKind, int]:
        """Returns total refusals per kind over all workers (kinds never seen are absent)."""
        totals: dict[DropKind, int] = {}
        for (_, kind), num in self.drops.items():
            totals[kind] = totals.get(kind, 0) + num
        return totals

    def total_drops(self) -> int:
        """Returns the number of refusals of every kind."""
        return sum(self.drops.values())
