"""Index recovery of one worker: its snapshot spliced with its live event batches (pure: no I/O, no clock).

A worker's index entries are rebuilt at start, after a ``Resync`` (publisher restart, unclosable gap, new start
id) and after an admin clear. Where the worker serves a snapshot of its cache (the reference worker's
``GET /kv/snapshot``; vLLM and SGLang serve none), the event path fetches it while this state machine holds the
live batches, then splices the two by sequence number; otherwise the worker warms from its events alone. The
caller (``router.event_path``) does the fetching and applies what this returns, in order, to the worker's index.

States (one ``SnapshotSplice`` per worker)::

                 begin()                       on_snapshot(last_seq)
    (any) ───────────────────► holding ─────────────────────────────► filtering ──(batch last_seq + 1)──► live
                                  │ on_no_snapshot(), or more than        │ batch past a hole: begin() again
                                  │ max_held_batches held: held ones      ▼ and fetch again (at most
                                  ▼ applied, warm on the first batch   holding   max_refetches in a row)
                                live

    holding     live batches are kept in arrival order, none applied (the snapshot may already contain them)
    filtering   the snapshot up to ``last_seq`` is applied. A batch held from before its fetch began was published
                before the snapshot was taken, so the snapshot contains it: it is dropped; one whose seq is past
                ``last_seq`` comes from an earlier run of the publisher (it restarted, with seq from 0, and the
                batch reached us late): dropped too, counted in ``num_stale_dropped``, where splicing it would
                index blocks the new process never held. A batch that came after the fetch began:
                ``seq <= last_seq`` is in it (dropped);
                the next one must be ``last_seq + 1``, else batches between were missed (the subscriber joined
                the stream late): the snapshot is fetched again. A batch the subscriber does not deliver (all its
                events refused) also looks like a hole; the refetches in a row are bounded, then it is applied.
    live        every batch is applied as it comes

``x-kvgate-last-seq`` (the snapshot's header) is the seq of the last batch published before the snapshot was taken,
-1 when none was. Only a worker with one dp rank is spliced (``splices``): the ranks of a multi-rank worker have
separate seq streams and one snapshot cannot name a position in each; such a worker applies its batches at once
and is warm on its first one (or when its snapshot is applied).

Warmness: ``makes_warm`` (and a complete splice) means the worker's index entries are usable from now on: the
caller marks the worker warm if it is not already. Nothing here turns a worker cold: the caller does that before
``begin`` (resync, admin clear), or the worker was never warm yet (start).
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

from events.types import EventBatch

logger = logging.getLogger(__name__)

MAX_HELD_BATCHES = 10_000
"""Live batches held per worker while its snapshot is fetched; past it the snapshot is given up (events only)."""
MAX_SNAPSHOT_REFETCHES = 5
"""Snapshots fetched again in a row because the first batch after the previous one was not its next seq."""

FetchAction = Literal["none", "restart", "cancel"]
"""What the caller does with the worker's snapshot fetch: nothing, start it again from scratch, or stop it."""


class Admitted(NamedTuple):
    """What to do with one live batch (``SnapshotSplice.admit``).

    Attributes:
        batches: batches to apply to the worker's index now, in order (the live one, or every held one).
        makes_warm: applying them makes the worker's index warm (it may be warm already: False does not make it
            cold).
        fetch: ``"restart"``: a hole after the snapshot, fetch it again; ``"cancel"``: too many batches held,
            stop fetching (the held ones are in ``batches``); ``"none"``: leave the fetch as it is.
    """

    batches: tuple[EventBatch, ...]
    makes_warm: bool
    fetch: FetchAction


class Spliced(NamedTuple):
    """The outcome of applying a snapshot (``SnapshotSplice.on_snapshot``).

    Attributes:
        batches: held batches past the snapshot, to apply after it, in order.
        is_complete: the splice closed (the worker is warm); False: a held batch lies past a hole, the remaining
            ones stay held and the snapshot must be fetched again.
    """

    batches: tuple[EventBatch, ...]
    is_complete: bool


_NOTHING = Admitted((), False, "none")


