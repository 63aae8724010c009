"""Per-engine bookkeeping of the prefix index: one ``Slot`` per (worker, dp_rank).

vLLM data-parallel ranks (and SGLang attention-DP ranks) are separate engines with separate caches and
separate engine-hash spaces, so the index keeps one slot per (worker_id, dp_rank). Each slot owns one bit of
every holder mask; ``match`` reports a worker's best rank.
"""

from __future__ import annotations

from collections import deque

from events.types import BlockStored, Medium

LaneKey = tuple[int, Medium]
"""(cache group index, medium): one holder-mask table of the index."""


MAX_EVICTED = 65536
"""Blocks each slot's eviction journal remembers (``Slot.evicted``)."""


def journal(entries: dict[int, int], block_hash: int, seq: int) -> None:
    """Stamp ``block_hash`` with ``seq`` as the newest entry, dropping the oldest half past ``MAX_EVICTED``."""
    entries.pop(block_hash, None)
    entries[block_hash] = seq
    if len(entries) > MAX_EVICTED:
        keep = list(entries.items())[MAX_EVICTED // 2:]
        entries.clear()
        entries.update(keep)


class Slot:
    """What the index knows about one engine (worker, dp_rank).

    Invariants:
      * ``engine`` maps every engine hash the slot stored (and has not removed everywhere) to our block hash.
        Every block the slot holds on a lane, except approximate ones and ancestors marked by a multi-block
        offload store (``span_held``), is the value of at least one ``engine`` entry; clearing the slot
        therefore visits ``engine.values()``, ``span_held`` and ``approx`` only: O(its blocks).
      * ``copies[(lane, h)]`` is the number of physical copies beyond the first (absent when 1).
      * ``num_held[lane]`` equals the number of lane entries with this slot's bit (kept incrementally).

    Attributes:
        worker_id: the worker.
        dp_rank: the engine's data-parallel rank.
        bit: bit index in holder masks.
        mask: ``1 << bit``, this slot's bit as a mask.
        engine: engine block hash (u64) -> our block hash.
        spans: (medium, engine hash) -> number of index blocks one engine block covers, only when > 1.
        span_held: (lane, our hash) pairs held only through a multi-block offload span.
        copies: (lane, our hash) -> extra copies.
        num_held: lane -> blocks held.
        approx: our hash -> the ``ApproxRecord`` owning it (approximate mode, group 0 GPU lane;
            ``router.index.approximate``).
        parked: parent engine hash -> stores waiting for it, and their order for dropping the oldest.
        num_gaps: blocks held on the group 0 GPU lane whose parent the slot does not hold there
            (``router.index.state``); 0 lets ``match`` binary-search this slot's depth.
        is_live: false once the slot is removed (stale expiry records skip it).
        warned: index counters this slot's refused events were already logged under at warning level.
        evicted: our hash -> the index's journal sequence number when the worker last reported removing that
            block from its group 0 GPU lane (``BlockRemoved``), the most recent ``MAX_EVICTED`` blocks; the
            honesty check reads it to tell an eviction after the decision from a wrong prediction.
        confirmed: our hash -> the journal sequence number when a ``BlockStored`` confirmed that block, held until
            then only as a pending entry of a routed request (the most recent ``MAX_EVICTED``).
    """

    __slots__ = (
        "worker_id",
        "dp_rank",
        "bit",
        "mask",
        "engine",
        "spans",
        "span_held",
        "copies",
        "num_held",
        "approx",
        "parked",
        "parked_order",
        "num_gaps",
        "is_live",
        "warned",
        "evicted",
        "confirmed",
    )

    def __init__(self, worker_id: str, dp_rank: int, bit: int) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.bit = bit
        self.mask = 1 << bit
        self.engine: dict[int, int] = {}
        self.spans: dict[tuple[Medium, int], int] = {}
        self.span_held: set[tuple[LaneKey, int]] = set()
        self.copies: dict[tuple[LaneKey, int], int] = {}
        self.num_held: dict[LaneKey, int] = {}
        self.approx: dict[int, ApproxRecord] = {}
        self.parked: dict[int, list[BlockStored]] = {}
        self.parked_order: deque[tuple[int, BlockStored]] = deque()
        self.num_gaps = 0
        self.is_live = True
        self.warned: set[str] = set()
        self.evicted: dict[int, int] = {}
        self.confirmed: dict[int, int] = {}

    def note_evicted(self, block_hash: int, seq: int) -> None:
        """Journal one GPU eviction (``evicted``)."""
        journal(self.evicted, block_hash, seq)

    def note_confirmed(self, block_hash: int, seq: int) -> None:
        """Journal one pending entry confirmed by the worker's store (``confirmed``)."""
        journal(self.confirmed, block_hash, seq)

    def num_parked(self) -> int:
        """Stores waiting for a parent."""
        return len(self.parked_order)


class ApproxRecord:
    """The approximate blocks of one chain of one slot (``router.index.approximate`` describes the tree they form).

    Attributes:
        slot: the worker rank holding them.
        hashes: ``[n]`` the chain's block hashes, root-most first.
        start: the first position the record may own (it owns ``hashes[i]``, ``i >= start``, while
            ``slot.approx[hashes[i]] is self``).
        expiry_s: monotonic seconds at which its blocks expire.
        up: the record of the block before ``start`` when this one was made, or ``None``.
        num_children: records made with ``up`` this one (a record with children is not extended in place).
    """

    __slots__ = ("slot", "hashes", "start", "expiry_s", "up", "num_children")

    def __init__(self, slot: Slot, hashes: tuple[int, ...], start: int, expiry_s: float,
                 up: ApproxRecord | None) -> None:
        self.slot = slot
        self.hashes = hashes
        self.start = start
        self.expiry_s = expiry_s
        self.up = up
        self.num_children = 0
