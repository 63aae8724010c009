"""How ``kvgate demo`` sizes its fleet from the trace slice, shared by the policy runs, ``--pd`` and the
benchmarks that build the demo's fleet (``benchmarks.routing``).

The smallest single LRU cache reaching ``lru_target`` (0.97) of the slice's infinite-cache ceiling, in the
workers' blocks, times ``headroom`` (room for output tokens and running requests), split evenly over the workers
(at least two longest prompts each). Each worker then holds a fraction of the slice's distinct blocks (reported;
well under half with 4 workers), so where requests go decides the hit ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from loadgen.ceiling import CacheBound, ceiling, lru_bound
from loadgen.demo_config import DemoConfig
from loadgen.traces import TraceRequest


class FleetSizing(msgspec.Struct, frozen=True):
    """How the fleet was sized from the slice (all block counts in the workers' blocks unless named trace).

    Attributes:
        ceiling: the slice's infinite-cache bound.
        fleet_lru: one LRU cache with the fleet's total capacity, on the slice.
        num_lru_trace_blocks: smallest single-LRU capacity reaching the target, in trace blocks.
        num_gpu_blocks_per_worker: each worker's GPU blocks.
        num_distinct_blocks: the slice's distinct blocks, in worker blocks.
        worker_share_of_distinct: one worker's capacity ÷ the slice's distinct blocks.
    """

    ceiling: CacheBound
    fleet_lru: CacheBound
    num_lru_trace_blocks: int
    num_gpu_blocks_per_worker: int
    num_distinct_blocks: int
    worker_share_of_distinct: float


def size_fleet(requests: Sequence[TraceRequest], config: DemoConfig) -> FleetSizing:
    """Size the workers from the slice (module docstring)."""
    bound = ceiling(requests)
    target = config.lru_target * bound.hit_ratio
    lo, hi = 1, max(1, bound.num_distinct_blocks)
    while lo < hi:  # smallest capacity whose LRU hit ratio reaches the target (LRU is a stack algorithm)
        mid = (lo + hi) // 2
        if lru_bound(requests, mid).hit_ratio >= target:
            hi = mid
        else:
            lo = mid + 1
    trace_block_size = requests[0].block_size
    per_trace_block = math.ceil(trace_block_size / config.block_size)
    max_prompt_blocks = max(math.ceil(r.num_prompt_tokens / config.block_size) for r in requests)
    per_worker = math.ceil(lo * per_trace_block * config.headroom / config.num_workers)
    per_worker = max(per_worker, 2 * max_prompt_blocks)
    fleet_trace_blocks = per_worker * config.num_workers // per_trace_block
    distinct = bound.num_distinct_blocks * per_trace_block
    return FleetSizing(
        ceiling=bound,
        fleet_lru=lru_bound(requests, fleet_trace_blocks),
        num_lru_trace_blocks=lo,
        num_gpu_blocks_per_worker=per_worker,
        num_distinct_blocks=distinct,
        worker_share_of_distinct=per_worker / distinct if distinct else 0.0,
    )
