"""The GPU block pool: fixed blocks, reference counts, a free queue in eviction order, and the prefix index.

Data structures (after vLLM ``block_pool.py`` / ``FreeKVCacheBlockQueue``, written anew)::

    blocks      [num_blocks] KVCacheBlock(block_id, ref_cnt, meta)
    free_queue  block ids with ref_cnt == 0, least recently used first:
                    front (evicted next) ... back (freed last)
                initially 0, 1, ..., num_blocks - 1
    cached      block_hash -> block_id of every block registered in the prefix index (in use or free)

Invariants:
  * ``ref_cnt == 0``  <=>  the block is in ``free_queue``.
  * a block is in ``cached`` iff its ``meta`` is set; at most one block per hash.
  * Allocation pops from the front. Popping a cached block evicts it: its hash leaves ``cached`` and a
    ``BlockRemoved`` event is emitted.
  * ``touch`` (a prefix hit) takes a free cached block out of the queue and raises its ``ref_cnt``.
  * A request frees its blocks tail first, so within one request the last block is evicted first.

Events follow vLLM: one ``BlockStored`` per run of newly cached blocks (parent = the block before the run),
one ``BlockRemoved`` per evicted block, ``AllBlocksCleared`` on reset.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import msgspec

from events.types import BlockRemoved, BlockStored, EngineBlockHash, KVEvent, Medium
from workers.errors import KVCacheError
from workers.kv.hashing import BlockHash, to_engine_hash

logger = logging.getLogger(__name__)


class BlockMeta(msgspec.Struct, frozen=True, gc=False):
    """What a cached block holds, kept for events and snapshots.

    Attributes:
        block_hash: the block's hash.
        parent_block_hash: the previous block's hash, ``None`` for block 0 of a chain.
        token_ids: the block's ``block_size`` tokens.
        depth: block index in its chain (0 for the first block).
        lora_name: namespace: LoRA adapter, or ``None``.
        cache_salt: namespace: cache salt, or ``None``.
    """

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    depth: int
    lora_name: str | None = None
    cache_salt: str | None = None
    engine_hash: int | None = None
    """``to_engine_hash(block_hash)``, computed once by the creator (``None``: computed on use)."""


def engine_hash_of(meta: BlockMeta) -> EngineBlockHash:
    """The block's u64 wire hash (``meta.engine_hash`` when set)."""
    return to_engine_hash(meta.block_hash) if meta.engine_hash is None else EngineBlockHash(meta.engine_hash)


def engine_hashes_of(metas: Sequence[BlockMeta]) -> tuple[EngineBlockHash, ...]:
    """``engine_hash_of`` of each of ``metas``, in order (one attribute read per block when all are set)."""
    hashes = tuple([m.engine_hash for m in metas])
    if None in hashes:
        return tuple(map(engine_hash_of, metas))
    return cast("tuple[EngineBlockHash, ...]", hashes)


_engine_hash = engine_hash_of


def stored_events(metas: Sequence[BlockMeta], block_size: int, medium: Medium) -> list[BlockStored]:
    """``BlockStored`` events for ``metas``, one per run of chained blocks (each block's parent is the previous
    block of the run).

    Args:
        metas: blocks in prefix order.
        block_size: tokens per block.
        medium: tier they were stored on.

    Returns:
        Events in order; ``extra_keys`` carries ``(cache_salt,)`` for a block 0 with a salt, as vLLM does.
    """
    events: list[BlockStored] = []
    run: list[BlockMeta] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        extra: tuple[object, ...] | None = None
        if any(m.cache_salt and m.depth == 0 for m in run):
            extra = tuple((m.cache_salt,) if m.cache_salt and m.depth == 0 else None for m in run)
        events.append(
            BlockStored(
                block_hashes=tuple(_engine_hash(m) for m in run),
                parent_block_hash=None if first.parent_block_hash is None else to_engine_hash(first.parent_block_hash),
                token_ids=tuple(itertools.chain.from_iterable(m.token_ids for m in run)),
                block_size=block_size,
                medium=medium,
                lora_name=first.lora_name,
                extra_keys=extra,
            )
        )
        run.clear()

    for m in metas:
        if run and (m.parent_block_hash != run[-1].block_hash or m.lora_name != run[-1].lora_name):
            flush()
        run.append(m)
    flush()
    return events


def emit_tier_stored(
    emit: Callable[[KVEvent], None],
    metas: Sequence[BlockMeta],
    engine_hashes: tuple[EngineBlockHash, ...],
    block_size: int,
    medium: Medium,
    is_on_gpu: bool,
) -> None:
    """Announce a completed store on a lower tier.

    Args:
        emit: called with each KV event.
        metas: the stored blocks in prefix order.
        engine_hashes: their wire hashes, same order.
        block_size: tokens per block.
        medium: the tier they were stored on.
        is_on_gpu: all of them are in the GPU prefix index, so one bare ``BlockStored`` (no parent, no tokens)
            suffices; otherwise full events from ``stored_events``.
    """
    if is_on_gpu:
        emit(
            BlockStored(
                block_hashes=engine_hashes,
                parent_block_hash=None,
                token_ids=(),
                block_size=block_size,
                medium=medium,
            )
        )
    else:
        for ev in stored_events(metas, block_size, medium):
            emit(ev)


