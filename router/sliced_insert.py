"""A routed request's approximate (or pending) index entries, inserted root-first in bounded slices.

``PrefixIndex.insert_approximate`` links the new blocks of a chain in bulk, at C speed but in one step: the first
turn of a 100K-token conversation (about 6,100 new blocks of 16 tokens) held the event loop for 2-10 ms in that one
call on a busy 2-core host (``python -m benchmarks long_turns``). ``SlicedInsert`` makes the same insertion as a
sequence of ``insert_approximate(chain, max_new_blocks=s)`` calls, ``s = INSERT_SLICE_BLOCKS``, each linking at
most ``s`` blocks past what the worker holds of the chain::

    chain   c[0 ..... k ......................................... n)     the worker holds c[0 .. k) already
    call 1  c[0 ..... k .. k+s)                at routing time (the request is forwarded after it)
    call 2  c[0 ..... k ........ k+2s)         the next turn of the event loop (``loop.call_soon``)
    ...
    call m  c[0 ......................................................... n)

Each call is a whole ``insert_approximate`` (the index's invariants hold after it) and adds the blocks right after
the ones held, so the chain's held blocks grow from the root: a ``match`` that runs between two slices sees a
prefix of the chain held, never a block without its parent. A call finds where the one before stopped in O(log n)
(``router.index.approximate``) and extends the same record in place, so the slices together cost what one call
costs plus O(log n) each; a following turn (a few new blocks) is one call. Every call uses the decision's
``now_s``: all slices expire together.

Withdrawal (``withdraw``: the request was refused or served elsewhere) cancels the slices still to come and undoes
the inserted ones: one withdrawal of the whole range when they extended one record (the usual case, exactly what
withdrawing one whole insertion does, ``join_inserts``), else each slice's, leaf-most first. The slices stop when
the worker's slot goes (a removed worker must not come back through a late slice), and when a slice gets no further
than the one before (its blocks were evicted meanwhile, over ``approx_max_blocks``). A slot with gaps is given the
whole chain in one call (its insertion scans every position anyway).

Insertions of one chain root for one worker run one after another. Two requests of one conversation routed to one
worker while the first one's slices are in progress would otherwise interleave: the second's slices link positions
the first had still to link, in the first's record, under the second's expiry, and withdrawing the second drops
them (and with them the first's blocks below them). So the index keeps a registry, ``sliced_inserts``: (worker id,
root block hash) -> the insertions of that worker and root not finished, oldest first. A new insertion whose key
has one waits behind it (nothing inserted; withdrawn meanwhile, it leaves the queue having inserted nothing), and
the next in the queue starts on the turn of the loop after the one before it finished (done, withdrawn, or stopped)::

    A  c[0 .. s)  c[0 .. 2s)  ...  c[0 .. n)                          A routed first, its slices in progress
    B             (waits)     ...  (waits)    c[0 .. n) (a refresh)   B routed while A's were, on the same worker

The result of each step is that of whole insertions made in routing order (``A`` then ``B``), and a withdrawal
is that of one whole insertion at that point: ``B`` withdrawn before its start drops nothing, ``A`` withdrawn
before it finished drops what it had inserted and ``B`` then inserts the whole chain itself. Two chains with one
root share at least the root block and may share any prefix; chains with different roots share no block (the hash
is chained), so they never wait for each other. Chains that share only a system prompt wait too (one key per
root keeps the check to one lookup); the wait is the slices still to come ahead (one per turn of the loop), and
only an insertion of more than ``slice_blocks`` new blocks leaves any. When the worker's slot went while one ran,
the ones queued behind it stop too (the removed worker does not come back). An insertion whose loop no longer runs
the queue ahead of it (a synchronous caller, or another loop) first finishes that queue, then proceeds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from router.index.approximate import ApproxInsert, join_inserts
from router.index.slots import Slot

INSERT_SLICE_BLOCKS = 1024
"""New blocks one ``insert_approximate`` call of a ``SlicedInsert`` links at most (16K tokens at 16 tokens a block):
0.4-1.6 us a block on a busy 2-core host, so 0.5-1.6 ms of the event loop per slice."""


class ApproxIndex(Protocol):
    """The part of ``router.index.PrefixIndex`` a ``SlicedInsert`` uses."""

    @property
    def sliced_inserts(self) -> dict[tuple[str, int], list[SlicedInsert]]: ...

    def insert_approximate(
        self, worker_id: str, block_hashes: Sequence[int], now_s: float, dp_rank: int = 0,
        ttl_s: float | None = None, max_new_blocks: int | None = None,
    ) -> ApproxInsert | None: ...

    def withdraw_approximate(self, inserted: ApproxInsert) -> int: ...


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class SlicedInsert:
    """One chain's approximate insertion for one worker, root-first in slices, after the insertions of that worker
    and chain root that were not finished when it was made (module docstring).

    Attributes:
        block_hashes: the whole chain, root-most first.
        is_done: every slice is in, or the insertion stopped (withdrawn, or the worker's slot went, maybe while it
            waited).
        is_waiting: queued behind an unfinished insertion of the same worker and root; nothing inserted yet.
    """

    __slots__ = ("_end", "_handle", "_index", "_key", "_loop", "_now_s", "_parts", "_queue", "_slice_blocks",
                 "_slot", "_ttl_s", "_worker_id", "block_hashes", "is_done", "is_waiting")

    def __init__(self, index: ApproxIndex, worker_id: str, block_hashes: Sequence[int], now_s: float,
                 ttl_s: float | None = None, slice_blocks: int = INSERT_SLICE_BLOCKS) -> None:
        """Insert the first slice now and schedule the rest on the running event loop, one slice per turn of it
        (all of them now when no loop runs); behind an unfinished insertion of the same worker and chain root,
        wait for it instead (module docstring).

        Args:
            index: the model's index (its ``sliced_inserts`` registry is this class's).
            worker_id: the chosen worker.
            block_hashes: ``[n]`` the request's block hashes, root-most first.
            now_s: monotonic time of the decision, in seconds (every slice's insertion time).
            ttl_s: the entries' lifetime in seconds, or ``None`` for the index's ``approx_ttl_s``.
            slice_blocks: new blocks per call (> 0).

        Raises:
            ValueError: ``ttl_s`` or ``slice_blocks`` is not positive (before anything is inserted or queued).
        """
        if slice_blocks <= 0:
            raise ValueError(f"slice_blocks must be positive, got {slice_blocks}")
        if ttl_s is not None and ttl_s <= 0.0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._index = index
        self._worker_id = worker_id
        self.block_hashes = block_hashes
        self._now_s = now_s
        self._ttl_s = ttl_s
        self._slice_blocks = slice_blocks
        self._parts: list[ApproxInsert] = []
        self._handle: asyncio.Handle | None = None
        self._loop = loop = _running_loop()
        self._key = key = (worker_id, block_hashes[0]) if block_hashes else None
        self._queue: list[SlicedInsert] | None = None
        self._slot: Slot | None = None  # the worker's slot, once this insertion or the one before it made a part
        self._end = 0
        self.is_done = False
        self.is_waiting = False
        registry = index.sliced_inserts
        ahead = registry.get(key) if key is not None else None
        if key is not None and ahead and ahead[0]._loop is not loop:  # left by a loop not running here: finish it
            ahead[0]._finish_now()
            ahead = registry.get(key)
        if ahead:
            ahead.append(self)
            self._queue = ahead
            self.is_waiting = True
            return
        self._start_now()

    def _start_now(self) -> None:
        """The first slice now; the rest on the loop (registered under the key meanwhile), or now without one."""
        self.is_waiting = False
        self._insert_next()
        if self.is_done:
            self._leave()
            return
        loop = self._loop
        if loop is None or loop is not _running_loop():  # a synchronous caller: the whole chain now
            self._finish_now()
            return
        if self._queue is None and self._key is not None:  # the first of its key: registered while in progress
            self._queue = self._index.sliced_inserts[self._key] = [self]
        self._handle = loop.call_soon(self._step)

    def _finish_now(self) -> None:
        """Every slice still to come, now; then the next in the queue starts (so a whole queue runs now)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.is_waiting = False
        while not self.is_done:
            self._insert_next()
        self._leave()

    def _is_slot_gone(self) -> bool:
        return self._slot is not None and not self._slot.is_live

    def _insert_next(self) -> None:
        if self._is_slot_gone():  # the worker was removed (or the index cleared) meanwhile
            self.is_done = True
            return
        part = self._index.insert_approximate(self._worker_id, self.block_hashes, self._now_s, ttl_s=self._ttl_s,
                                              max_new_blocks=self._slice_blocks)
        if part is not None:
            self._parts.append(part)
            if self._slot is None:
                self._slot = part.slot
        # Done unless this call added blocks up to its cap, short of the chain's end, and got further than the one
        # before (blocks evicted meanwhile, over ``approx_max_blocks``, must not make the slices go round forever).
        end = part.end if part is not None and part.record is not None else len(self.block_hashes)
        self.is_done = end >= len(self.block_hashes) or end <= self._end
        self._end = end

    def _step(self) -> None:
        self._handle = None
        if self.is_waiting:  # the one before finished: this one's turn
            self._start_now()
            return
        self._insert_next()
        if self.is_done:
            self._leave()
        else:
            self._handle = asyncio.get_running_loop().call_soon(self._step)

    def _leave(self) -> None:
        """Leave the queue, once; the head's successor starts on the next turn of the loop (or now, when that
        loop does not run here), or, when the worker's slot went, every one queued stops with nothing inserted."""
        queue, self._queue = self._queue, None
        if queue is None:
            return
        is_head = queue[0] is self
        queue.remove(self)
        if not is_head:
            return
        if self._is_slot_gone():
            for other in queue:
                other._queue = None
                other.is_waiting = False
                other.is_done = True
            queue.clear()
        registry = self._index.sliced_inserts
        if not queue:
            if self._key is not None and registry.get(self._key) is queue:
                del registry[self._key]
            return
        successor = queue[0]
        successor._slot = self._slot
        loop = successor._loop
        if loop is not None and loop is _running_loop():
            successor._handle = loop.call_soon(successor._step)
        else:
            successor._finish_now()

    def withdraw(self) -> int:
        """Cancel the slices to come and undo the inserted ones (module docstring); returns how many blocks went.
        One still waiting leaves its queue having inserted nothing (0)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.is_done = True
        self.is_waiting = False
        parts, self._parts = self._parts, []
        num_dropped = sum(self._index.withdraw_approximate(p) for p in join_inserts(parts))
        self._leave()
        return num_dropped
