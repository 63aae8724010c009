"""A restore's read from the shared pool: one ``batch_get_into`` per batch of objects (up to ``max_read_bytes``)
into a registered host buffer, then every restored block's chunk checked (``workers.kv.pool_chunk``): the blocks a
batch restores lie in consecutive slots of the buffer (objects in chain order, back to back), so they are checked
as one run (``ChunkLayout.check_run``: the chunks rebuilt in a scratch buffer and compared in one ``memcmp``).

Objects are read whole (Mooncake moves whole objects): a span of which the restore needs some members is read
entirely and only those members are checked and used (``workers.kv.pool_tier``, Restores).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from itertools import accumulate, chain

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
    scratch: HostBuffer,
    metas: Sequence[BlockMeta],
    batches: Sequence[tuple[list[PoolObject], int]],
    check_padding: bool,
    payloads: Sequence[bytes] | None = None,
) -> ReadResult:
    """Read the objects of ``batches`` (``plan_batches``: chain order, consecutive positions, each object holding
    some of ``metas``, which are consecutive chain positions), one ``get_into`` per batch into ``buffer`` (the
    largest batch's chunks × ``chunk_bytes`` at least), and check each block of ``metas`` in its object: the
    object's size (its members × ``chunk_bytes``), then the member's chunk (``ChunkLayout.check_run`` over the
    batch's blocks of ``metas``, which lie in consecutive slots of ``buffer``: manifest, hash, digests, tokens,
    padding with ``check_padding``; ``scratch`` holds as many chunks as ``buffer``; ``payloads``: the blocks'
    tokens packed, one per meta, or ``None``). Stops at the first object missing or with other bytes.

    Raises:
        RuntimeError: ``objects`` do not hold ``metas`` in order (a plan from another chain).
    """
    t0 = time.perf_counter()
    step = layout.chunk_bytes
    d0 = metas[0].depth if metas else 0
    d_end = d0 + len(metas)
    hashes = [m.block_hash for m in metas]
    n = 0
    for batch, _ in batches:
        sizes = [len(o.member_hashes) * step for o in batch]
        offsets = list(accumulate(sizes, initial=0))
        got = store.get_into([o.key for o in batch], buffer, offsets[:-1], sizes)
        num_ok = len(batch)
        if got != sizes:  # the first object missing or of another size
            num_ok = next(i for i, (a, b) in enumerate(zip(got, sizes, strict=True)) if a != b)
        if num_ok:
            first = batch[0].first_depth
            if first > d0 + n:
                raise RuntimeError(f"pool object {batch[0].key} starts after block {n} of the restore")
            last = batch[num_ok - 1]
            stop = min(last.first_depth + len(last.member_hashes), d_end)  # exclusive chain position
            lo = d0 + n - first  # the batch's slot of the restore's next block
            planned = list(chain.from_iterable(o.member_hashes for o in batch[:num_ok]))
            run_hashes = hashes[n : stop - d0]
            if planned[lo : stop - first] != run_hashes:
                raise RuntimeError(f"pool objects {batch[0].key} .. {last.key} do not hold blocks {n} .. "
                                   f"{stop - d0 - 1} of the restore")  # fmt: skip
            if payloads is None:
                num_intact = layout.check_run(buffer.data, lo * step, scratch, run_hashes,
                                              [m.token_ids for m in metas[n : stop - d0]], check_padding)  # fmt: skip
            else:  # the tokens packed already: no token list to build
                num_intact = layout.check_run(buffer.data, lo * step, scratch, run_hashes, (), check_padding,
                                              payloads[n : stop - d0])  # fmt: skip
            if num_intact < len(run_hashes):
                slot = lo + num_intact
                k = next(i for i, end in enumerate(offsets[1:]) if end > slot * step)
                return ReadResult(n + num_intact, time.perf_counter() - t0, bad=batch[k], bad_num_read=got[k])
            n = stop - d0
        if num_ok < len(batch):
            obj, num_read = batch[num_ok], got[num_ok]
            if num_read < 0:
                lost = obj if num_read == OBJECT_NOT_FOUND else None
                return ReadResult(n, time.perf_counter() - t0, lost=lost)
            return ReadResult(n, time.perf_counter() - t0, bad=obj, bad_num_read=num_read)
    return ReadResult(n, time.perf_counter() - t0)