def chain_order(metas: Iterable[BlockMeta]) -> list[BlockMeta]:
    """``metas`` in depth-first prefix order: every block after its parent (when present), and a child right
    after its parent where possible so ``stored_events`` groups chains into few events. Deterministic: roots and
    siblings in order of depth, then hash.
    """
    by_hash = {m.block_hash: m for m in metas}
    children: dict[BlockHash, list[BlockMeta]] = {}
    roots: list[BlockMeta] = []
    for m in by_hash.values():
        if m.parent_block_hash is not None and m.parent_block_hash in by_hash:
            children.setdefault(m.parent_block_hash, []).append(m)
        else:
            roots.append(m)
    out: list[BlockMeta] = []
    stack = sorted(roots, key=lambda m: (m.depth, m.block_hash), reverse=True)
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(sorted(children.get(m.block_hash, ()), key=lambda c: c.block_hash, reverse=True))
    return out


class KVCacheBlock:
    """One GPU block.

    Attributes:
        block_id: index in the pool, ``0 .. num_blocks - 1``.
        ref_cnt: number of requests using the block.
        meta: set while the block is registered in the prefix index.
    """

    __slots__ = ("block_id", "ref_cnt", "meta")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.meta: BlockMeta | None = None


class BlockPool:
    """GPU blocks with ref counts, the LRU free queue and the prefix index (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[KVEvent], None]) -> None:
        """Build a pool with every block free.

        Args:
            num_blocks: blocks in the pool (> 0).
            block_size: tokens per block (> 0).
            emit: called with each KV event, in order.

        Raises:
            ValueError: a non-positive size.
        """
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix index."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (``ref_cnt > 0``), 0..1."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block id holding ``block_hash``, or ``None``."""
        return self._cached.get(block_hash)

    def holds_all(self, block_hashes: Iterable[BlockHash]) -> bool:
        """Whether every one of ``block_hashes`` is registered in the prefix index."""
        return all(map(self._cached.__contains__, block_hashes))

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are currently in the free queue (a touch would take them out)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (a prefix hit); free ones leave the free queue."""
        for b in block_ids:
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self._free_queue[b]
            blk.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the front of the free queue, evicting cached ones.

        Returns:
            Block ids, each with ``ref_cnt == 1``.

        Raises:
            KVCacheError: fewer free blocks than asked (callers check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free_queue):
            raise KVCacheError(f"asked for {num_blocks} blocks, {len(self._free_queue)} free")
        out: list[int] = []
        for _ in range(num_blocks):
            b, _unused = self._free_queue.popitem(last=False)
            blk = self.blocks[b]
            if blk.meta is not None:
                del self._cached[blk.meta.block_hash]
                self._emit(BlockRemoved(block_hashes=(_engine_hash(blk.meta),), medium=Medium.GPU))
                blk.meta = None
                self.num_evicted_blocks += 1
            blk.ref_cnt = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching 0 join the back of the queue.

        Raises:
            KVCacheError: a block that was not in use.
        """
        for b in block_ids:
            blk = self.blocks[b]
            if blk.ref_cnt <= 0:
                raise KVCacheError(f"block {b} freed with ref_cnt {blk.ref_cnt}")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free_queue[b] = None

    def cache_blocks(self, block_ids: Sequence[int], metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """Register computed blocks in the prefix index and emit ``BlockStored`` (GPU) for the new ones.

        A block whose hash is already cached in another block stays unregistered (a duplicate), as does a block
        already registered.

        Args:
            block_ids: blocks holding ``metas``' content, same length, in prefix order.
            metas: what each block holds.

        Returns:
            The metas newly registered.
        """
        new: list[BlockMeta] = []
        for b, meta in zip(block_ids, metas, strict=True):
            blk = self.blocks[b]
            if blk.meta is not None or meta.block_hash in self._cached:
                continue
            blk.meta = meta
            self._cached[meta.block_hash] = b
            new.append(meta)
        for ev in stored_events(new, self.block_size, Medium.GPU):
            self._emit(ev)
        return new

    def reset(self) -> bool:
        """Drop every cached hash (``reset_prefix_cache``); only when no block is in use. Emits nothing (the
        manager emits one ``AllBlocksCleared`` for all tiers).

        Returns:
            False (and changes nothing) while any block has ``ref_cnt > 0``.
        """
        if len(self._free_queue) != self.num_blocks:
            return False
        for b in self._cached.values():
            self.blocks[b].meta = None
        self._cached.clear()
        return True

    def cached_metas(self) -> list[BlockMeta]:
        """Every cached block's meta, parents before children (snapshot order, see ``chain_order``)."""
        return chain_order([m for b in self._cached.values() if (m := self.blocks[b].meta) is not None])

    def get_all_free_block_ids(self) -> list[int]:
        """Test-only: the free queue, front (evicted next) first."""
        return list(self._free_queue)
