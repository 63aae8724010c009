"""A restore's read from the shared pool: one ``batch_get_into`` per batch of objects (up to ``max_read_bytes``)
into a registered host buffer, then every restored block's chunk checked in place (``workers.kv.pool_chunk``).

Objects are read whole (Mooncake moves whole objects): a span of which the restore needs some members is read
entirely and only those members are checked and used (``workers.kv.pool_tier``, Restores).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

from common.pool_keys import PoolObject
from workers.kv.block_pool import BlockMeta
from workers.kv.pool_chunk import ChunkLayout, HostBuffer
from workers.kv.pool_store import OBJECT_NOT_FOUND, PoolStore

__all__ = ["PoolFetch", "ReadResult", "done_future", "plan_batches", "read_objects"]


class ReadResult:
    """What one restore read found (computed on the read thread, applied by ``PoolTier.finish_fetch``)."""

    __slots__ = ("num_intact", "bad", "bad_num_read", "wall_s", "lost")

    def __init__(
        self,
        num_intact: int,
        wall_s: float,
        bad: PoolObject | None = None,
        bad_num_read: int = 0,
        lost: PoolObject | None = None,
    ) -> None:
        self.num_intact = num_intact
        """Blocks, from the first, read intact."""
        self.bad = bad
        """The object after the intact blocks that was read back with other bytes, or ``None``."""
        self.bad_num_read = bad_num_read
        self.lost = lost
        """The object after the intact blocks that was not found (the pool evicted it since the lookup)."""
        self.wall_s = wall_s


class PoolFetch:
    """A restore read submitted by ``PoolTier.start_fetch``: its blocks' metas, the objects read, the future."""

    __slots__ = ("metas", "objects", "future")

    def __init__(self, metas: Sequence[BlockMeta], objects: Sequence[PoolObject], future: Future[ReadResult]) -> None:
        self.metas = metas
        self.objects = objects
        self.future = future

    def done(self) -> bool:
        """Whether the read has finished (``PoolTier.finish_fetch`` then returns at once)."""
        return self.future.done()


def done_future(value: ReadResult) -> Future[ReadResult]:
    future: Future[ReadResult] = Future()
    future.set_result(value)
    return future


def plan_batches(objects: Sequence[PoolObject], per_read: int) -> list[tuple[list[PoolObject], int]]:
    """``objects`` in order, cut into batches of at most ``per_read`` chunks (an object is never cut: one larger
    than that is a batch of its own), each with its number of chunks."""
    batches: list[tuple[list[PoolObject], int]] = []
    batch: list[PoolObject] = []
    num_chunks = 0
    for obj in objects:
        n = len(obj.member_hashes)
        if batch and num_chunks + n > per_read:
            batches.append((batch, num_chunks))
            batch, num_chunks = [], 0
        batch.append(obj)
        num_chunks += n
    if batch:
        batches.append((batch, num_chunks))
    return batches


def read_objects(
    store: PoolStore,
    layout: ChunkLayout,
    buffer: HostBuffer,
    metas: Sequence[BlockMeta],
    batches: Sequence[tuple[list[PoolObject], int]],
    check_padding: bool,
) -> ReadResult:
    """Read the objects of ``batches`` (``plan_batches``: chain order, each object holding some of ``metas``,
    which are consecutive chain positions), one ``get_into`` per batch into ``buffer`` (the largest batch's chunks
    × ``chunk_bytes`` at least), and check each block of ``metas`` in its object: the object's size (its members
    × ``chunk_bytes``), then the member's chunk (``ChunkLayout.check``: manifest, hash, digests, tokens, padding
    with ``check_padding``). Stops at the first object missing or with other bytes.

    Raises:
        RuntimeError: ``objects`` do not hold ``metas`` in order (a plan from another chain).
    """
    t0 = time.perf_counter()
    step = layout.chunk_bytes
    check = layout.check
    d0 = metas[0].depth if metas else 0
    d_end = d0 + len(metas)
    n = 0
    for batch, _ in batches:
        offsets: list[int] = []
        sizes: list[int] = []
        at = 0
        for obj in batch:
            size = len(obj.member_hashes) * step
            offsets.append(at)
            sizes.append(size)
            at += size
        got = store.get_into([o.key for o in batch], buffer, offsets, sizes)
        data = buffer.data
        for obj, offset, size, num_read in zip(batch, offsets, sizes, got, strict=True):
            if num_read < 0:
                lost = obj if num_read == OBJECT_NOT_FOUND else None
                return ReadResult(n, time.perf_counter() - t0, lost=lost)
            if num_read != size:
                return ReadResult(n, time.perf_counter() - t0, bad=obj, bad_num_read=num_read)
            first, members = obj.first_depth, obj.member_hashes
            if first > d0 + n:
                raise RuntimeError(f"pool object {obj.key} starts after block {n} of the restore")
            at = offset - first * step  # chunk of chain position d: at + d * step
            for d in range(d0 + n, min(first + len(members), d_end)):
                meta = metas[d - d0]
                block_hash = meta.block_hash
                if members[d - first] != block_hash:
                    raise RuntimeError(f"pool object {obj.key} does not hold block {d - d0} of the restore")
                if not check(data, at + d * step, step, block_hash, meta.token_ids, check_padding):
                    return ReadResult(d - d0, time.perf_counter() - t0, bad=obj, bad_num_read=num_read)
            n = max(n, min(first + len(members), d_end) - d0)
    return ReadResult(n, time.perf_counter() - t0)