class SnapshotSplice:
    """The splice state of one worker's live batches around its snapshot (see the module docstring).

    Attributes:
        worker_id: the worker (for logs).
        splices: live batches are spliced with the snapshot (one dp rank and a snapshot to be had).
        held: live batches held while the snapshot is fetched, in arrival order; ``None`` when not holding.
        last_seq: while set, batches with ``seq <= last_seq`` are in the applied snapshot; the next must be
            ``last_seq + 1``.
        is_warm_on_first_batch: no snapshot is awaited: the next batch makes the worker warm.
        num_refetches: snapshots fetched again in a row because of a hole after the previous one.
        num_held_before_fetch: the first this many of ``held`` arrived before the current fetch began (the
            snapshot it brings contains them, or they are stale).
        num_stale_dropped: held batches dropped because the snapshot taken after them does not reach their seq
            (the publisher restarted).
    """

    __slots__ = ("worker_id", "splices", "held", "last_seq", "is_warm_on_first_batch", "num_refetches",
                 "num_held_before_fetch", "num_stale_dropped", "_max_held_batches", "_max_refetches")

    def __init__(
        self, worker_id: str, *, splices: bool, max_held_batches: int = MAX_HELD_BATCHES,
        max_refetches: int = MAX_SNAPSHOT_REFETCHES,
    ) -> None:
        """Args:
            worker_id: the worker.
            splices: whether its live batches are spliced with a snapshot (one dp rank, snapshots on).
            max_held_batches: most batches held while fetching; one more gives the snapshot up.
            max_refetches: most snapshots fetched again in a row for a hole after the previous one.

        Raises:
            ValueError: a negative limit.
        """
        if max_held_batches < 0 or max_refetches < 0:
            raise ValueError(f"limits must be >= 0, got max_held_batches={max_held_batches}, "
                             f"max_refetches={max_refetches}")
        self.worker_id = worker_id
        self.splices = splices
        self.held: list[EventBatch] | None = None
        self.last_seq: int | None = None
        self.is_warm_on_first_batch = False
        self.num_refetches = 0
        self.num_held_before_fetch = 0
        self.num_stale_dropped = 0
        self._max_held_batches = max_held_batches
        self._max_refetches = max_refetches

    def begin(self) -> None:
        """A snapshot fetch starts (worker added, resync, admin clear, hole after a snapshot).

        A splicing worker holds its live batches from now on; another one applies them at once and is warm on the
        first. Batches already held stay held, marked as older than this fetch: its snapshot contains them, or
        shows them stale (``on_snapshot``); they are applied only if no snapshot comes (``on_no_snapshot``).
        """
        self.last_seq = None
        self.is_warm_on_first_batch = False
        if self.splices:
            if self.held is None:
                self.held = []
            self.num_held_before_fetch = len(self.held)
        else:
            self.is_warm_on_first_batch = True

    def admit(self, batch: EventBatch) -> Admitted:
        """A live batch arrived: hold it, drop it (already in the snapshot), or apply it."""
        held = self.held
        if held is not None:
            held.append(batch)
            if len(held) <= self._max_held_batches:
                return _NOTHING
            logger.warning("worker %s: over %d batches held for its snapshot; warming from events only",
                           self.worker_id, self._max_held_batches)
            self.held = None
            self.is_warm_on_first_batch = True
            return Admitted(tuple(held), True, "cancel")
        if self.last_seq is not None:
            verdict = self._after_snapshot(batch)
            if verdict == "drop":
                return _NOTHING
            if verdict == "refetch":
                self.begin()
                assert self.held is not None  # begin holds for a splicing worker, and only those filter
                self.held.append(batch)
                self.num_held_before_fetch = len(self.held)  # it came before the fetch the caller restarts
                return Admitted((), False, "restart")
        return Admitted((batch,), self.is_warm_on_first_batch, "none")

    def on_snapshot(self, last_seq: int) -> Spliced:
        """The snapshot up to ``last_seq`` (-1: nothing published before it) was applied to the index.

        Returns:
            The held batches after it to apply; ``is_complete`` False when one lies past a hole (it and the rest
            stay held; fetch again). A worker that does not splice is complete at once. Batches held from before
            the fetch began are never applied (module docstring: in the snapshot, or stale).
        """
        if not self.splices:
            return Spliced((), True)
        held, self.held = self.held or [], None
        num_before, self.num_held_before_fetch = self.num_held_before_fetch, 0
        stale = [b.seq for b in held[:num_before] if b.seq > last_seq]
        if stale:
            self.num_stale_dropped += len(stale)
            logger.warning("worker %s: %d held batches (seq %d..%d) are past its snapshot's last seq %d, taken after "
                           "them: its publisher restarted; dropped", self.worker_id, len(stale), min(stale),
                           max(stale), last_seq)
        held = held[num_before:]
        self.last_seq = last_seq
        applied: list[EventBatch] = []
        for i, batch in enumerate(held):
            if self.last_seq is not None:
                verdict = self._after_snapshot(batch)
                if verdict == "drop":
                    continue
                if verdict == "refetch":
                    self.last_seq = None
                    self.held = held[i:]
                    self.num_held_before_fetch = len(self.held)  # the caller fetches again after this
                    return Spliced(tuple(applied), False)
            applied.append(batch)
        return Spliced(tuple(applied), True)

    def on_no_snapshot(self) -> Admitted:
        """No snapshot can be had (none served, unreachable, not decodable): stop holding.

        Returns:
            The held batches to apply, warm when there was at least one; later batches are applied as they come
            and the first makes the worker warm.
        """
        held, self.held = self.held or [], None
        self.last_seq = None
        self.num_held_before_fetch = 0
        self.is_warm_on_first_batch = True
        return Admitted(tuple(held), bool(held), "none")

    def _after_snapshot(self, batch: EventBatch) -> Literal["apply", "drop", "refetch"]:
        """A batch after the applied snapshot: in it already, the next one, or past a hole."""
        last_seq = self.last_seq
        assert last_seq is not None  # callers check
        if batch.seq <= last_seq:
            return "drop"
        if batch.seq != last_seq + 1 and self.num_refetches < self._max_refetches:
            self.num_refetches += 1
            logger.info("worker %s: batches %d..%d after its snapshot were not seen; fetching it again",
                        self.worker_id, last_seq + 1, batch.seq - 1)
            return "refetch"
        self.last_seq = None
        self.num_refetches = 0
        return "apply"
