"""The KV cache as KV events: what the worker's snapshot endpoint (``GET /kv/snapshot``) serves, so that a cold
gateway index reproduces every tier's state (``KVCacheManager.snapshot_events``)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from events.types import AllBlocksCleared, BlockStored, EngineBlockHash, KVEvent, Medium, SpecKind
from workers.kv.block_pool import BlockMeta, BlockPool, chain_order, engine_hash_of, stored_events
from workers.kv.cpu_tier import CpuTier
from workers.kv.hybrid import HybridGroups
from workers.kv.pool_tier import PoolTier


def snapshot_events(
    gpu: BlockPool, cpu: CpuTier | None, pool: PoolTier | None, groups: HybridGroups, block_size: int
) -> list[KVEvent]:
    """The current cache as KV events, in an order an empty gateway index resolves::

        AllBlocksCleared
        BlockStored GPU   runs of the GPU prefix index, parents before children, with tokens
        BlockStored CPU   one token-less event: engine hashes of the CPU blocks also on GPU (resolved through
                          the GPU stores above), least recently used first, as live store events are
        BlockStored CPU   runs of the CPU-only blocks (evicted from GPU), parents before children, with parent
                          and tokens from the blocks' metas, so they resolve without a GPU store
        BlockStored MOONCAKE  the same two shapes for the shared pool's blocks this worker stored or read
                          (``PoolTier.snapshot_metas``); a CPU run whose parent is only in the pool is parked
                          by the gateway until the pool run that maps its parent

    Applying them to an empty index reproduces every tier's state. A CPU-only run whose parent is on no tier
    stays unresolved (parked by the gateway), as no lookup of the worker can reach it either.
    """
    events: list[KVEvent] = [AllBlocksCleared()]
    events.extend(stored_events(gpu.cached_metas(), block_size, Medium.GPU))
    if cpu is not None and cpu.num_stored_blocks:
        events.extend(tier_snapshot(gpu, cpu.stored_metas(), Medium.CPU, block_size))
    if pool is not None:
        events.extend(tier_snapshot(gpu, pool.snapshot_metas(), Medium.MOONCAKE, block_size))
    if groups.is_hybrid:
        for i, event in enumerate(events):
            if isinstance(event, BlockStored) and event.medium is Medium.GPU:
                events[i] = msgspec.structs.replace(event, kv_cache_spec_kind=SpecKind.FULL_ATTENTION)
        events.extend(groups.snapshot_events())
    return events


def tier_snapshot(gpu: BlockPool, metas: Sequence[BlockMeta], medium: Medium, block_size: int) -> list[KVEvent]:
    """A lower tier's blocks as stores: one token-less event for those also on GPU (in ``metas``' order), then runs
    of the others with parent and tokens, parents first (``snapshot_events``)."""
    on_gpu = gpu.get_cached_block
    resident: list[EngineBlockHash] = []
    lower_only: list[BlockMeta] = []
    for meta in metas:
        if on_gpu(meta.block_hash) is None:
            lower_only.append(meta)
        else:
            resident.append(engine_hash_of(meta))
    events: list[KVEvent] = []
    if resident:
        events.append(
            BlockStored(
                block_hashes=tuple(resident), parent_block_hash=None, token_ids=(), block_size=block_size,
                medium=medium,
            )
        )  # fmt: skip
    events.extend(stored_events(chain_order(lower_only), block_size, medium))
    return events
