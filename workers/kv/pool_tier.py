"""The shared pool tier (``Medium.MOONCAKE``): below the CPU tier, shared by every worker attached to it.

Blocks are written through from the GPU (like the CPU tier, under ``pool-store-policy``) and restored from the
pool into GPU blocks reserved for them. The pool is keyed by the worker's collision-resistant block hash
(SHA-256 chain rooted in the namespace, ``workers.kv.hashing``)::

    key(block) = "kvgate/v1/" + hex(block_hash)

so a block stored by one worker is found and restored by any other worker attached to the same pool. The store
behind it (``workers.kv.pool_store``): an in-process ``SimPool`` or a Mooncake Store client.

Values: one chunk per block (``workers.kv.pool_chunk``): a manifest header and every layer group's piece in one
object, so the pool keeps or evicts the whole block, and a read accepts it only when every byte checks out
(else the block and the rest of the hit are computed; ``num_fetch_mismatches`` counts it, and the corrupt object
is removed from the pool so no worker reads it again).

Store rules (as the CPU tier): a block whose store is in flight from this worker is skipped (rule 1); a block
already in the pool, stored by any worker, is skipped (rule 2: one batched existence check per job); a store once
scheduled completes even if the GPU copy is evicted meanwhile: its chunks are built in a staging buffer when the
job is prepared (rule 3). A completed store puts the job's chunks in one batch straight from that buffer and
emits one ``BlockStored`` (MOONCAKE) per job, token-less when all its blocks are still in the GPU prefix index
(else with parent and tokens). Puts are best effort (a full pool refuses them): only blocks put are announced.

Snapshot (``snapshot_metas``): the blocks this worker stored and announced, plus the pool blocks it read for a
restore (at most ``max_known_fetched`` of them, least recently read dropped first), so that a cold gateway index
fed the worker's snapshot resolves every announced block's parent chain (a block another worker stored is
reachable through the pool by every member, so announcing it here predicts the same hits).

Restores: ``fetch`` reads the chunks into host memory when the request is admitted (its GPU targets are reserved
then), so a pool eviction after admission cannot break the restore; blocks it cannot read shorten the hit (they
are computed instead).

I/O off the engine step (``io_threads``): with a real store (Mooncake), the reads and the puts are the slow part
of a restore or a store (wall time on this host, which a paced sim worker counts ``time_scale`` times over), so
they run on background threads (``num_read_threads`` reading, several restores at once, and one writing, FIFO;
the Mooncake client releases the GIL in its calls) instead of inside the engine loop. ``start_fetch`` submits a
read and returns at once; the engine keeps stepping the other sequences while the request waits with its GPU
blocks reserved (``KVCacheManager.admit``); ``finish_fetch`` applies the result on the loop's thread (counters,
the removal of a corrupt chunk, the known blocks) once ``PoolFetch.done``. ``complete_store`` submits the put
the same way and ``poll_stores`` announces the blocks put (``BlockStored`` MOONCAKE) when it has landed; a block
stays "in flight" (rule 1) until then. vLLM loads a connector's KV the same way: ``get_num_new_matched_tokens``
returns ``load_kv_async`` and the request waits in ``WAITING_FOR_REMOTE_KVS``, blocks allocated, while the
scheduler runs the others (``vllm/v1/core/sched/scheduler.py``). ``wake`` (set by the engine loop) is called
from the I/O thread when a read or a put is done, so an idle loop wakes up for it. Without ``io_threads`` (the
in-process ``SimPool``, and stores passed in by tests) every call runs inline and completes before it returns.
The existence checks (``lookup``, store rule 2) stay inline: one ``batch_is_exist`` round trip, 0.05-0.2 ms.

Buffers: staging buffers (one per store job in flight, reused; at most ``max_free_staging_bytes`` kept idle) and
restore buffers (one per read in flight, at most one per read thread kept idle), all from the store
(``PoolStore.new_buffer``: registered with Mooncake), so chunks move without a copy on our side. A restore reads
its chunks in one ``get_into`` batch up to ``max_read_bytes`` (64 MiB: one batch for any sim restore, 256 chunks
of 256 KiB): each batch is a master lookup plus a transfer per object, so splitting a restore into several
batches only adds round trips.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from events.types import BlockRemoved, EngineBlockHash, KVEvent, Medium
from workers.errors import KVCacheError
from workers.kv.block_pool import BlockMeta, emit_tier_stored, engine_hash_of
from workers.kv.hashing import BlockHash
from workers.kv.pool_chunk import ChunkLayout, HostBuffer
from workers.kv.pool_store import (
    OBJECT_NOT_FOUND,
    MooncakePoolStore,
    PoolStore,
    SimPool,
    SimPoolClient,
    build_pool_store,
    sim_pool,
)

__all__ = [
    "KEY_PREFIX",
    "MooncakePoolStore",
    "PoolFetch",
    "PoolStore",
    "PoolTier",
    "SimPool",
    "SimPoolClient",
    "build_pool_store",
    "pool_key",
    "sim_pool",
]

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvgate/v1/"


def pool_key(block_hash: BlockHash) -> str:
    """The pool key of a block (module docstring)."""
    return KEY_PREFIX + block_hash.hex()


class _ReadResult:
    """What one restore read found (computed on the read thread, applied by ``PoolTier.finish_fetch``)."""

    __slots__ = ("num_intact", "bad_at", "bad_num_read", "wall_s", "is_lost")

    def __init__(
        self, num_intact: int, bad_at: int | None, bad_num_read: int, wall_s: float, is_lost: bool = False
    ) -> None:
        self.num_intact = num_intact
        self.is_lost = is_lost
        """The chunk after the intact ones was not found (the pool evicted it since the lookup)."""
        self.bad_at = bad_at
        """Position (in the fetch's metas) of a chunk read back with other bytes, or ``None``."""
        self.bad_num_read = bad_num_read
        self.wall_s = wall_s


class PoolFetch:
    """A restore read submitted by ``PoolTier.start_fetch``: its blocks' metas and the read's future."""

    __slots__ = ("metas", "future")

    def __init__(self, metas: Sequence[BlockMeta], future: Future[_ReadResult]) -> None:
        self.metas = metas
        self.future = future

    def done(self) -> bool:
        """Whether the read has finished (``PoolTier.finish_fetch`` then returns at once)."""
        return self.future.done()


def _done_future(value: _ReadResult) -> Future[_ReadResult]:
    future: Future[_ReadResult] = Future()
    future.set_result(value)
    return future


def _capacity(num_chunks: int) -> int:
    """Chunks a new buffer holds: the next power of two, at least 8 (so buffers are reused across job sizes)."""
    return max(8, 1 << (num_chunks - 1).bit_length())


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
    ) -> None:
        """Wrap ``store``; events go to ``emit``; ``on_gpu`` picks the store event's shape; ``max_known_fetched``
        bounds the fetched blocks kept for snapshots; chunks hold ``num_layer_groups`` pieces and are padded to
        ``value_bytes_per_block`` (module docstring, ``workers.kv.pool_chunk``); ``check_padding``: a read
        checks the padding is zero too (``PoolConfig.verify``); ``io_threads``: reads and puts run on background
        threads (module docstring), ``num_read_threads`` reads at a time."""
        if max_read_bytes <= 0:
            raise ValueError("max_read_bytes must be positive")
        if num_read_threads <= 0:
            raise ValueError("num_read_threads must be positive")
        self.store = store
        self.block_size = block_size
        self.layout = ChunkLayout(block_size, num_layer_groups, value_bytes_per_block)
        self._emit = emit
        self._on_gpu = on_gpu
        self._in_flight: set[BlockHash] = set()
        self._jobs: dict[int, tuple[list[BlockHash], list[BlockMeta], HostBuffer]] = {}
        self._free_buffers: list[HostBuffer] = []
        self._max_free_staging_bytes = max_free_staging_bytes
        self._read_buffers: list[HostBuffer] = []
        """Idle restore buffers (at most one per read thread kept); a read takes one for its duration."""
        self._read_lock = threading.Lock()
        self._num_read_threads = num_read_threads if io_threads else 1
        self._max_chunks_per_read = max(1, max_read_bytes // self.layout.chunk_bytes)
        """Chunks one ``get_into`` batch reads at most (``max_read_bytes`` of them, at least one)."""
        self._check_padding = check_padding
        self._stored_here: dict[str, BlockMeta] = {}
        self._fetched: OrderedDict[str, BlockMeta] = OrderedDict()
        self._max_known_fetched = max_known_fetched
        self.num_stores_skipped_in_flight = 0
        self.num_stores_skipped_stored = 0
        self.num_stores_failed = 0
        self.num_blocks_stored = 0
        self.num_blocks_fetched = 0
        self.num_fetch_mismatches = 0
        self.num_fetch_lost = 0
        """Reads that found a chunk gone which the lookup had found (announced as removed, ``finish_fetch``)."""
        self.num_reads = 0
        """Restore reads made (``fetch`` calls that read anything)."""
        self.read_wall_s = 0.0
        """Wall seconds those reads took (real time on this host, not the sim timing model's restore time)."""
        self.wake: Callable[[], None] | None = None
        """Called from an I/O thread when a read or a put is done (module docstring); set by the engine loop."""
        self._reader = ThreadPoolExecutor(num_read_threads, "pool-read") if io_threads else None
        self._writer = ThreadPoolExecutor(1, "pool-write") if io_threads else None
        self._puts: list[tuple[int, Future[list[bool]]]] = []
        """Puts in flight on the write thread, oldest first: (job id, future of the per-key results)."""

    def on_evict(self, keys: list[str]) -> None:
        """The pool evicted ``keys``: ``BlockRemoved`` (MOONCAKE) for those this worker stored or fetched."""
        hashes: list[EngineBlockHash] = []
        for k in keys:
            stored = self._stored_here.pop(k, None)
            fetched = self._fetched.pop(k, None)
            meta = stored if stored is not None else fetched
            if meta is not None:
                hashes.append(engine_hash_of(meta))
        if hashes:
            self._emit(BlockRemoved(block_hashes=tuple(hashes), medium=self.medium))

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, are in the pool (one batched existence check)."""
        n = 0
        for ok in self.store.exists([pool_key(h) for h in block_hashes]):
            if not ok:
                break
            n += 1
        return n

    def _take_buffer(self, num_chunks: int) -> HostBuffer:
        size = num_chunks * self.layout.chunk_bytes
        free = self._free_buffers
        for i, buffer in enumerate(free):
            if buffer.num_bytes >= size:
                return free.pop(i)
        return self.store.new_buffer(_capacity(num_chunks) * self.layout.chunk_bytes)

    def _give_back(self, buffer: HostBuffer) -> None:
        free = self._free_buffers
        free.append(buffer)
        free.sort(key=lambda b: b.num_bytes)  # smallest that fits first
        while sum(b.num_bytes for b in free) > self._max_free_staging_bytes:
            self.store.release_buffer(free.pop())

    def prepare_store(self, job_id: int, hashes: list[BlockHash], metas: Sequence[BlockMeta]) -> list[int]:
        """Choose the blocks to store (rules 1 and 2) and build their chunks in a staging buffer (rule 3).

        Returns:
            Positions in ``hashes`` of the blocks to copy (empty: no job).
        """
        in_flight = self._in_flight
        candidates = [i for i, h in enumerate(hashes) if h not in in_flight]
        self.num_stores_skipped_in_flight += len(hashes) - len(candidates)
        if not candidates:
            return []
        present = self.store.exists([pool_key(hashes[i]) for i in candidates])
        chosen = [i for i, p in zip(candidates, present, strict=True) if not p]
        self.num_stores_skipped_stored += len(candidates) - len(chosen)
        if chosen:
            job_hashes = [hashes[i] for i in chosen]
            job_metas = [metas[i] for i in chosen]
            in_flight.update(job_hashes)
            layout = self.layout
            buffer = self._take_buffer(len(chosen))
            view, step = buffer.view, layout.chunk_bytes
            for j, meta in enumerate(job_metas):
                layout.write(view, j * step, meta.block_hash, meta.token_ids)
            self._jobs[job_id] = (job_hashes, job_metas, buffer)
        return chosen

    def complete_store(self, job_id: int) -> None:
        """The copy of ``job_id`` landed: put its chunks, announce those stored (``BlockStored`` MOONCAKE); with
        ``io_threads`` the put is submitted and ``poll_stores`` announces it once it has landed.

        Raises:
            KVCacheError: an unknown job.
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise KVCacheError(f"unknown pool store job {job_id}")
        hashes, _, buffer = job
        keys = [pool_key(h) for h in hashes]
        step = self.layout.chunk_bytes
        offsets = range(0, len(keys) * step, step)
        if self._writer is None:
            try:
                ok = self.store.put_from(keys, buffer, offsets, step)
            except BaseException:
                self._finish_store(job_id, [False] * len(keys))
                raise
            self._finish_store(job_id, ok)
            return
        future = self._writer.submit(self.store.put_from, keys, buffer, offsets, step)
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
                ok = [False] * len(self._jobs[job_id][0])
            self._finish_store(job_id, ok)
            n += 1
        return n

    @property
    def num_io_in_flight(self) -> int:
        """Reads and puts submitted to the I/O threads whose results were not applied yet (puts only: reads are
        tracked by their ``PoolFetch``)."""
        return len(self._puts)

    def _finish_store(self, job_id: int, ok: list[bool]) -> None:
        hashes, metas, buffer = self._jobs.pop(job_id)
        self._in_flight.difference_update(hashes)
        self._give_back(buffer)
        keys = [pool_key(h) for h in hashes]
        if not all(ok):
            self.num_stores_failed += ok.count(False)
            hashes = [h for h, good in zip(hashes, ok, strict=True) if good]
            metas = [m for m, good in zip(metas, ok, strict=True) if good]
            keys = [k for k, good in zip(keys, ok, strict=True) if good]
        if not hashes:
            return
        self.num_blocks_stored += len(hashes)
        engine_hashes = tuple(map(engine_hash_of, metas))
        self._stored_here.update(zip(keys, metas, strict=True))
        emit_tier_stored(
            self._emit,
            metas,
            engine_hashes,
            self.block_size,
            self.medium,
            self._on_gpu is not None and self._on_gpu(hashes),
        )

    def fetch(self, metas: Sequence[BlockMeta]) -> int:
        """Read blocks for a restore (into host memory) and wait for them; returns how many, from the first, were
        read intact (``start_fetch`` then ``finish_fetch``)."""
        return self.finish_fetch(self.start_fetch(metas))

    def start_fetch(self, metas: Sequence[BlockMeta]) -> PoolFetch:
        """Submit the read of ``metas``' chunks (on the read thread with ``io_threads``, else done at once)."""
        if not metas or self._reader is None:
            return PoolFetch(metas, _done_future(self._read(metas)))
        future = self._reader.submit(self._read, metas)
        if self.wake is not None:
            future.add_done_callback(lambda _: self._wake())
        return PoolFetch(metas, future)

    def _take_read_buffer(self, num_bytes: int) -> HostBuffer:
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

    def _read(self, metas: Sequence[BlockMeta]) -> _ReadResult:
        """The read itself: store calls and chunk checks into a restore buffer of its own, no other state (the
        read threads run several at once)."""
        if not metas:
            return _ReadResult(0, None, 0, 0.0)
        t0 = time.perf_counter()
        layout = self.layout
        step = layout.chunk_bytes
        n = 0
        per_read = self._max_chunks_per_read
        buffer = self._take_read_buffer(min(_capacity(min(len(metas), per_read)), per_read) * step)
        try:
            for start in range(0, len(metas), per_read):
                batch = metas[start : start + per_read]
                keys = [pool_key(m.block_hash) for m in batch]
                sizes = self.store.get_into(keys, buffer, range(0, len(batch) * step, step), step)
                data = buffer.data
                for j, (meta, num_read) in enumerate(zip(batch, sizes, strict=True)):
                    if num_read < 0:
                        return _ReadResult(n, None, 0, time.perf_counter() - t0, num_read == OBJECT_NOT_FOUND)
                    if not layout.check(data, j * step, num_read, meta.block_hash, meta.token_ids,
                                        self._check_padding):  # fmt: skip
                        return _ReadResult(n, n, num_read, time.perf_counter() - t0)
                    n += 1
            return _ReadResult(n, None, 0, time.perf_counter() - t0)
        finally:
            self._give_read_buffer(buffer)

    def finish_fetch(self, fetch: PoolFetch) -> int:
        """Apply a read's result (waiting for it if it is still running); how many blocks, from the first, were
        read intact.

        A chunk that is missing ends the hit there; one the pool reports not found (evicted since the lookup)
        is announced as ``BlockRemoved`` (MOONCAKE) and counted (``num_fetch_lost``): a Mooncake master tells no
        one what it evicts, and this is how the gateway learns it before the answer that reports the shorter hit,
        so the honesty check reads it as a forecast miss, not a wrong index. One read back with other bytes (any
        layer group's piece, the manifest or the padding) is counted, logged and removed from the pool, and ends
        the hit there too.
        """
        metas = fetch.metas
        if not metas:
            return 0
        try:
            result = fetch.future.result()
        except Exception:  # noqa: BLE001 - a read that raised past the store's own handling: nothing read
            logger.exception("pool read of %d blocks failed", len(metas))
            result = _ReadResult(0, None, 0, 0.0)
        n = result.num_intact
        if result.bad_at is not None:
            meta = metas[result.bad_at]
            key = pool_key(meta.block_hash)
            self.num_fetch_mismatches += 1  # bytes that are not the block's: never restored
            logger.warning("pool block %s read back with other bytes (%d of %d read); computed instead and "
                           "removed from the pool", meta.block_hash.hex(), result.bad_num_read,
                           self.layout.chunk_bytes)  # fmt: skip
            self.store.remove([key])
            self.on_evict([key])
        elif result.is_lost and n < len(metas):
            lost = metas[n]
            self.num_fetch_lost += 1
            self._stored_here.pop(pool_key(lost.block_hash), None)
            self._fetched.pop(pool_key(lost.block_hash), None)
            self._emit(BlockRemoved(block_hashes=(engine_hash_of(lost),), medium=self.medium))
        self.num_reads += 1
        self.read_wall_s += result.wall_s
        self.num_blocks_fetched += n
        known = self._fetched
        for meta in metas[:n]:
            key = pool_key(meta.block_hash)
            if key not in self._stored_here:
                known[key] = meta
                known.move_to_end(key)
        while len(known) > self._max_known_fetched:
            known.popitem(last=False)
        return n

    def close(self) -> None:
        """Stop the I/O threads (``io_threads``) without waiting: work not started is dropped, a call running
        ends on its own; the store is closed by its owner."""
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def snapshot_metas(self) -> list[BlockMeta]:
        """The pool blocks this worker knows of (stored here, then fetched), for ``/kv/snapshot``."""
        return [*self._stored_here.values(), *(m for k, m in self._fetched.items() if k not in self._stored_here)]

    def block_counts(self) -> dict[str, int]:
        """For the load endpoint: ``num_used_blocks`` and ``num_free_blocks`` of the whole pool where the store
        reports them, and ``num_blocks_stored_here`` (announced by this worker and not known to be evicted)."""
        out = {"num_blocks_stored_here": len(self._stored_here)}
        counts = self.store.num_blocks()
        if counts is not None:
            used, capacity = counts
            out["num_used_blocks"] = used
            out["num_free_blocks"] = max(0, capacity - used)
        return out

    def reset(self) -> None:
        """Forget what this worker announced (the shared pool itself is not cleared by one worker)."""
        self._stored_here.clear()
        self._fetched.clear()
