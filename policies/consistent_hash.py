"""``consistent_hash``: the session key on a hash ring with virtual nodes.

Ring (Karger et al. 1997): each worker id contributes ``num_virtual_nodes`` points
``xxh3_64(f"{worker_id}#{i}".encode(), seed=0)`` for ``i`` in ``0..num_virtual_nodes-1``; a key hashes to
``xxh3_64(session_key.encode("utf-8"), seed=0)`` and belongs to the first point clockwise (the first point
greater than the key's hash, wrapping around)::

    0 ────●w1───────●w0───●w2────────────●w1─────── 2**64
                 ▲ key  -> w0 (or, w0 not eligible, the next distinct eligible worker clockwise: w2)

The ring is built over **every** worker in the snapshot, eligible or not, and depends only on the set of worker
ids (not on their order), so an unhealthy or draining worker's keys move to their clockwise successors and come
back when it recovers, and adding or removing one worker of N moves about 1/N of the keys. Hashes are xxh3
(stable across processes; never Python's ``hash()``).

Ranking (retries): the first ``NUM_RING_FALLBACKS`` distinct eligible workers clockwise (where the key would
go if the ones before it failed), then the other candidates in configuration order; walking the whole ring for
a full clockwise order would cost a coupon-collector's ~N ln N steps per request for little use.

Requests without a session key fall back to ``least_loaded`` (reason ``"no_session_key"``).
"""

from __future__ import annotations

import bisect
import logging

import xxhash

from policies.base import Decision, RequestView, Snapshot, WorkerState
from policies.baselines import least_loaded_decision
from policies.candidates import eligible_workers, no_worker_decision
from policies.config import ConsistentHashConfig

logger = logging.getLogger(__name__)

__all__ = ["NUM_RING_FALLBACKS", "ConsistentHashPolicy", "HashRing", "key_hash"]

NUM_RING_FALLBACKS = 4
"""Ranking entries taken from the ring walk; the rest of the ranking follows configuration order."""


def key_hash(session_key: str) -> int:
    """Position of ``session_key`` on the ring: xxh3_64 of its UTF-8 bytes, seed 0, as an unsigned int."""
    return xxhash.xxh3_64_intdigest(session_key.encode("utf-8"))


class HashRing:
    """An immutable ring of virtual nodes over a set of worker ids.

    Invariants: ``points`` is sorted ascending; ``owners[i]`` owns ``points[i]``; equal points (a 64-bit
    collision) keep the smaller worker id first, so the ring depends only on the set of ids.

    Args:
        worker_ids: the workers on the ring (duplicates are ignored).
        num_virtual_nodes: points per worker, >= 1.

    Raises:
        ValueError: ``num_virtual_nodes`` < 1.
    """

    def __init__(self, worker_ids: tuple[str, ...], num_virtual_nodes: int) -> None:
        if num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {num_virtual_nodes}")
        self.worker_ids = frozenset(worker_ids)
        pairs = sorted(
            (xxhash.xxh3_64_intdigest(f"{worker_id}#{i}".encode()), worker_id)
            for worker_id in self.worker_ids
            for i in range(num_virtual_nodes)
        )
        self.points: list[int] = [p for p, _ in pairs]
        self.owners: list[str] = [w for _, w in pairs]

    def walk(self, position: int, eligible: set[str], max_num_workers: int | None = None) -> list[str]:
        """Distinct ``eligible`` workers clockwise from ``position``, nearest first.

        Args:
            position: a ring position in [0, 2**64).
            eligible: worker ids that may be returned (others are skipped).
            max_num_workers: stop after this many (``None``: all).

        Returns:
            Eligible workers on the ring in clockwise order from ``position`` (at most ``max_num_workers``);
            empty if none is on it.
        """
        num_points = len(self.points)
        if num_points == 0:
            return []
        wanted = len(eligible & self.worker_ids)
        if max_num_workers is not None:
            wanted = min(wanted, max_num_workers)
        found: list[str] = []
        seen: set[str] = set()
        start = bisect.bisect_right(self.points, position)
        owners = self.owners
        for step in range(num_points):
            owner = owners[(start + step) % num_points]
            if owner in eligible and owner not in seen:
                seen.add(owner)
                found.append(owner)
                if len(found) == wanted:
                    break
        return found


class ConsistentHashPolicy:
    """Session key -> first eligible worker clockwise on the ring; least_loaded without a key.

    The ring is rebuilt only when the snapshot's set of worker ids changes.
    """

    name = "consistent_hash"

    def __init__(self, config: ConsistentHashConfig) -> None:
        self.config = config
        self._ring = HashRing((), config.num_virtual_nodes)
        self._ring_ids: tuple[str, ...] = ()

    def ring_for(self, snapshot: Snapshot) -> HashRing:
        """The ring over ``snapshot``'s workers (cached until the ids change; reordering alone reuses the ring)."""
        ids = tuple(w.worker_id for w in snapshot.workers)
        if ids != self._ring_ids:
            self._ring_ids = ids
            if frozenset(ids) != self._ring.worker_ids:
                self._ring = HashRing(ids, self.config.num_virtual_nodes)
                logger.debug("hash ring rebuilt: %d workers, %d points", len(set(ids)), len(self._ring.points))
        return self._ring

    def select(self, view: RequestView, snapshot: Snapshot) -> Decision:
        """Choose the key's owner on the ring; ranking as in the module docstring."""
        candidates = eligible_workers(snapshot)
        if not candidates:
            return no_worker_decision(snapshot)
        if view.session_key is None:
            return least_loaded_decision(candidates, "no_session_key")
        by_id: dict[str, WorkerState] = {w.worker_id: w for w in candidates}
        ranking = self.ring_for(snapshot).walk(key_hash(view.session_key), set(by_id), NUM_RING_FALLBACKS)
        if len(ranking) < len(by_id):
            on_ring = set(ranking)
            ranking.extend(w for w in by_id if w not in on_ring)
        chosen = by_id[ranking[0]]
        return Decision(
            worker_id=chosen.worker_id,
            reason=self.name,
            scores={worker_id: float(i) for i, worker_id in enumerate(ranking)},
            predicted_cached_tokens=chosen.num_cached_tokens,
            ranking=tuple(ranking),
        )
