"""The shared pool tier (``Medium.MOONCAKE``): below the CPU tier, shared by every worker attached to it.

Blocks are written through from the GPU (as the CPU tier, under ``pool-store-policy``) and restored into GPU
blocks reserved for them, keyed by the SHA-256 chain hash (``workers.kv.hashing``), so any worker attached to the
pool finds what another stored. The store (``workers.kv.pool_store``): an in-process ``SimPool`` or Mooncake.

Objects (``common.pool_keys`` gives the keys): one object per span of ``blocks_per_span`` (``L``) aligned blocks
of a chain, keyed by its last block's hash, and one per block of a chain's unfinished tail, so a 558-block
restore reads 35 spans and 14 singles instead of 558 objects (Mooncake's cost per object dominated the per-block
layout: 5 µs per object read, 10 µs per put, against 0.2 and 0.4 µs per block in one object). ``L = 1``: per block.

Values: one chunk per block (``workers.kv.pool_chunk``): a manifest header and every layer group's piece; a span's
value is its members' chunks back to back, written and evicted as one unit. A read accepts a block only when its
whole chunk checks out (else it and the rest are computed, ``num_fetch_mismatches``, the object removed).

Lookups (``lookup``): a block is in the pool iff its span object or its single object exists: one batched
existence check of the spans the chain covers and its tail's singles, then, when a span is missing, one more of
its singles; the hit's objects go with it to the read. A missing object this worker had stored or read was
evicted: its blocks are announced removed at once (``_lost``).

Store rules (as the CPU tier), per object: one whose store is in flight from this worker is skipped (rule 1); one
already in the pool, stored by any worker, is skipped (rule 2: one batched existence check per job); a store once
scheduled completes even if the GPU copy is evicted meanwhile: its chunks are built in a staging buffer when the
job is prepared (rule 3). A job covers the blocks a sequence just cached, widened back to the start of the span
they are in (``span_start``: the earlier members are written only inside a span, their singles were the previous
job's); spans it completes are written whole, the blocks after the last one as singles. A completed store puts the
job's objects in one batch straight from that buffer and emits one ``BlockStored`` (MOONCAKE) per job for the
blocks put that this worker had not announced yet, token-less when all of them are still in the GPU prefix index
(else with parent and tokens). Puts are best effort (a full pool refuses them): only blocks put are announced.

Announcements are per block and exact per worker: a block stays announced while some object this worker stored
holds it (a refcount over its single and its spans); ``BlockRemoved`` (MOONCAKE) goes out when the last is gone.

Snapshot (``snapshot_metas``): the blocks this worker stored and announced, plus the pool blocks it read for a
restore (at most ``max_known_fetched``, least recently read dropped first), so a cold gateway index fed the
snapshot resolves every announced block's parent chain.

Restores: ``fetch`` reads the objects into host memory when the request is admitted (its GPU targets reserved),
so a later eviction cannot break the restore; blocks it cannot read shorten the hit (they are computed). A restore
needing part of a span reads it whole and uses the members it needs (up to ``L - 1`` unused chunks: 13.0 KiB at
889-byte chunks, a fraction of one object's fixed cost on Mooncake).

I/O off the engine step (``io_threads``): with Mooncake, reads and puts (wall time, which a paced sim worker
counts ``time_scale`` times over) run on background threads (``num_read_threads`` reading, one writing, FIFO; the
client releases the GIL). ``start_fetch`` submits a read and returns at once; the engine steps the other sequences
while the request waits with its GPU blocks reserved, as vLLM's scheduler keeps a connector's load in
``WAITING_FOR_REMOTE_KVS`` (``vllm/v1/core/sched/scheduler.py``); ``finish_fetch`` applies the result on the loop's
thread once ``PoolFetch.done``. ``complete_store`` submits the put the same way and ``poll_stores`` announces it
(``BlockStored`` MOONCAKE) when it has landed; a block stays "in flight" (rule 1) until then. ``wake`` (set by the
engine loop) is called from an I/O thread when a read or a put is done. Without ``io_threads`` (``SimPool``, test
stores) every call runs inline. Existence checks (``lookup``, store rule 2) stay inline: 0.05-0.2 ms each.

Layout agreement (``workers.kv.pool_layout``): a new tier writes the pool's layout marker (span length, chunk
layout) unless another member did, and raises ``PoolLayoutError`` when the marker records another layout.

Buffers: staging buffers (one per store job in flight; at most ``max_free_staging_bytes`` kept idle) and restore
buffers (one per read in flight, one per read thread kept idle), from ``PoolStore.new_buffer`` (registered with
Mooncake: no copy on our side). A restore reads in one ``get_into`` batch up to ``max_read_bytes`` (64 MiB).
Use order (``workers.kv.pool_use``): what GPU or CPU served is checked once (not for a while after the pool refused
a put of this worker), so the master's lease-ordered eviction sees that use; a put's own time ranks it unchecked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from common.pool_keys import KEY_PREFIX, MAX_BLOCKS_PER_SPAN, PoolObject, pool_key, span_key
from events.types import BlockRemoved, KVEvent, Medium
from workers.config import MOONCAKE_DEFAULT_LEASE_TTL_S
from workers.errors import KVCacheError
from workers.kv.block_pool import BlockMeta, emit_tier_stored, engine_hash_of, engine_hashes_of
from workers.kv.hashing import BlockHash, to_engine_hash
from workers.kv.pool_chunk import CHUNK_VERSION, ChunkLayout, HostBuffer
from workers.kv.pool_known import KnownObjects
from workers.kv.pool_layout import PoolLayout, attach_layout
from workers.kv.pool_read import PoolFetch, ReadResult, capacity_chunks, done_future, plan_read, read_objects
from workers.kv.pool_spans import (
    PoolHit,
    hit_of,
    lookup_objects,
    objects_of,
    positions_of,
    singles_inside,
    store_objects,
)
from workers.kv.pool_store import (
    MooncakePoolStore,
    PoolStore,
    SimPool,
    SimPoolClient,
    build_pool_store,
    sim_pool,
)
from workers.kv.pool_use import UseOrder
from workers.kv.pool_zero import default_check_threads

__all__ = ["KEY_PREFIX", "MooncakePoolStore", "PoolFetch", "PoolHit", "PoolObject", "PoolStore", "PoolTier", "SimPool",
           "SimPoolClient", "build_pool_store", "pool_key", "sim_pool", "span_key"]  # fmt: skip

logger = logging.getLogger(__name__)


class _StoreJob(NamedTuple):
    """A prepared store: its objects (key, member metas, offset in the buffer), in chain order."""

    objects: list[tuple[str, tuple[BlockMeta, ...], int]]
    buffer: HostBuffer


class PoolTier:
    """The worker's side of the shared pool: lookups, batched write-through stores, fetches for restores."""

    medium = Medium.MOONCAKE

    def __init__(
        self,
        store: PoolStore,
        block_size: int,
        emit: Callable[[KVEvent], None],
        on_gpu: Callable[[Sequence[BlockHash]], bool] | None = None,
        max_known_fetched: int = 1 << 18,
        value_bytes_per_block: int = 0,
        num_layer_groups: int = 1,
        max_free_staging_bytes: int = 256 << 20,
        max_read_bytes: int = 64 << 20,
        check_padding: bool = True,
        io_threads: bool = False,
        num_read_threads: int = 1,
        blocks_per_span: int = 16,
        read_ahead: bool = True,
        num_check_threads: int | None = None,
        lease_ttl_s: float = MOONCAKE_DEFAULT_LEASE_TTL_S,
    ) -> None:
        """Wrap ``store``; events go to ``emit``; ``on_gpu`` picks the store event's shape; ``max_known_fetched``
        bounds the fetched blocks kept for snapshots; chunks hold ``num_layer_groups`` pieces and are padded to
        ``value_bytes_per_block`` (module docstring, ``workers.kv.pool_chunk``); ``check_padding``: a read
        checks the padding is zero too (``PoolConfig.verify``); ``io_threads``: reads and puts run on background
        threads (module docstring), ``num_read_threads`` reads at a time; ``blocks_per_span``: blocks per object
        along a chain (``common.pool_keys``; 1: one object per block); ``read_ahead``: a restore of
        ``2 × READ_AHEAD_MIN_BATCH_BYTES`` or more reads its next batch on a thread of its own while it checks
        one (``workers.kv.pool_read``), so its checks hide behind its reads; ``num_check_threads``: threads
        checking a restore's long padding ranges (``workers.kv.pool_zero``; ``None``: sized from the host);
        ``lease_ttl_s``: the master's lease, how long no refresh follows a refused put (``PoolConfig.lease_ttl_s``).

        Raises:
            ValueError: ``max_read_bytes``, ``num_read_threads`` or ``num_check_threads`` not positive,
                ``blocks_per_span`` not in ``[1, MAX_BLOCKS_PER_SPAN]``, ``lease_ttl_s`` not positive and finite.
            PoolLayoutError: the pool's other members use another span length or chunk layout
                (``workers.kv.pool_layout``; a ``ConfigError``): this worker does not attach.
        """
        if max_read_bytes <= 0:
            raise ValueError("max_read_bytes must be positive")
        if num_read_threads <= 0:
            raise ValueError("num_read_threads must be positive")
        if not 1 <= blocks_per_span <= MAX_BLOCKS_PER_SPAN:
            raise ValueError(f"blocks_per_span must be in [1, {MAX_BLOCKS_PER_SPAN}], not {blocks_per_span}")
        self.store = store
        self.block_size = block_size
        self.span_len = blocks_per_span
        threads = default_check_threads() if num_check_threads is None else num_check_threads  # ValueError: <= 0
        self.layout = ChunkLayout(block_size, num_layer_groups, value_bytes_per_block, threads)
        self.pool_layout = attach_layout(
            store,
            PoolLayout(blocks_per_span, num_layer_groups, self.layout.chunk_bytes, block_size, CHUNK_VERSION),
            str(getattr(store, "master_address", "in-process")),
        )
        """The layout the pool's members agreed on (``workers.kv.pool_layout``), ``None`` if the pool was down."""
        self._emit = emit
        self._on_gpu = on_gpu
        self._in_flight: set[str] = set()
        """Keys of the objects whose put is in flight from this worker (rule 1)."""
        self._jobs: dict[int, _StoreJob] = {}
        self._free_buffers: list[HostBuffer] = []
        self._max_free_staging_bytes = max_free_staging_bytes
        self._read_buffers: list[HostBuffer] = []
        """Idle restore buffers (at most one per read thread kept); a read takes one for its duration."""
        self._read_lock = threading.Lock()
        self._num_read_threads = num_read_threads if io_threads else 1
        self._max_chunks_per_read = max(1, max_read_bytes // self.layout.chunk_bytes)
        """Chunks one ``get_into`` batch reads at most (``max_read_bytes`` of them; a larger span alone)."""
        self._check_padding = check_padding
        self._stored = KnownObjects()
        """Objects this worker put (and announced its blocks of)."""
        self._fetched = KnownObjects()
        """Objects this worker read for a restore (their members read intact), for snapshots."""
        self._max_known_fetched = max_known_fetched
        self.num_stores_skipped_in_flight = 0
        self.num_stores_skipped_stored = 0
        self.num_stores_failed = 0
        """Blocks of the objects a put refused."""
        self.num_blocks_stored = 0
        """Blocks written into the pool (the members of every object put)."""
        self.num_blocks_fetched = 0
        self.num_fetch_mismatches = 0
        self.num_fetch_lost = 0
        """Reads that found an object gone which the lookup had found (its blocks announced removed)."""
        self.num_refreshes = 0
        """Existence checks made only to mark blocks served from GPU or CPU as used (``refresh``)."""
        self.uses = UseOrder(self.span_len, lease_ttl_s)  # ValueError: a bad lease
        self.num_reads = 0
        """Restore reads made (``fetch`` calls that read anything)."""
        self.read_wall_s = 0.0
        """Wall seconds those reads took (real time on this host, not the sim timing model's restore time)."""
        self.wake: Callable[[], None] | None = None
        """Called from an I/O thread when a read or a put is done (module docstring); set by the engine loop."""
        self._reader = ThreadPoolExecutor(num_read_threads, "pool-read") if io_threads else None
        self._read_ahead = ThreadPoolExecutor(num_read_threads, "pool-read-ahead") if read_ahead else None
        self._writer = ThreadPoolExecutor(1, "pool-write") if io_threads else None
        self._puts: list[tuple[int, Future[list[bool]]]] = []
        """Puts in flight on the write thread, oldest first: (job id, future of the per-object results)."""

    # ------------------------------------------------------------------ announcements

    def _announce_removed(self, metas: Sequence[BlockMeta]) -> None:
        if metas:
            self._emit(BlockRemoved(block_hashes=engine_hashes_of(metas), medium=self.medium))

    def _forget(self, key: str) -> list[BlockMeta]:
        """Forget object ``key`` in both maps; the blocks this worker knew of and knows no object for now."""
        stored, fetched = self._stored, self._fetched
        gone = [m for m in stored.forget(key) if not fetched.holds(m.block_hash)]
        gone += [m for m in fetched.forget(key) if not stored.holds(m.block_hash)]
        return gone

    def on_evict(self, keys: list[str]) -> None:
        """The pool evicted ``keys``: ``BlockRemoved`` (MOONCAKE) for the blocks this worker stored or fetched
        that no other object it knows of holds."""
        gone: dict[BlockHash, BlockMeta] = {}
        for k in keys:
            for m in self._forget(k):
                gone.setdefault(m.block_hash, m)
        self._announce_removed(list(gone.values()))

    def _object_gone(self, obj: PoolObject, metas: Sequence[BlockMeta]) -> None:
        """A read found ``obj`` gone or corrupt: ``BlockRemoved`` for every member no other object this worker
        knows of holds (members another worker stored included: the index applies those as the holder's);
        ``metas``: the restore's blocks (the members' metas where known)."""
        self._forget(obj.key)
        by_hash = {m.block_hash: m for m in metas}
        stored, fetched = self._stored, self._fetched
        hashes = tuple(
            engine_hash_of(by_hash[h]) if h in by_hash else to_engine_hash(h)
            for h in map(BlockHash, obj.member_hashes)
            if not stored.holds(h) and not fetched.holds(h)
        )
        if hashes:
            self._emit(BlockRemoved(block_hashes=hashes, medium=self.medium))

    # ------------------------------------------------------------------ lookups

    def span_start(self, depth: int) -> int:
        """The chain position of the first block of the span holding position ``depth``."""
        return depth - depth % self.span_len

    def lookup(self, hashes: Sequence[BlockHash], first: int = 0, limit: int | None = None) -> PoolHit:
        """How many blocks of the chain ``hashes`` (position ``i`` is ``hashes[i]``), from position ``first`` up
        to ``limit`` (exclusive; default: all), are in the pool, and the objects holding them.

        A span is checked when the chain reaches its last position, even past ``limit`` (a hit may end inside a
        span: the restore reads it whole and uses the members it needs); the blocks after the chain's last full
        span are checked as singles. One batched existence check (``batch_is_exist``) of those keys; when a span
        is missing, one more of its singles (module docstring).
        """
        end = len(hashes) if limit is None else min(limit, len(hashes))
        if first >= end:
            return PoolHit(0, ())
        spans, singles = lookup_objects(hashes, first, end, self.span_len)
        present = self.store.exists([o.key for o in spans] + [o.key for o in singles])
        found: list[PoolObject] = []
        for obj, ok in zip(spans, present, strict=False):
            if not ok:  # the hit goes on through this span's singles, and ends inside it
                inner = singles_inside(hashes, obj, first, end)
                inner_present = self.store.exists([o.key for o in inner]) if inner else []
                self._lost([obj, *inner], [False, *inner_present])
                return hit_of(first, end, found, inner, inner_present)
            found.append(obj)
        self._lost(singles, present[len(spans) :])
        return hit_of(first, end, found, singles, present[len(spans) :])

    def _lost(self, objects: Sequence[PoolObject], present: Sequence[bool]) -> None:
        """Announce removed the blocks of missing ``objects`` this worker had stored or read (the master evicted
        them and tells no one), before the answer whose shorter hit the gateway would read as a wrong index."""
        for obj, ok in zip(objects, present, strict=False):
            if not ok:
                self._announce_removed(self._forget(obj.key))

    def refresh(self, hashes: Sequence[BlockHash], end: int) -> None:
        """The chain's first ``end`` blocks were used, from GPU or CPU: one existence check of their objects
        (``workers.kv.pool_use``), on the read threads when there are any (not waited for); ``num_refreshes``."""
        keys = self.uses.refresh_keys(hashes, end)
        if not keys:
            return
        self.num_refreshes += 1
        if self._reader is None:
            self.store.exists(keys)
        else:
            self._reader.submit(self.store.exists, keys)

    # ------------------------------------------------------------------ stores

    def _take_buffer(self, num_chunks: int) -> HostBuffer:
        size = num_chunks * self.layout.chunk_bytes
        free = self._free_buffers
        for i, buffer in enumerate(free):
            if buffer.num_bytes >= size:
                return free.pop(i)
        return self.store.new_buffer(capacity_chunks(num_chunks) * self.layout.chunk_bytes)

    def _give_back(self, buffer: HostBuffer) -> None:
        free = self._free_buffers
        free.append(buffer)
        free.sort(key=lambda b: b.num_bytes)  # smallest that fits first
        while sum(b.num_bytes for b in free) > self._max_free_staging_bytes:
            self.store.release_buffer(free.pop())

    def prepare_store(
        self,
        job_id: int,
        hashes: list[BlockHash],
        metas: Sequence[BlockMeta],
        num_context_blocks: int = 0,
        payloads: Sequence[bytes] | None = None,
    ) -> list[int]:
        """Choose the objects to store (rules 1 and 2) and build their chunks in a staging buffer (rule 3).

        Args:
            job_id: the job's id (``complete_store``).
            hashes: the blocks' hashes (``metas[i].block_hash``).
            metas: one run of consecutive chain positions: ``num_context_blocks`` earlier members of the first
                span (``span_start``), then the blocks just cached.
            num_context_blocks: leading blocks written only as members of a span this job completes.
            payloads: each block's tokens packed (``SequenceKV.block_payloads``, one per meta), or ``None``: packed
                here.

        Returns:
            Positions in ``metas`` of the blocks to copy (empty: no job).

        Raises:
            ValueError: ``metas`` is not one run of consecutive chain positions.
        """
        objects = store_objects(metas, self.span_len, num_context_blocks)
        payloads = payloads if payloads is not None and len(payloads) == len(metas) else None  # else packed here

        def num_new(lo: int, hi: int) -> int:
            return hi - max(lo, min(hi, num_context_blocks))

        in_flight = self._in_flight
        candidates = [o for o in objects if o[0] not in in_flight] if in_flight else objects
        self.num_stores_skipped_in_flight += sum(num_new(lo, hi) for k, lo, hi in objects if k in in_flight)
        if not candidates:
            return []
        present = self.store.exists([o[0] for o in candidates])
        chosen = [o for o, p in zip(candidates, present, strict=True) if not p] if any(present) else candidates
        self.num_stores_skipped_stored += sum(
            num_new(lo, hi) for (_, lo, hi), p in zip(candidates, present, strict=True) if p
        )
        if not chosen:
            return []
        positions = positions_of(chosen)
        layout = self.layout
        buffer = self._take_buffer(len(positions))
        step = layout.chunk_bytes
        run = metas if len(positions) == len(metas) else [metas[i] for i in positions]  # slot j: positions[j]
        payloads = payloads if payloads is None or run is metas else [payloads[i] for i in positions]
        layout.write_run(buffer, 0, hashes if run is metas and len(hashes) == len(run) else [m.block_hash for m in run],
                         () if payloads is not None else [m.token_ids for m in run], payloads)  # fmt: skip
        job_objects: list[tuple[str, tuple[BlockMeta, ...], int]] = []
        offset = 0
        for key, lo, hi in chosen:
            job_objects.append((key, tuple(metas[lo:hi]), offset))
            offset += (hi - lo) * step
            in_flight.add(key)
        self._jobs[job_id] = _StoreJob(job_objects, buffer)
        return positions

    def complete_store(self, job_id: int) -> None:
        """The copy of ``job_id`` landed: put its objects (one ``batch_put_from`` from the staging buffer), announce
        the blocks stored (``BlockStored`` MOONCAKE); with ``io_threads`` the put is submitted and ``poll_stores``
        announces it once it has landed.

        Raises:
            KVCacheError: an unknown job.
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise KVCacheError(f"unknown pool store job {job_id}")
        step = self.layout.chunk_bytes
        keys = [key for key, _, _ in job.objects]
        offsets = [offset for _, _, offset in job.objects]
        sizes = [len(members) * step for _, members, _ in job.objects]
        if self._writer is None:
            try:
                ok = self.store.put_from(keys, job.buffer, offsets, sizes)
            except BaseException:
                self._finish_store(job_id, [False] * len(keys))
                raise
            self._finish_store(job_id, ok)
            return
        future = self._writer.submit(self.store.put_from, keys, job.buffer, offsets, sizes)
        self._puts.append((job_id, future))
        if self.wake is not None:
            future.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None:
            wake()

    def poll_stores(self) -> int:
        """Announce the puts that have landed (``io_threads``), in submission order; how many jobs finished."""
        n = 0
        puts = self._puts
        while puts and puts[0][1].done():
            job_id, future = puts.pop(0)
            try:
                ok = future.result()
            except Exception:  # noqa: BLE001 - a store call that raised past its own handling: nothing was put
                logger.exception("pool put of job %d failed", job_id)
                ok = [False] * len(self._jobs[job_id].objects)
            self._finish_store(job_id, ok)
            n += 1
        return n

    @property
    def num_io_in_flight(self) -> int:
        """Puts submitted to the I/O threads whose results were not applied yet (reads: their ``PoolFetch``)."""
        return len(self._puts)

    def _finish_store(self, job_id: int, ok: list[bool]) -> None:
        job = self._jobs.pop(job_id)
        self._give_back(job.buffer)
        self.uses.put_landed(ok)
        announce: list[BlockMeta] = []
        for (key, members, _), good in zip(job.objects, ok, strict=True):
            self._in_flight.discard(key)
            if not good:
                self.num_stores_failed += len(members)
                continue
            self.num_blocks_stored += len(members)
            announce += self._stored.add(key, members)
        if not announce:
            return
        on_gpu = self._on_gpu is not None and self._on_gpu([m.block_hash for m in announce])
        emit_tier_stored(self._emit, announce, engine_hashes_of(announce), self.block_size, self.medium, on_gpu)

    # ------------------------------------------------------------------ restores

    def fetch(
        self, metas: Sequence[BlockMeta], objects: Sequence[PoolObject] = (), payloads: Sequence[bytes] | None = None
    ) -> int:
        """Read blocks for a restore (into host memory) and wait for them; returns how many, from the first, were
        read intact (``start_fetch`` then ``finish_fetch``)."""
        return self.finish_fetch(self.start_fetch(metas, objects, payloads))

    def start_fetch(
        self, metas: Sequence[BlockMeta], objects: Sequence[PoolObject] = (), payloads: Sequence[bytes] | None = None
    ) -> PoolFetch:
        """Submit the read of ``metas`` (consecutive chain positions) from ``objects`` (``PoolHit.objects``; the
        ones not holding any of ``metas`` are skipped; empty: the spans ``metas`` covers whole and singles), on
        the read thread with ``io_threads``, else done at once; ``payloads``: the blocks' tokens packed
        (``SequenceKV.block_payloads``, one per meta), or ``None``: packed for the checks."""
        payloads = payloads if payloads is not None and len(payloads) == len(metas) else None  # else packed
        if metas:
            lo, hi = metas[0].depth, metas[-1].depth
            objects = (
                [o for o in objects if o.first_depth <= hi and o.first_depth + len(o.member_hashes) > lo]
                if objects
                else objects_of(metas, self.span_len)
            )
        if not metas or self._reader is None:
            return PoolFetch(metas, objects, done_future(self._read(metas, objects, payloads)))
        future = self._reader.submit(self._read, metas, objects, payloads)
        if self.wake is not None:
            future.add_done_callback(lambda _: self._wake())
        return PoolFetch(metas, objects, future)

    def _take_read_buffer(self, num_bytes: int) -> HostBuffer:
        """A restore buffer of ``num_bytes`` at least."""
        with self._read_lock:
            free = self._read_buffers
            for i, buffer in enumerate(free):
                if buffer.num_bytes >= num_bytes:
                    return free.pop(i)
        return self.store.new_buffer(num_bytes)

    def _give_read_buffer(self, buffer: HostBuffer) -> None:
        with self._read_lock:
            free = self._read_buffers
            free.append(buffer)
            free.sort(key=lambda b: b.num_bytes)
            extra = free.pop(0) if len(free) > self._num_read_threads else None  # the smallest goes
        if extra is not None:
            self.store.release_buffer(extra)

    def _read(
        self, metas: Sequence[BlockMeta], objects: Sequence[PoolObject], payloads: Sequence[bytes] | None
    ) -> ReadResult:
        """The read itself (``read_objects``) into a restore buffer of its own, no other state (reads run at once)."""
        if not metas:
            return ReadResult(0, 0.0)
        ahead = self._read_ahead
        batches, num_bytes = plan_read(objects, self.layout.chunk_bytes, self._max_chunks_per_read, ahead is not None)
        buffer = self._take_read_buffer(num_bytes)
        try:
            return read_objects(self.store, self.layout, buffer, metas, batches, self._check_padding, payloads, ahead)
        finally:
            self._give_read_buffer(buffer)

    def finish_fetch(self, fetch: PoolFetch) -> int:
        """Apply a read's result (waiting for it if it is still running); how many blocks, from the first, were
        read intact.

        An object that is missing ends the hit there; one the pool reports not found (evicted since the lookup)
        is announced as ``BlockRemoved`` (MOONCAKE), every member of it that no other object this worker knows of
        holds, and counted (``num_fetch_lost``): a Mooncake master tells no one what it evicts, and this is how
        the gateway learns it before the answer that reports the shorter hit, so the honesty check reads it as a
        forecast miss, not a wrong index. One read back with other bytes (any member's manifest, layer group's
        piece or padding, or the object's size) is counted, logged, announced the same way and removed from the
        pool, and ends the hit there too.
        """
        metas = fetch.metas
        if not metas:
            return 0
        try:
            result = fetch.future.result()
        except Exception:  # noqa: BLE001 - a read that raised past the store's own handling: nothing read
            logger.exception("pool read of %d blocks failed", len(metas))
            result = ReadResult(0, 0.0)
        n = result.num_intact
        gone = result.bad or result.lost
        if result.bad is not None:
            bad = result.bad
            self.num_fetch_mismatches += 1  # bytes that are not the block's: never restored
            logger.warning("pool object %s (block %s) read back with other bytes (%d of %d read); computed instead "
                           "and removed from the pool", bad.key, metas[n].block_hash.hex(), result.bad_num_read,
                           bad.num_blocks * self.layout.chunk_bytes)  # fmt: skip
            self._object_gone(bad, metas)  # before the removal: a sim pool's listener then finds nothing to say
            self.store.remove([bad.key])
        elif result.lost is not None and n < len(metas):
            self.num_fetch_lost += 1
            self._object_gone(result.lost, metas)
        self.num_reads += 1
        self.read_wall_s += result.wall_s
        self.num_blocks_fetched += n
        if n:
            self._note_fetched(fetch.objects, metas[:n], None if gone is None else gone.key)
        return n

    def _note_fetched(self, objects: Sequence[PoolObject], metas: Sequence[BlockMeta], gone: str | None) -> None:
        """Remember the objects read (those another worker stored, but ``gone``) with their members read intact."""
        known, stored = self._fetched, self._stored.objects
        d0, num = metas[0].depth, len(metas)  # metas: consecutive chain positions
        i = 0
        for obj in objects:
            j = min(obj.first_depth + len(obj.member_hashes) - d0, num)
            if j > i and obj.key not in stored and obj.key != gone:
                known.add(obj.key, metas[i:j])
            i = max(i, j)
            if i == num:
                break
        while known.num_blocks > self._max_known_fetched and known.objects:
            known.pop_oldest()

    def close(self) -> None:
        """Stop the I/O threads (``io_threads``) without waiting: work not started is dropped, a call running
        ends on its own; the store is closed by its owner."""
        for pool in (self._reader, self._writer, self._read_ahead):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.layout.close()

    def snapshot_metas(self) -> list[BlockMeta]:
        """The pool blocks this worker knows of (stored here, then fetched), each once, for ``/kv/snapshot``."""
        stored = self._stored
        return [*stored.metas(), *(m for m in self._fetched.metas() if not stored.holds(m.block_hash))]

    def block_counts(self) -> dict[str, int]:
        """For the load endpoint: ``num_used_blocks`` and ``num_free_blocks`` of the whole pool where the store
        reports them, and ``num_blocks_stored_here`` (announced by this worker and not known to be evicted)."""
        out = {"num_blocks_stored_here": self._stored.num_blocks}
        counts = self.store.num_blocks()
        if counts is not None:
            used, capacity = counts
            out["num_used_blocks"] = used
            out["num_free_blocks"] = max(0, capacity - used)
        return out

    def reset(self) -> None:
        """Forget what this worker announced (the shared pool itself is not cleared by one worker)."""
        self._stored.clear()
        self._fetched.clear()
