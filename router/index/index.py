"""The prefix index: which worker holds which prefix, on which tier.

``block_hash`` is our own chained hash (``router.block_hash``), so a hash identifies a whole prefix and the
"radix tree" needs no per-node child tables for lookups: one dict maps a block hash to a dense id, and a prompt's
positions are probed as ``lane[id_of.get(h, 0)]`` in one holder-mask list per (cache group, medium). One entry
per block regardless of how many workers hold it; a holding is one bit.

Built by composition: ``PrefixIndex`` owns one ``IndexState`` (the tables) and gives it to collaborators, each
one concept in its own module, which it calls; nothing inherits from anything::

    PrefixIndex ── state ─────► IndexState   state.py       the tables (layout, invariants, gap counts) and the
       │                          ▲ ▲ ▲ ▲                   id / entry primitives
       ├── holdings ─► Holdings ──┘ │ │ │    holdings.py    a slot's bit on entries: copies, approximate
       │                  ▲ ▲       │ │ │                   confirmation, gap accounting
       ├── upkeep ───► Upkeep ──────┘ │ │    upkeep.py      clearing workers and tiers, the block cap (pruning,
       │                  ▲           │ │                   LRU), approximate mode (TTL)
       ├── ingest ───► Ingest ────────┘ │    ingest.py      BlockStored / BlockRemoved / AllBlocksCleared / Resync,
       │                                │                   parking of orphans (uses holdings, upkeep)
       └── query ────► Query ───────────┘    query.py       match (jump search on the GPU lane), stats, dumps
                                             match.py       pure depth computations (walk, jump search, hybrid)
                                             invariants.py  ``check_invariants``: every derived table recomputed

Measured by ``python -m benchmarks.index`` (1 M blocks, 64 workers, 1.9 M (block, worker) holdings; figures
and method in that module's docstring): 143 bytes per (block, worker) holding (tracemalloc), no Python object
per block (per-id lists and arrays; children lists only at branching blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from events.types import EventBatch, Medium, Resync
from router.index.config import GroupSpec, IndexConfig
from router.index.holdings import Holdings
from router.index.ingest import Ingest
from router.index.invariants import check_invariants
from router.index.pool_restores import restored_since
from router.index.query import PoolHolding, Query
from router.index.result import ChainDump, IndexStats, MatchResult
from router.index.slots import LaneKey
from router.index.state import COUNTER_NAMES, GPU0, OWN_LOWER_MEDIA, POOL_MEDIA, IndexState
from router.index.upkeep import ApproxInsert, Upkeep

__all__ = ["COUNTER_NAMES", "GPU0", "OWN_LOWER_MEDIA", "POOL_MEDIA", "PrefixIndex"]


class PrefixIndex:
    """Per-block holders across workers and tiers, fed by normalized KV events; see ``router.index.state``.

    Not thread-safe: the gateway calls it from one event loop (event sinks and the request path alike).
    Every method runs in time proportional to its input (a batch, a prompt, one worker's blocks), except
    pruning, which is amortized over the stores that triggered it (it brings the index down to
    ``max_blocks * prune_target_ratio`` in one pass of slice writes).

    Attributes:
        config: sizes, caps and TTLs.
        state: the tables (``IndexState``), shared by the collaborators below.
        holdings: ``Holdings``, a slot's bit on entries.
        upkeep: ``Upkeep``, clearing, pruning and approximate mode.
        ingest: ``Ingest``, event application.
        query: ``Query``, ``match`` and introspection.
        sliced_inserts: (worker id, chain's root block hash) -> the ``router.sliced_insert.SlicedInsert`` s of that
            worker and root not finished, oldest first; kept here for that module, which alone reads and writes it
            (one registry per index: the positions they link are this index's).

    Args:
        config: sizes, caps and TTLs.
        pool_members: pool medium -> ids of the workers attached to that pool.
        groups: cache group index -> spec, for hybrid models, on top of ``config.groups`` (group 0 is full
            attention unless given). Events of a group declared neither here nor there are refused.

    Raises:
        IndexConfigError: a non-pool medium in ``pool_members``.
    """

    def __init__(
        self,
        config: IndexConfig | None = None,
        *,
        pool_members: Mapping[Medium, Iterable[str]] | None = None,
        groups: Mapping[int, GroupSpec] | None = None,
    ) -> None:
        self.state = IndexState(config, pool_members=pool_members, groups=groups)
        self.config = self.state.config
        self.holdings = Holdings(self.state)
        self.upkeep = Upkeep(self.state, self.holdings)
        self.ingest = Ingest(self.state, self.holdings, self.upkeep)
        self.query = Query(self.state)
        self.sliced_inserts: dict[tuple[str, int], list[Any]] = {}

    # ------------------------------------------------------------------ events

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of a worker's events, in order. Never raises for bad events: they are counted."""
        self.ingest.apply(batch)

    def apply_resync(self, resync: Resync) -> None:
        """Forget what is known about a worker's own tiers: the resynced dp rank's, or every rank's when
        ``resync.dp_rank`` is ``None`` (pool-tier holdings stay)."""
        self.ingest.apply_resync(resync)

    # ------------------------------------------------------------------ approximate mode

    def insert_approximate(
        self, worker_id: str, block_hashes: Sequence[int], now_s: float, dp_rank: int = 0, ttl_s: float | None = None,
        max_new_blocks: int | None = None,
    ) -> ApproxInsert | None:
        """Record that a routing decision sent these blocks to a worker; see ``Upkeep.insert_approximate``.

        Raises:
            ValueError: ``ttl_s`` or ``max_new_blocks`` is not positive.
        """
        return self.upkeep.insert_approximate(worker_id, block_hashes, now_s, dp_rank, ttl_s, max_new_blocks)

    def withdraw_approximate(self, inserted: ApproxInsert) -> int:
        """Undo one ``insert_approximate``; returns how many blocks went (``Upkeep.withdraw_approximate``)."""
        return self.upkeep.withdraw_approximate(inserted)

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Drop approximate blocks whose TTL ended at or before ``now_s``, looking at no more than ``max_blocks``
        positions (``None``: all that are due); returns how many went."""
        return self.upkeep.expire(now_s, max_blocks)

    def has_expired(self, now_s: float) -> bool:
        """Whether approximate blocks are due at ``now_s`` (``expire`` would drop or skip something)."""
        queue = self.state.approx_queue
        return bool(queue) and queue[0][0] <= now_s

    # ------------------------------------------------------------------ workers and configuration

    def clear_worker(self, worker_id: str, medium: Medium | None = None) -> None:
        """Drop a worker's holdings (all dp ranks) on one medium, or on every medium including pools.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        self.upkeep.clear_worker(worker_id, medium)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (removed from the fleet); a no-op for an unknown worker."""
        self.upkeep.remove_worker(worker_id)

    def clear(self) -> None:
        """Drop every block of every worker (workers, pools and groups stay configured)."""
        self.upkeep.clear()

    def set_pool_members(self, medium: Medium, worker_ids: Iterable[str]) -> None:
        """Declare which workers are attached to a shared pool tier (replaces the previous set).

        Raises:
            IndexConfigError: ``medium`` is not a pool tier.
        """
        self.state.set_pool_members(medium, worker_ids)

    def set_group_spec(self, group_idx: int, spec: GroupSpec) -> None:
        """Declare a cache group or change its kind (hybrid models); events of undeclared groups are refused.

        Raises:
            IndexConfigError: a negative group index.
        """
        self.state.set_group_spec(group_idx, spec)

    # ------------------------------------------------------------------ queries

    def match(self, block_hashes: Sequence[int]) -> MatchResult:
        """How far each worker holds the prompt's prefix, per tier (``Query.match``).

        Args:
            block_hashes: ``[n]`` the prompt's block hashes, root-most first (a ``router.block_hash`` chain).
        """
        return self.query.match(block_hashes)

    @property
    def is_hybrid(self) -> bool:
        """Whether ``match`` applies the hybrid per-group rule (``Query.is_hybrid``)."""
        return self.state.is_hybrid

    @property
    def journal_seq(self) -> int:
        """GPU evictions and pending confirmations reported so far (a stamp to read ``evicted_since`` and
        ``confirmed_since`` against; one read past a journal's next pruning must be held by
        ``open_journal_window``)."""
        return self.state.journal_seq

    def open_journal_window(self) -> int:
        """``journal_seq`` as a decision's stamp, kept readable: the journals keep every entry after it (and after
        any stamp still open) until ``close_journal_window(stamp)``; entries at or before the oldest open stamp go
        at their journal's next pruning (``router.index.slots.Journal``). O(1)."""
        return self.state.windows.add(self.state.journal_seq)

    def close_journal_window(self, seq: int) -> None:
        """Release a stamp of ``open_journal_window`` (a decision answered or dropped); an unknown one is ignored.
        O(1)."""
        self.state.windows.release(seq)

    def evicted_since(self, worker_id: str, block_hash: int, seq: int) -> bool:
        """Whether ``worker_id`` reported evicting ``block_hash`` from its GPU (any dp rank) after the index's
        ``journal_seq`` was ``seq``, a stamp held open (``open_journal_window``; each slot's journal keeps at most its
        latest ``MAX_EVICTED`` evictions)."""
        return any(slot.evicted.get(block_hash, 0) > seq for slot in self.state.worker_slots(worker_id))

    def any_evicted_since(self, worker_id: str, block_hashes: Sequence[int], seq: int) -> bool:
        """``evicted_since`` for any of ``block_hashes``, reading the worker's slots once (a mismatch's cause is
        found per request on the answer path; a slot that reported no eviction costs one test)."""
        for slot in self.state.worker_slots(worker_id):
            evicted = slot.evicted
            if evicted and any(evicted.get(h, 0) > seq for h in block_hashes):
                return True
        return False

    def miss_cause(self, worker_id: str, block_hashes: Sequence[int], first: int, end: int, seq: int, *,
                   pending_end: int | None = None) -> str | None:
        """Why ``worker_id`` did not serve ``block_hashes[first:end]`` from cache, from its journals since ``seq``
        (the honesty check's mismatch cause, read once per mismatched answer): ``"evicted"`` when it reported
        evicting one of them (``any_evicted_since``) or, for a member of a shared pool, the pool lost one of them
        (a ``BlockRemoved`` of the pool's medium, ``IndexState.pool_evicted``), ``"pending"`` when
        ``block_hashes[first]`` was a pending entry a store confirmed since (``confirmed_since``), ``"evicted"`` too
        when the worker put ``block_hashes[first]`` to its shared pool since (``router.index.pool_restores``: the
        pool had lost it), else ``None``. With ``pending_end`` (the blocks the decision credited on GPU), a confirm
        of a block at or past it is no ``"pending"`` cause: that entry was the request's own.
        A worker whose journals are empty costs one test per slot."""
        if first >= end:
            return None
        state = self.state
        for medium, lost in state.pool_evicted.items():
            if lost and worker_id in state.pool_members.get(medium, ()) and any(
                lost.get(block_hashes[i], 0) > seq for i in range(first, end)
            ):
                return "evicted"
        slots = [slot for slot in state.worker_slots(worker_id) if slot.evicted or slot.confirmed or slot.pool_stored]
        if not slots:
            return None
        for slot in slots:
            evicted = slot.evicted
            if evicted and any(evicted.get(block_hashes[i], 0) > seq for i in range(first, end)):
                return "evicted"
        head = block_hashes[first]
        if (pending_end is None or first < pending_end) and any(slot.confirmed.get(head, 0) > seq for slot in slots):
            return "pending"
        if restored_since(state, worker_id, head, seq):
            return "evicted"  # the pool lacked it at the worker's put, after the decision (router.index.pool_restores)
        return None

    def confirmed_since(self, worker_id: str, block_hash: int, seq: int) -> bool:
        """Whether a store of ``worker_id`` confirmed ``block_hash``, until then only a pending entry, after the
        index's ``journal_seq`` was ``seq``: at that time the block was still being computed by a request in
        flight (``seq`` held open as for ``evicted_since``)."""
        return any(slot.confirmed.get(block_hash, 0) > seq for slot in self.state.worker_slots(worker_id))

    def num_blocks(self) -> int:
        """Indexed blocks (entries)."""
        return self.state.num_entries

    def pool_holdings(self, medium: Medium = Medium.MOONCAKE) -> list[PoolHolding]:
        """Every holding on a pool tier's lanes (``Query.pool_holdings``): what a pool watcher checks."""
        return self.query.pool_holdings(medium)

    def stats(self) -> IndexStats:
        """Sizes per worker and tier, and the counters."""
        return self.query.stats()

    def dump_worker(self, worker_id: str) -> list[ChainDump]:
        """A worker's chains (group 0), each from its first held block to a held leaf, sorted.

        Raises:
            UnknownWorkerError: the worker was never seen.
        """
        return self.query.dump_worker(worker_id)

    def holder_mask(self, block_hash: int, lane_key: LaneKey = GPU0) -> int:
        """Slot bits holding a block on one lane (0 when unknown); for tests and debugging."""
        return self.state.holder_mask(block_hash, lane_key)

    def check_invariants(self) -> None:
        """Recompute the derived structures from scratch and compare (for tests and debugging; O(index)).

        Raises:
            RuntimeError: the id tables, children, dangling keys, the eviction log, ``num_held`` or the gap
                counts disagree with the parent links and the lanes.
        """
        check_invariants(self.state)
