"""Hit-ratio bounds of a trace slice: the infinite-cache ceiling and a finite LRU cache.

The ceiling follows the traces README's method ("maximum achievable prefix reuse"): requests in arrival order,
a trie of every earlier request's ids; a request reuses ``k`` leading blocks where ``k`` is its longest prefix
that is a path in the trie; reused tokens are ``min(k * block_size, num_prompt_tokens)`` (a fully matched
request, partial last block included, reuses its whole prompt); the ratio is the sum of reused tokens over the
sum of prompt tokens. Output tokens never enter the cache (the traces carry no ids for them). Because the ids
are chained, "a path in the trie" equals "every one of the first ``k`` ids was seen before", which is what the
code checks. Ids are keyed by namespace.

A run's ceiling (``served_ceiling``) is the same walk over the requests that succeeded, in trace order: a request
that failed (a worker refused it) or was never sent neither reads the cache nor fills it, and its prompt tokens
are not counted. That is the population of the run's measured hit ratio (``loadgen.report``), so a failure can
never lift ``hit ratio ÷ ceiling`` above 1.

The LRU variant runs the same walk against one cache of bounded capacity that evicts the least recently used
block (a hit or an insert refreshes a block). It tells whether a fleet's total capacity could reach the ceiling
if placement were perfect, which the demo uses to size its workers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from loadgen.client import RequestRecord
from loadgen.traces import TraceRequest


class CacheBound(msgspec.Struct, frozen=True):
    """Hit ratio of a trace slice under one cache model.

    Attributes:
        hit_ratio: reused prompt tokens / prompt tokens, 0..1.
        num_reused_tokens: prompt tokens served from the cache.
        num_prompt_tokens: all prompt tokens of the slice.
        num_distinct_blocks: distinct (namespace, id) blocks in the slice.
        num_blocks: sum over requests of their number of blocks.
    """

    hit_ratio: float
    num_reused_tokens: int
    num_prompt_tokens: int
    num_distinct_blocks: int
    num_blocks: int


def _reused_tokens(r: TraceRequest, k: int) -> int:
    return min(k * r.block_size, r.num_prompt_tokens)


def ceiling(requests: Sequence[TraceRequest]) -> CacheBound:
    """The infinite-cache ceiling of the slice (module docstring)."""
    seen: set[tuple[str, int]] = set()
    reused = 0
    total = 0
    num_blocks = 0
    for r in requests:
        k = 0
        while k < len(r.hash_ids) and (r.namespace, r.hash_ids[k]) in seen:
            k += 1
        reused += _reused_tokens(r, k)
        total += r.num_prompt_tokens
        num_blocks += len(r.hash_ids)
        seen.update((r.namespace, h) for h in r.hash_ids)
    return CacheBound(
        hit_ratio=reused / total if total else 0.0,
        num_reused_tokens=reused,
        num_prompt_tokens=total,
        num_distinct_blocks=len(seen),
        num_blocks=num_blocks,
    )


def served_ceiling(requests: Sequence[TraceRequest], records: Iterable[RequestRecord]) -> CacheBound:
    """The infinite-cache ceiling of the requests a run served (module docstring).

    Args:
        requests: the replayed slice in trace order (``RequestRecord.index`` points into it).
        records: the run's records; only successful ones count (failed requests and those never sent have no
            successful record).

    Raises:
        IndexError: a record whose index is outside ``requests``.
    """
    served = sorted({r.index for r in records if r.is_ok})
    return ceiling([requests[i] for i in served])


def lru_bound(requests: Sequence[TraceRequest], capacity_blocks: int) -> CacheBound:
    """Hit ratio of one LRU cache holding at most ``capacity_blocks`` trace blocks.

    Args:
        requests: the slice in arrival order.
        capacity_blocks: capacity in trace blocks (``block_size`` tokens each).

    Raises:
        ValueError: a negative capacity.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    cache: OrderedDict[tuple[str, int], None] = OrderedDict()
    distinct: set[tuple[str, int]] = set()
    reused = 0
    total = 0
    num_blocks = 0
    for r in requests:
        keys = [(r.namespace, h) for h in r.hash_ids]
        k = 0
        while k < len(keys) and keys[k] in cache:
            k += 1
        reused += _reused_tokens(r, k)
        total += r.num_prompt_tokens
        num_blocks += len(keys)
        distinct.update(keys)
        if capacity_blocks == 0:
            continue
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return CacheBound(
        hit_ratio=reused / total if total else 0.0,
        num_reused_tokens=reused,
        num_prompt_tokens=total,
        num_distinct_blocks=len(distinct),
        num_blocks=num_blocks,
    )
