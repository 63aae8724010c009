"""Per-engine bookkeeping of the prefix index: one ``Slot`` per (worker, dp_rank).

vLLM data-parallel ranks (and SGLang attention-DP ranks) are separate engines with separate caches and
separate engine-hash spaces, so the index keeps one slot per (worker_id, dp_rank). Each slot owns one bit of
every holder mask; ``match`` reports a worker's best rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from events.types import BlockStored, Medium

LaneKey = tuple[int, Medium]
"""(cache group index, medium): one holder-mask table of the index."""


MAX_EVICTED = 65536
"""Most blocks a journal (``Slot.evicted``, ``Slot.confirmed``, ``Slot.pool_stored``, ``IndexState.pool_evicted``)
remembers, whatever decisions are still open: past it the oldest half goes (``Journal.prune``)."""
JOURNAL_PRUNE_MIN = 4096
"""Length at which a journal is first pruned of the entries no open decision can read (``Journal``)."""


class Journal(dict[int, int]):
    """Our block hash -> the index's journal sequence number when it was last stamped, oldest first: what the
    honesty check reads against a decision's stamp (``PrefixIndex.evicted_since``: an entry counts when its number
    is above the stamp).

    An entry whose number is at most ``floor`` (``IndexState.journal_floor``: the stamp of the oldest decision still
    open, or the current number when none is) can answer no open or later decision, so a pruning drops it: once the
    journal holds ``prune_at`` entries (``JOURNAL_PRUNE_MIN`` at first, then twice what the last pruning kept, at
    most ``MAX_EVICTED + 1``) it is rebuilt from the entries above ``floor``, and past ``MAX_EVICTED`` from the
    newest ``MAX_EVICTED // 2`` of those. The rebuild makes a new table: a dict keeps the table of its peak length
    after deletions, which is what a journal of a busy worker would otherwise hold. Amortized O(1) per entry (a
    pruning of ``n`` entries comes at least ``n / 2`` entries after the last one, or once at the cap).

    Attributes:
        prune_at: the length that triggers the next pruning.
    """

    __slots__ = ("prune_at",)

    def __init__(self) -> None:
        super().__init__()
        self.prune_at = JOURNAL_PRUNE_MIN

    def note(self, block_hash: int, seq: int, floor: Callable[[], int]) -> None:
        """Stamp ``block_hash`` with ``seq`` as the newest entry; prune (``floor()`` read only then) at
        ``prune_at``."""
        self.pop(block_hash, None)
        self[block_hash] = seq
        if len(self) >= self.prune_at:
            self.prune(floor())

    def prune(self, floor: int) -> None:
        """Keep the entries stamped above ``floor`` (the newest ``MAX_EVICTED // 2`` of them when the journal is
        over ``MAX_EVICTED``), in a new table."""
        kept = [(block_hash, seq) for block_hash, seq in self.items() if seq > floor]
        if len(self) > MAX_EVICTED:
            kept = kept[-(MAX_EVICTED // 2):]
        self.clear()
        self.update(kept)
        self.prune_at = min(MAX_EVICTED + 1, max(JOURNAL_PRUNE_MIN, 2 * len(self)))


class JournalWindows:
    """The journal stamps of the decisions still open (``PrefixIndex.open_journal_window``), each with how many
    decisions share it.

    Attributes:
        open: stamp -> number of open decisions stamped with it.
    """

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[int, int] = {}

    def add(self, seq: int) -> int:
        """Hold ``seq`` open for one more decision; returns it. O(1)."""
        self.open[seq] = self.open.get(seq, 0) + 1
        return seq

    def release(self, seq: int) -> None:
        """Release one decision's stamp ``seq``; an unknown stamp is ignored. O(1)."""
        count = self.open.get(seq)
        if count is None:
            return
        if count > 1:
            self.open[seq] = count - 1
        else:
            del self.open[seq]
            if not self.open:
                self.open = {}  # a fresh table: a burst of decisions leaves none of its peak size

    def floor(self, current_seq: int) -> int:
        """The stamp at or below which no open decision reads a journal entry: the oldest open one, or
        ``current_seq`` (the index's ``journal_seq``) when none is open. O(open decisions); read only when a journal
        prunes."""
        return min(self.open, default=current_seq)


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
            block from its group 0 GPU lane (``BlockRemoved``), as far back as an open decision reads (``Journal``);
            the honesty check reads it to tell an eviction after the decision from a wrong prediction.
        confirmed: our hash -> the journal sequence number when a ``BlockStored`` confirmed that block, held until
            then only as a pending entry of a routed request (a ``Journal`` too).
        pool_stored: our hash -> the journal sequence number when this slot last announced putting that block to a
            shared pool it is a member of (``BlockStored`` of the pool's medium, group 0; a ``Journal`` too): a
            worker puts only an object the pool lacks, so a store after a decision that priced the block in the
            pool says the pool lost it in between (``router.index.pool_restores``).
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
        "pool_stored",
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
        self.evicted = Journal()
        self.confirmed = Journal()
        self.pool_stored = Journal()

    def note_evicted(self, block_hash: int, seq: int, floor: Callable[[], int]) -> None:
        """Journal one GPU eviction (``evicted``; ``floor``: ``IndexState.journal_floor``)."""
        self.evicted.note(block_hash, seq, floor)

    def note_confirmed(self, block_hash: int, seq: int, floor: Callable[[], int]) -> None:
        """Journal one pending entry confirmed by the worker's store (``confirmed``; ``floor`` as above)."""
        self.confirmed.note(block_hash, seq, floor)

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
