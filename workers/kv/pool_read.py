"""A restore's read from the shared pool: one ``batch_get_into`` per batch of objects (up to ``max_read_bytes``)
into a registered host buffer, then every restored block's chunk checked (``workers.kv.pool_chunk``): the blocks a
batch restores lie in consecutive slots of the buffer (objects in chain order, back to back), so they are checked
as one run (``ChunkLayout.check_run``: each manifest and payload compared with the one expected, the padding with
zeros: one read of every byte).

Objects are read whole (Mooncake moves whole objects): a span of which the restore needs some members is read
entirely and only those members are checked and used (``workers.kv.pool_tier``, Restores).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from itertools import accumulate
from typing import Any, TypeVar

from common.pool_keys import PoolObject
from workers.kv.block_pool import BlockMeta
from workers.kv.pool_chunk import ChunkLayout, HostBuffer
from workers.kv.pool_store import OBJECT_NOT_FOUND, PoolStore

T = TypeVar("T")

__all__ = ["PoolFetch", "ReadResult", "batch_chunks", "capacity_chunks", "done_future", "plan_batches", "plan_read",
           "read_objects", "submit_started"]  # fmt: skip


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


READ_AHEAD_MIN_BATCH_BYTES = 8 << 20
"""A restore of at least twice this many bytes is read in batches of at least this size, each read while the one
before is checked (``read_objects``'s ``read_ahead``); a smaller one in as few batches as ``max_read_bytes``
allows (one, mostly: Mooncake's cost per call dominates small reads)."""
READ_AHEAD_STAGES = 8
"""Batches a read-ahead restore is cut into at most (below ``max_read_bytes`` each): the check of the last batch
is the only one not hidden behind a read, about ``1 / READ_AHEAD_STAGES`` of the restore's checking."""


def submit_started(executor: Executor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """Submit ``fn(*args)`` to ``executor`` and return once its thread has started on it: the caller's next work
    (a run's checks, a chunk build) holds the GIL in stretches, and a thread still waiting for the GIL would make
    its call (a store call that releases it) up to a switch interval (5 ms) late."""
    started = threading.Event()

    def run() -> T:
        started.set()
        return fn(*args)

    future = executor.submit(run)
    started.wait()
    return future


def batch_chunks(total: int, chunk_bytes: int, max_chunks: int, read_ahead: bool) -> int:
    """Chunks per batch for ``plan_batches`` of a restore reading ``total`` chunks: ``max_chunks``
    (``max_read_bytes`` of them), or with ``read_ahead`` and at least ``2 × READ_AHEAD_MIN_BATCH_BYTES`` to read,
    about ``1 / READ_AHEAD_STAGES`` of the restore but at least ``READ_AHEAD_MIN_BATCH_BYTES``."""
    if not read_ahead or total * chunk_bytes < 2 * READ_AHEAD_MIN_BATCH_BYTES:
        return max_chunks
    least = -(-READ_AHEAD_MIN_BATCH_BYTES // chunk_bytes)
    return max(1, min(max_chunks, max(least, -(-total // READ_AHEAD_STAGES))))


def capacity_chunks(num_chunks: int) -> int:
    """Chunks a new buffer holds: the next power of two, at least 8 (so buffers are reused across job sizes)."""
    return max(8, 1 << (num_chunks - 1).bit_length())


def plan_read(
    objects: Sequence[PoolObject], chunk_bytes: int, max_chunks: int, read_ahead: bool
) -> tuple[list[tuple[list[PoolObject], int]], int]:
    """A restore's batches (``plan_batches`` of ``batch_chunks``) and the bytes its buffer holds for them: the
    largest batch (rounded up by ``capacity_chunks``, at most ``max_chunks``), twice that where ``read_objects``
    reads ahead (``read_ahead`` and two batches or more). A restore that fits one batch (most) is that batch,
    not cut by a loop over its objects."""
    total = sum(len(o.member_hashes) for o in objects)
    per_read = batch_chunks(total, chunk_bytes, max_chunks, read_ahead)
    batches = plan_batches(objects, per_read) if total > per_read else [(list(objects), total)] if objects else []
    most = max((n for _, n in batches), default=1)
    num_halves = 2 if read_ahead and len(batches) > 1 else 1
    return batches, num_halves * max(most, min(capacity_chunks(most), per_read)) * chunk_bytes


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


def _holds(objects: Sequence[PoolObject], first: int, hashes: Sequence[bytes], start: int, stop: int, d0: int) -> bool:
    """Whether ``objects`` lie back to back from chain position ``first`` and hold the restore's blocks ``start ..
    stop - 1`` (``hashes[d - d0]`` at position ``d``) in order. One compare per object, its last member needed
    with the restore's block there: a block hash is a chain hash (``workers.kv.hashing``), equal only where the
    chain before it is, so the members before it are the restore's too (a member list that is no chain would
    still fail the chunks' checks, each manifest's hash against the restore's). Per object, not per block: in a
    restore of 558 cold blocks the list of every member and its compare cost 20-30 us."""
    at = first
    for obj in objects:
        if obj.first_depth != at:
            return False
        at += len(obj.member_hashes)
        d = min(at, stop) - 1  # the object's last member the restore needs
        if d >= start and obj.member_hashes[d - obj.first_depth] != hashes[d - d0]:
            return False
    return at >= stop


def read_objects(
    store: PoolStore,
    layout: ChunkLayout,
    buffer: HostBuffer,
    metas: Sequence[BlockMeta],
    batches: Sequence[tuple[list[PoolObject], int]],
    check_padding: bool,
    payloads: Sequence[bytes] | None = None,
    read_ahead: Executor | None = None,
) -> ReadResult:
    """Read the objects of ``batches`` (``plan_batches``: chain order, consecutive positions, each object holding
    some of ``metas``, which are consecutive chain positions), one ``get_into`` per batch into ``buffer``, and
    check each block of ``metas`` in its object: the object's size (its members × ``chunk_bytes``), then the
    member's chunk (``ChunkLayout.check_run`` over the batch's blocks of ``metas``, which lie in consecutive slots
    of ``buffer``: manifest, hash, digests, tokens, padding with ``check_padding``; ``payloads``: the blocks'
    tokens packed, one per meta, or ``None``). Stops at the first object missing or with other bytes.

    ``read_ahead`` (an executor; used when there are two batches or more): batch ``k + 1`` is read on it into the
    other half of ``buffer`` while batch ``k`` is checked here (the client releases the GIL; ``submit_started``), so
    the checks but the last batch's overlap the reads; ``buffer`` then holds twice the largest batch. A read
    ahead of a batch that turns out not to be needed is waited for before this returns (``buffer`` is the
    caller's again then). Without it, ``buffer`` holds the largest batch.

    Raises:
        RuntimeError: ``objects`` do not hold ``metas`` in order (a plan from another chain).
    """
    t0 = time.perf_counter()
    step = layout.chunk_bytes
    d0 = metas[0].depth if metas else 0
    d_end = d0 + len(metas)
    hashes = [m.block_hash for m in metas]
    ahead = read_ahead if read_ahead is not None and len(batches) > 1 else None
    half = buffer.num_bytes // 2 if ahead is not None else 0

    plans: list[tuple[list[int], list[int]]] = []
    """Each batch's sizes and offsets in ``buffer`` (its half with a read ahead; offsets end with its end)."""
    for k, (batch, _) in enumerate(batches):
        sizes = [len(o.member_hashes) * step for o in batch]
        plans.append((sizes, list(accumulate(sizes, initial=half * (k % 2)))))

    def get(k: int) -> list[int]:
        sizes, offsets = plans[k]
        return store.get_into([o.key for o in batches[k][0]], buffer, offsets[:-1], sizes)

    pending: Future[list[int]] | None = None
    try:
        n = 0
        for k, (batch, _) in enumerate(batches):
            sizes, offsets = plans[k]
            got = get(k) if pending is None else pending.result()
            pending = submit_started(ahead, get, k + 1) if ahead is not None and k + 1 < len(batches) else None
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
                run_hashes = hashes[n : stop - d0]
                if not _holds(batch[:num_ok], first, hashes, d0 + n, stop, d0):
                    raise RuntimeError(f"pool objects {batch[0].key} .. {last.key} do not hold blocks {n} .. "
                                       f"{stop - d0 - 1} of the restore")  # fmt: skip
                at = offsets[0] + lo * step
                if payloads is None:
                    tokens = [m.token_ids for m in metas[n : stop - d0]]
                    num_intact = layout.check_run(buffer.data, at, run_hashes, tokens, check_padding)
                else:  # the tokens packed already: no token list to build
                    num_intact = layout.check_run(buffer.data, at, run_hashes, (), check_padding,
                                                  payloads[n : stop - d0])  # fmt: skip
                if num_intact < len(run_hashes):
                    end_at = at + (num_intact + 1) * step  # the end of the first bad chunk
                    j = next(i for i, end in enumerate(offsets[1:]) if end >= end_at)
                    return ReadResult(n + num_intact, time.perf_counter() - t0, bad=batch[j], bad_num_read=got[j])
                n = stop - d0
            if num_ok < len(batch):
                obj, num_read = batch[num_ok], got[num_ok]
                if num_read < 0:
                    lost = obj if num_read == OBJECT_NOT_FOUND else None
                    return ReadResult(n, time.perf_counter() - t0, lost=lost)
                return ReadResult(n, time.perf_counter() - t0, bad=obj, bad_num_read=num_read)
        return ReadResult(n, time.perf_counter() - t0)
    finally:
        if pending is not None:  # a batch read ahead and not needed: its bytes land before the buffer is reused
            wait([pending])
