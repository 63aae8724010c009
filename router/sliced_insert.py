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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from router.index.approximate import ApproxInsert, join_inserts

INSERT_SLICE_BLOCKS = 1024
"""New blocks one ``insert_approximate`` call of a ``SlicedInsert`` links at most (16K tokens at 16 tokens a block):
0.4-1.6 us a block on a busy 2-core host, so 0.5-1.6 ms of the event loop per slice."""


class ApproxIndex(Protocol):
    """The part of ``router.index.PrefixIndex`` a ``SlicedInsert`` uses."""

    def insert_approximate(
        self, worker_id: str, block_hashes: Sequence[int], now_s: float, dp_rank: int = 0,
        ttl_s: float | None = None, max_new_blocks: int | None = None,
    ) -> ApproxInsert | None: ...

    def withdraw_approximate(self, inserted: ApproxInsert) -> int: ...


class SlicedInsert:
    """One chain's approximate insertion for one worker, root-first in slices (module docstring).

    Attributes:
        block_hashes: the whole chain, root-most first.
        is_done: every slice is in, or the insertion stopped (withdrawn, or the worker's slot went).
    """

    __slots__ = ("_end", "_handle", "_index", "_now_s", "_parts", "_slice_blocks", "_ttl_s", "_worker_id",
                 "block_hashes", "is_done")

    def __init__(self, index: ApproxIndex, worker_id: str, block_hashes: Sequence[int], now_s: float,
                 ttl_s: float | None = None, slice_blocks: int = INSERT_SLICE_BLOCKS) -> None:
        """Insert the first slice now and schedule the rest on the running event loop, one slice per turn of it
        (all of them now when no loop runs).

        Args:
            index: the model's index.
            worker_id: the chosen worker.
            block_hashes: ``[n]`` the request's block hashes, root-most first.
            now_s: monotonic time of the decision, in seconds (every slice's insertion time).
            ttl_s: the entries' lifetime in seconds, or ``None`` for the index's ``approx_ttl_s``.
            slice_blocks: new blocks per call (> 0).

        Raises:
            ValueError: ``ttl_s`` or ``slice_blocks`` is not positive.
        """
        if slice_blocks <= 0:
            raise ValueError(f"slice_blocks must be positive, got {slice_blocks}")
        self._index = index
        self._worker_id = worker_id
        self.block_hashes = block_hashes
        self._now_s = now_s
        self._ttl_s = ttl_s
        self._slice_blocks = slice_blocks
        self._parts: list[ApproxInsert] = []
        self._handle: asyncio.Handle | None = None
        self.is_done = False
        self._end = 0
        self._insert_next()  # a bad ttl_s raises here, before anything is scheduled
        if self.is_done:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller: the whole chain now
            while not self.is_done:
                self._insert_next()
            return
        self._handle = loop.call_soon(self._step)

    def _insert_next(self) -> None:
        parts = self._parts
        if parts and not parts[0].slot.is_live:  # the worker was removed meanwhile
            self.is_done = True
            return
        part = self._index.insert_approximate(self._worker_id, self.block_hashes, self._now_s, ttl_s=self._ttl_s,
                                              max_new_blocks=self._slice_blocks)
        if part is not None:
            parts.append(part)
        # Done unless this call added blocks up to its cap, short of the chain's end, and got further than the one
        # before (blocks evicted meanwhile, over ``approx_max_blocks``, must not make the slices go round forever).
        end = part.end if part is not None and part.record is not None else len(self.block_hashes)
        self.is_done = end >= len(self.block_hashes) or end <= self._end
        self._end = end

    def _step(self) -> None:
        self._handle = None
        self._insert_next()
        if not self.is_done:
            self._handle = asyncio.get_running_loop().call_soon(self._step)

    def withdraw(self) -> int:
        """Cancel the slices to come and undo the inserted ones (module docstring); returns how many blocks went."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.is_done = True
        parts, self._parts = self._parts, []
        return sum(self._index.withdraw_approximate(p) for p in join_inserts(parts))
