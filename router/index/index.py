"""The prefix index: which worker holds which prefix, on which tier.

``block_hash`` is our own chained hash (``router.block_hash``), so a hash identifies a whole prefix and the
"radix tree" needs no per-node child tables for lookups: one dict maps a block hash to a dense id, and a prompt's
positions are probed as ``lane[id_of.get(h, 0)]`` in one holder-mask list per (cache group, medium). One entry
per block regardless of how many workers hold it; a holding is one bit. Modules, one concept each::

    state.py   IndexState   the tables (layout, invariants, gap accounting) and holding / entry primitives
    ingest.py  IngestMixin  BlockStored / BlockRemoved / AllBlocksCleared / Resync, parking of orphans
    upkeep.py  UpkeepMixin  clearing workers and tiers, the block cap (LRU), approximate mode (TTL)
    query.py   QueryMixin   match (jump search on the GPU lane), stats, dumps
    match.py                pure depth computations (walk, jump search, hybrid hit rules)

Measured by ``python -m benchmarks.index`` (1 M blocks, 64 workers, 1.9 M (block, worker) holdings; figures
and method in that module's docstring): 143 bytes per (block, worker) holding (tracemalloc), no Python object
per block (per-id lists and arrays; children lists only at branching blocks).
"""

from __future__ import annotations

from router.index.ingest import IngestMixin
from router.index.query import QueryMixin
from router.index.state import COUNTER_NAMES, GPU0, OWN_LOWER_MEDIA, POOL_MEDIA

__all__ = ["COUNTER_NAMES", "GPU0", "OWN_LOWER_MEDIA", "POOL_MEDIA", "PrefixIndex"]


class PrefixIndex(IngestMixin, QueryMixin):
    """Per-block holders across workers and tiers, fed by normalized KV events; see ``router.index.state``.

    Not thread-safe: the gateway calls it from one event loop (event sinks and the request path alike).
    Every method runs in time proportional to its input (a batch, a prompt, one worker's blocks), except
    pruning, which is amortized over the stores that triggered it.

    Args:
        config: sizes, caps and TTLs.
        pool_members: pool medium -> ids of the workers attached to that pool.
        groups: cache group index -> spec, for hybrid models, on top of ``config.groups`` (group 0 is full
            attention unless given). Events of a group declared neither here nor there are refused.

    Raises:
        IndexConfigError: a non-pool medium in ``pool_members``.
    """
