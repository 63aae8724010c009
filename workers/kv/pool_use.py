"""The pool's use order: which existence checks tell a Mooncake master that objects were used.

A ``mooncake_master`` past its high watermark evicts the objects whose ``lease_timeout`` is earliest, among those
whose lease ran out (``BatchEvict``, ``mooncake-store/src/master_service.cpp``); ``ExistKey`` / ``GetReplicaList``
grant a lease (``lease_timeout`` = now + the lease TTL) and a put's ``PutEnd`` sets it to the put's own time
(``GrantLease(0, ...)``: "no lease at beginning"). So a block just put already ranks after every object whose
last use ended before the put (measured on a real master: ``tests/workers/test_pool_refresh.py``), and a check
after a put would only pin it for a whole TTL: a fleet writing more than the pool holds within one TTL then
leaves nothing evictable, and the master refuses puts for space. Puts are not checked.

One use never reaches the master, though: a block served from GPU or CPU. The worker reads nothing from the pool,
so a session that keeps hitting on one worker's GPU leaves its pool copy the oldest in the pool, evicted while the
session is live (LMCache's vLLM connector has the use reach the pool anyway: its ``get_num_new_matched_tokens``
looks up the whole prompt, from its first token, whatever vLLM's own prefix cache holds,
``lmcache/integration/vllm/vllm_v1_adapter.py``). So an admission's GPU and CPU hit is followed by one batched
existence check whose answer is not needed (``PoolTier.refresh``), except for a while after the pool refused a
put of this worker (``UseOrder``): then a lease costs the pool room for new blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from workers.config import MOONCAKE_DEFAULT_LEASE_TTL_S
from workers.kv.hashing import BlockHash
from workers.kv.pool_spans import lookup_objects


def used_keys(hashes: Sequence[BlockHash], end: int, span_len: int) -> list[str]:
    """The keys of the objects holding the chain's first ``end`` blocks (spans, then the tail's singles)."""
    if end <= 0:
        return []
    spans, singles = lookup_objects(hashes, 0, min(end, len(hashes)), span_len)
    return [o.key for o in spans] + [o.key for o in singles]


class UseOrder:
    """One worker's use marks (module docstring): the objects of a GPU and CPU hit to check, none for
    ``pause_s`` after the pool refused a put of this worker: the master's lease (``PoolConfig.lease_ttl_s``, its
    ``--default_kv_lease_ttl``; by default Mooncake's default, ``MOONCAKE_DEFAULT_LEASE_TTL_S``), so the pins
    granted before the refusal have run out when refreshes resume. A check leases what it finds for a whole TTL
    and the master never evicts a leased object: a live working set larger than the pool, refreshed within one
    TTL, leaves nothing to evict and every put is refused (the churn test's rounds, ``benchmarks.pool_churn``, on a
    2-core host: 34-169 keys evicted a round with every hit refreshed, 39-619 with refreshes paused only until a
    put landed whole, 440-1788 with this pause, 5 runs each)."""

    def __init__(self, span_len: int, pause_s: float = MOONCAKE_DEFAULT_LEASE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """Raises:
            ValueError: ``pause_s`` not a positive finite number of seconds.
        """
        if not 0 < pause_s < math.inf:
            raise ValueError(f"the refresh pause (the master's lease) must be positive seconds, not {pause_s!r}")
        self.span_len = span_len
        self.pause_s = pause_s
        self.clock = clock
        """The time source, seconds (``time.monotonic``)."""
        self.refused_at: float | None = None
        """When a put of this worker was last refused (``put_landed``), ``clock`` seconds; ``None``: never."""
        self.num_skipped = 0
        """Refreshes skipped in a pause."""

    def put_landed(self, ok: Sequence[bool]) -> None:
        """A put batch finished with ``ok`` per object (``False``: refused, for space or an outage)."""
        if not all(ok):
            self.refused_at = self.clock()

    def paused(self) -> bool:
        """Whether refreshes are paused now (a put of this worker was refused less than ``pause_s`` ago)."""
        return self.refused_at is not None and self.clock() - self.refused_at < self.pause_s

    def refresh_keys(self, hashes: Sequence[BlockHash], end: int) -> list[str]:
        """The keys to check for the chain's first ``end`` blocks, used from GPU or CPU (``used_keys``); none in a
        pause."""
        if end <= 0:
            return []
        if self.paused():
            self.num_skipped += 1
            return []
        return used_keys(hashes, end, self.span_len)
