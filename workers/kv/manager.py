"""The KV cache manager: per-sequence block tables over the GPU pool and the CPU tier.

What the scheduler calls, per sequence (``SequenceKV``)::

    find_prefix(seq, token_ids)     -> PrefixHit      GPU hit, then its continuation on CPU
    admit(seq, hit, num_tokens)     -> bool           take the hit, reserve restore targets, allocate the rest
    allocate_slots(seq, num_tokens) -> bool           grow the block table to cover num_tokens
    cache_computed(seq, token_ids, num_computed_tokens, num_prompt_tokens)
                                                       register new full blocks (+ write-through stores)
    free(seq)                                          drop the sequence's references (tail first)
    take_copies() / complete_store(job) / complete_restore(job)
    take_events()                                      KV events since the last call (swap)

Cached tokens follow vLLM's rule (the last prompt token is always computed); a hit covers consecutive full blocks
found on GPU, continued on CPU, then in the shared pool.

Restores: the continuation found on CPU is copied into GPU blocks reserved by ``admit`` (counted against free
blocks before anything is taken, so a restore is admitted only when its targets exist). When the copy lands,
the blocks are registered in the GPU prefix index (``BlockStored`` GPU) so the next turn hits on GPU; a sequence
freed meanwhile keeps its blocks until the copy lands. ``admit`` marks the pool copy of its GPU and CPU hit used.

Pool reads off the step (``PoolTier`` with ``io_threads``): ``admit`` submits the read and reserves its GPU blocks,
counting the hit as found; ``take_finished_reads`` reports the read once its bytes are in host memory. A short read
(evicted or corrupt chunks) shortens the hit: the rest is computed and ``seq.num_cached_blocks`` drops to match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from events.types import AllBlocksCleared, BlockStored, KVEvent, Medium, SpecKind
from workers.config import MOONCAKE_DEFAULT_LEASE_TTL_S, KVCacheConfig
from workers.engines.base import BlockCopy
from workers.errors import ConfigError, KVCacheError
from workers.kv.block_pool import BlockMeta, BlockPool
from workers.kv.cpu_tier import CpuTier
from workers.kv.hashing import BlockHash, extend_block_hashes, to_engine_hash
from workers.kv.hybrid import CheckpointCosts, HybridGroups
from workers.kv.pool_tier import PoolFetch, PoolObject, PoolStore, PoolTier, build_pool_store
from workers.kv.sequence import PrefixHit, SequenceKV, max_cached_blocks
from workers.kv.snapshot import snapshot_events

logger = logging.getLogger(__name__)

__all__ = ["KVCacheManager", "PrefixHit", "SequenceKV", "max_cached_blocks"]
"""The manager, and the sequence types it works on (``workers.kv.sequence``), importable from here."""


class _RestoreJob:
    """One restore of a sequence (shared by its CPU and pool jobs): registered on GPU when all jobs landed."""

    __slots__ = ("seq", "block_ids", "metas", "remaining")

    def __init__(self, seq: SequenceKV, block_ids: list[int], metas: list[BlockMeta], remaining: int) -> None:
        self.seq = seq
        self.block_ids = block_ids
        self.metas = metas
        self.remaining = remaining


class KVCacheManager:
    """GPU pool + optional CPU tier + events (module docstring)."""

    def __init__(
        self, config: KVCacheConfig, pool_store: PoolStore | None = None, pool_io_threads: bool | None = None
    ) -> None:
        """Build empty pools from ``config``.

        Args:
            config: sizes and policies.
            pool_store: the shared pool's store (default: built from ``config.pool``, if set).
            pool_io_threads: pool reads and puts on background threads (module docstring); ``None``: for a
                Mooncake store built here from ``config.pool`` (``PoolConfig.io``), not for one passed in.
        """
        self.config = config
        self.block_size = config.block_size
        self._events: list[KVEvent] = []
        if pool_io_threads is None:
            pool_io_threads = (
                pool_store is None
                and config.pool is not None
                and config.pool.backend == "mooncake"
                and config.pool.io == "threads"
            )
        built_store = pool_store is None and config.pool is not None
        if pool_store is None and config.pool is not None:
            pool_store = build_pool_store(config.pool, self._on_pool_evict)
        self.groups = HybridGroups(
            config.groups,
            config.checkpoints,
            config.block_size,
            config.num_gpu_blocks,
            self._emit,
            pool_store if config.pool is None or config.pool.store_policy != "none" else None,
        )
        self.gpu = BlockPool(
            config.num_gpu_blocks, config.block_size, self._emit_main if self.groups.is_hybrid else self._emit
        )
        self.cpu: CpuTier | None = (
            CpuTier(config.num_cpu_blocks, config.block_size, self._emit, self.gpu.holds_all)
            if config.num_cpu_blocks > 0
            else None
        )
        self._store_policy = config.cpu_store_policy if self.cpu is not None else "none"
        self.pool: PoolTier | None = None
        if pool_store is not None:
            try:  # attaching checks the pool's layout (workers.kv.pool_layout): PoolLayoutError, a ConfigError
                self.pool = PoolTier(
                    pool_store,
                    config.block_size,
                    self._emit,
                    self.gpu.holds_all,
                    value_bytes_per_block=config.pool.value_bytes_per_block if config.pool is not None else 0,
                    num_layer_groups=config.pool.num_layer_groups if config.pool is not None else 1,
                    check_padding=config.pool is None or config.pool.verify == "all_bytes",
                    blocks_per_span=config.pool.blocks_per_span if config.pool is not None else 16,
                    io_threads=pool_io_threads,
                    num_read_threads=config.pool.read_threads if config.pool is not None else 1,
                    lease_ttl_s=config.pool.lease_ttl_s if config.pool is not None else MOONCAKE_DEFAULT_LEASE_TTL_S)
            except ConfigError:
                if built_store:
                    pool_store.close()
                raise
        self._pool_policy = (config.pool.store_policy if config.pool is not None else "all") if self.pool else "none"
        self._pending_pool_stores: list[BlockCopy] = []
        self._pending_pool_restores: list[BlockCopy] = []
        self._pool_store_jobs: set[int] = set()
        self._next_job_id = 0
        self._pending_stores: list[BlockCopy] = []
        self._pending_restores: list[BlockCopy] = []
        self._restore_jobs: dict[int, _RestoreJob] = {}
        self._reads: dict[int, PoolFetch] = {}
        """Pool reads in flight (module docstring), by the restore job id standing for each."""
        self.num_restored_blocks = 0
        self.num_short_reads = 0
        """Pool reads that found fewer blocks than the lookup counted (evicted or corrupt in between): the hit was
        shortened, at admission for an inline read, after it for one off the step."""

    # events and copies -------------------------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (the list is swapped out, not copied)."""
        events = self._events
        self._events = []
        return events

    def _emit(self, event: KVEvent) -> None:
        self._events.append(event)

    def _emit_main(self, event: KVEvent) -> None:
        """Group 0's GPU events of a hybrid model: stores name their kind, as vLLM annotates every group's."""
        if isinstance(event, BlockStored):
            event = msgspec.structs.replace(event, kv_cache_spec_kind=SpecKind.FULL_ATTENTION)
        self._events.append(event)

    def take_checkpoint_costs(self) -> CheckpointCosts:
        """Recurrent-state copies since the last call (``workers.kv.hybrid``), for the next engine step."""
        return self.groups.take_costs()

    def take_copies(self) -> tuple[tuple[BlockCopy, ...], tuple[BlockCopy, ...]]:
        """Store and restore jobs to issue in the next engine step: ``(stores, restores)``."""
        stores, restores = tuple(self._pending_stores), tuple(self._pending_restores)
        self._pending_stores.clear()
        self._pending_restores.clear()
        return stores, restores

    def take_pool_copies(self) -> tuple[tuple[BlockCopy, ...], tuple[BlockCopy, ...]]:
        """Shared pool store and restore jobs to issue in the next engine step: ``(pool_stores, pool_restores)``."""
        stores, restores = tuple(self._pending_pool_stores), tuple(self._pending_pool_restores)
        self._pending_pool_stores.clear()
        self._pending_pool_restores.clear()
        return stores, restores

    def has_pending_copies(self) -> bool:
        """Whether copy jobs wait to be issued (``take_copies``, ``take_pool_copies``)."""
        return bool(
            self._pending_stores or self._pending_restores or self._pending_pool_stores or self._pending_pool_restores
        )

    def _on_pool_evict(self, keys: list[str]) -> None:
        if self.pool is not None:
            self.pool.on_evict(keys)
        self.groups.on_pool_evict(keys)

    def _job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    # prefix lookup and allocation --------------------------------------------------------------------------

    def find_prefix(self, seq: SequenceKV, token_ids: Sequence[int], num_prompt_tokens: int) -> PrefixHit:
        """The usable cached prefix of ``token_ids`` (GPU first, then its continuation on CPU).

        Args:
            seq: the sequence (its hashes are extended to cover ``token_ids``).
            token_ids: all known tokens (prompt, plus outputs after a preemption).
            num_prompt_tokens: tokens that must be fed; the last one is never a hit.

        Returns:
            The hit, capped at ``max_cached_blocks(num_prompt_tokens)``.
        """
        hashes = extend_block_hashes(seq.block_hashes, seq.root, token_ids, self.block_size, self._payloads(seq))
        limit = min(len(hashes), max_cached_blocks(num_prompt_tokens, self.block_size))
        gpu_ids: list[int] = []
        for h in hashes[:limit]:
            b = self.gpu.get_cached_block(h)
            if b is None:
                break
            gpu_ids.append(b)
        num_cpu = 0
        if self.cpu is not None and len(gpu_ids) < limit:
            num_cpu = self.cpu.lookup(hashes[len(gpu_ids) : limit])
        num_pool = 0
        pool_objects: tuple[PoolObject, ...] = ()
        if self.pool is not None and len(gpu_ids) + num_cpu < limit:
            num_pool, pool_objects = self.pool.lookup(hashes, len(gpu_ids) + num_cpu, limit)
        if self.groups.is_hybrid:
            usable = self.groups.usable_blocks(hashes, len(gpu_ids) + num_cpu + num_pool)
            del gpu_ids[usable:]
            num_cpu = min(num_cpu, usable - len(gpu_ids))
            num_pool = min(num_pool, usable - len(gpu_ids) - num_cpu)
        return PrefixHit(
            gpu_block_ids=tuple(gpu_ids),
            num_cpu_blocks=num_cpu,
            block_size=self.block_size,
            num_pool_blocks=num_pool,
            token_ids=token_ids,
            pool_objects=pool_objects,
        )

    def _payloads(self, seq: SequenceKV) -> list[bytes] | None:  # packed for the pool tier's chunks alone
        return seq.block_payloads if self.pool is not None else None

    def find_gpu_prefix(self, seq: SequenceKV, token_ids: Sequence[int], num_prompt_tokens: int) -> tuple[int, ...]:
        """The GPU blocks of ``find_prefix``'s leading hit alone (no lower tier is asked), capped the same way."""
        hashes = extend_block_hashes(seq.block_hashes, seq.root, token_ids, self.block_size, self._payloads(seq))
        limit = min(len(hashes), max_cached_blocks(num_prompt_tokens, self.block_size))
        get = self.gpu.get_cached_block
        out: list[int] = []
        for h in hashes[:limit]:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return tuple(out)

    def admit(self, seq: SequenceKV, hit: PrefixHit, num_tokens: int) -> bool:
        """Give a new (or preempted) sequence its hit and blocks for its first ``num_tokens`` tokens.

        All or nothing: when the free blocks (not counting hit blocks that sit in the free queue) cannot cover
        the restore targets plus the new blocks, nothing changes and False is returned (the request waits).

        Args:
            seq: a sequence holding no blocks.
            hit: from ``find_prefix``.
            num_tokens: tokens the block table must cover (cached + the first chunk).

        Raises:
            KVCacheError: ``seq`` already holds blocks.
        """
        if seq.block_ids:
            raise KVCacheError(f"admit of {seq.request_id} which holds blocks")
        num_needed = max(0, -(-num_tokens // self.block_size) - len(hit.gpu_block_ids))
        if num_needed > self.gpu.num_free_blocks - self.gpu.num_free_among(hit.gpu_block_ids):
            return False
        hybrid = self.groups.is_hybrid
        if hybrid and not self.groups.can_admit(seq.block_hashes, hit.num_blocks, num_tokens):
            return False
        gpu_hit = hit.gpu_block_ids
        first = len(gpu_hit)
        num_cpu = hit.num_cpu_blocks
        num_restore = num_cpu + hit.num_pool_blocks
        metas = self._metas(seq, hit.token_ids, first, first + num_restore) if num_restore else []
        num_pool = hit.num_pool_blocks
        reading: PoolFetch | None = None
        if num_pool:
            assert self.pool is not None
            reading = self.pool.start_fetch(metas[num_cpu:], hit.pool_objects,
                                            seq.block_payloads[first + num_cpu : first + len(metas)])  # fmt: skip
            if hybrid or reading.done():  # else read off the step: the hit counts whole until the read says less
                num_pool = self.pool.finish_fetch(reading)
                reading = None
            if num_pool < hit.num_pool_blocks:
                self.num_short_reads += 1
                del metas[num_cpu + num_pool :]
                if hybrid:  # a shorter hit must still be one every group serves
                    usable = self.groups.usable_blocks(seq.block_hashes, first + num_cpu + num_pool)
                    gpu_hit = gpu_hit[:usable]
                    first = len(gpu_hit)
                    num_cpu = min(num_cpu, usable - first)
                    num_pool = min(num_pool, usable - first - num_cpu)
                    del metas[num_cpu + num_pool :]
                    num_needed = max(0, -(-num_tokens // self.block_size) - first)
        if hybrid:  # checkpoints only in the pool are read now too; one gone shortens the hit
            num_hit = first + num_cpu + num_pool
            usable = num_hit
            while not self.groups.fetch_checkpoints(seq.block_hashes, usable):
                usable = self.groups.usable_blocks(seq.block_hashes, usable - 1)
            if usable < num_hit:
                gpu_hit = gpu_hit[:usable]
                first = len(gpu_hit)
                num_cpu = min(num_cpu, usable - first)
                num_pool = min(num_pool, usable - first - num_cpu)
                del metas[num_cpu + num_pool :]
                num_needed = max(0, -(-num_tokens // self.block_size) - first)
        self.gpu.touch(gpu_hit)
        if self.pool is not None:  # the pool's copy of what GPU and CPU served was used too (``PoolTier.refresh``)
            self.pool.refresh(seq.block_hashes, first + num_cpu)
        seq.block_ids = [*gpu_hit, *self.gpu.allocate(num_needed)]
        seq.num_cached_blocks = first + num_cpu + num_pool
        seq.is_freed = False
        if hybrid:
            num_hit = seq.num_cached_blocks
            last = self._metas(seq, hit.token_ids, num_hit - 1, num_hit)[0] if num_hit else None
            self.groups.admit(seq.request_id, seq.block_hashes, num_hit, num_tokens, last)
        if not metas:
            return True
        jobs = (1 if num_cpu else 0) + (1 if num_pool else 0) + (1 if reading is not None else 0)
        record = _RestoreJob(seq, seq.block_ids[first : first + len(metas)], metas, jobs)
        job_ids: list[int] = []
        if num_cpu:
            assert self.cpu is not None
            hashes = seq.block_hashes[first : first + num_cpu]
            slots = self.cpu.pin(hashes)
            seq.cpu_pinned = list(hashes)
            job_id = self._job_id()
            self._restore_jobs[job_id] = record
            self._pending_restores.append(BlockCopy(job_id, tuple(slots), tuple(record.block_ids[: len(slots)])))
            job_ids.append(job_id)
        if num_pool:
            job_id = self._job_id()
            self._restore_jobs[job_id] = record
            self._pending_pool_restores.append(BlockCopy(job_id, (), tuple(record.block_ids[num_cpu:])))
            job_ids.append(job_id)
        if reading is not None:
            job_id = self._job_id()
            self._restore_jobs[job_id] = record
            self._reads[job_id] = reading
            job_ids.append(job_id)
        seq.restore_job_id = job_ids[0]
        seq.restore_job_ids = tuple(job_ids)
        return True

    def _metas(self, seq: SequenceKV, token_ids: Sequence[int], start: int, end: int) -> list[BlockMeta]:
        """Metas of ``seq``'s blocks ``start .. end - 1`` (hashes already computed)."""
        bs = self.block_size
        hashes = seq.block_hashes
        return [
            BlockMeta(
                block_hash=hashes[i],
                parent_block_hash=hashes[i - 1] if i else None,
                token_ids=tuple(token_ids[i * bs : (i + 1) * bs]),
                depth=i,
                lora_name=seq.lora_name,
                cache_salt=seq.cache_salt,
                engine_hash=to_engine_hash(hashes[i]),
            )
            for i in range(start, end)
        ]

    def allocate_slots(self, seq: SequenceKV, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to cover ``num_tokens`` tokens.

        Returns:
            False (nothing allocated) when the free queue is too short; the scheduler then preempts.
        """
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if num_needed <= 0:
            return True
        if num_needed > self.gpu.num_free_blocks:
            return False
        if self.groups.is_hybrid:
            if not self.groups.can_grow(seq.request_id, num_tokens):
                return False
            self.groups.grow(seq.request_id, num_tokens)
        seq.block_ids.extend(self.gpu.allocate(num_needed))
        return True

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` could be allocated now."""
        return num_blocks <= self.gpu.num_free_blocks

    def cache_computed(
        self, seq: SequenceKV, token_ids: Sequence[int], num_computed_tokens: int, num_prompt_tokens: int
    ) -> tuple[int, ...]:
        """Register the full blocks computed so far and issue write-through stores for them.

        Args:
            seq: the sequence.
            token_ids: all known tokens of the sequence.
            num_computed_tokens: tokens whose KV is now in ``seq.block_ids``.
            num_prompt_tokens: prompt length (for the ``prompt_only`` store policy).

        Returns:
            The ids of the store jobs issued (CPU tier, shared pool); they read ``seq``'s blocks until they land.
        """
        extend_block_hashes(seq.block_hashes, seq.root, token_ids, self.block_size, self._payloads(seq))
        end = min(num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.block_ids))
        start = seq.num_cached_blocks
        if end <= start:
            return ()
        bs = self.block_size
        metas = self._metas(seq, token_ids, start, end)
        self.gpu.cache_blocks(seq.block_ids[start:end], metas)
        seq.num_cached_blocks = end
        if self.groups.is_hybrid:
            self.groups.cache_computed(seq.request_id, metas, num_computed_tokens, num_prompt_tokens)
        job_ids: list[int] = []
        if self._store_policy != "none":
            cpu_metas = metas
            if self._store_policy == "prompt_only":
                cpu_metas = metas[: max(0, num_prompt_tokens // bs - start)]
            if cpu_metas:
                job_id = self._store(seq.block_ids, start, seq.block_hashes[start : start + len(cpu_metas)], cpu_metas)
                if job_id is not None:
                    job_ids.append(job_id)
        if self._pool_policy != "none":
            if self._pool_policy == "prompt_only":
                metas = metas[: max(0, num_prompt_tokens // bs - start)]
            if metas:
                job_id = self._pool_store(seq, token_ids, start, metas)
                if job_id is not None:
                    job_ids.append(job_id)
        return tuple(job_ids)

    def _pool_store(self, seq: SequenceKV, token_ids: Sequence[int], start: int, metas: list[BlockMeta]) -> int | None:
        """One write-through job to the shared pool (``PoolTier``) for ``metas`` (``seq``'s blocks from ``start``),
        widened back to the start of their span (``PoolTier.span_start``: a span this job completes is written
        whole, its earlier members copied again); its id, or ``None`` when nothing to write."""
        assert self.pool is not None
        first = self.pool.span_start(start)
        if first < start:
            metas = [*self._metas(seq, token_ids, first, start), *metas]
        job_id = self._job_id()
        hashes = seq.block_hashes[first : first + len(metas)]
        payloads = seq.block_payloads[first : first + len(metas)]
        chosen = self.pool.prepare_store(job_id, hashes, metas, start - first, payloads)
        if not chosen:
            return None
        self._pool_store_jobs.add(job_id)
        block_ids = seq.block_ids
        self._pending_pool_stores.append(BlockCopy(job_id, tuple(block_ids[first + i] for i in chosen), ()))
        return job_id

    def _store(
        self, block_ids: list[int], start: int, hashes: list[BlockHash], metas: list[BlockMeta]
    ) -> int | None:
        """One write-through store job for ``metas`` (held by ``block_ids[start:]``), batched (``CpuTier``); its
        id, or ``None`` when every block is already stored or being stored."""
        assert self.cpu is not None
        job_id = self._job_id()
        chosen, slots = self.cpu.prepare_store(job_id, hashes, metas)
        if not slots:
            return None
        if chosen is None:
            src = tuple(block_ids[start : start + len(slots)])
        else:
            src = tuple(block_ids[start + i] for i in chosen)
        self._pending_stores.append(BlockCopy(job_id, src, tuple(slots)))
        return job_id

    def free(self, seq: SequenceKV) -> None:
        """Drop ``seq``'s references, tail block first (so its tail is evicted first), and its own CPU pins.

        A sequence whose restore is in flight keeps its blocks until ``complete_restore``. Idempotent.
        """
        if seq.is_freed:
            return
        seq.is_freed = True
        if self.groups.is_hybrid:
            self.groups.free(seq.request_id)
        if seq.restore_job_id is not None:
            return
        self._release(seq)

    def _release(self, seq: SequenceKV) -> None:
        self.gpu.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_cached_blocks = 0
        if seq.cpu_pinned:
            assert self.cpu is not None
            self.cpu.unpin(seq.cpu_pinned)
            seq.cpu_pinned = []

    def end_turn(self, seq: SequenceKV) -> None:
        """The request finished (stop or length, not an abort): take its generation-end checkpoints
        (``workers.kv.hybrid``) before ``free``."""
        if self.groups.is_hybrid and not seq.is_freed:
            self.groups.end_turn(seq.request_id)

    def complete_store(self, job_id: int) -> None:
        """A store job landed (see ``CpuTier.complete_store``, ``PoolTier.complete_store``)."""
        if job_id in self._pool_store_jobs:
            self._pool_store_jobs.discard(job_id)
            assert self.pool is not None
            self.pool.complete_store(job_id)
            return
        if self.cpu is None:
            raise KVCacheError(f"store job {job_id} without a CPU tier")
        self.cpu.complete_store(job_id)

    def take_finished_reads(self) -> list[int]:
        """Pool reads in flight that have finished (module docstring): apply each (a short one shortens its
        sequence's hit) and return their restore job ids, for ``complete_restore``. Also announces the pool puts
        that have landed (``PoolTier.poll_stores``)."""
        if self.pool is None:
            return []
        self.pool.poll_stores()
        if not self._reads:
            return []
        done = [job_id for job_id, reading in self._reads.items() if reading.done()]
        for job_id in done:
            reading = self._reads.pop(job_id)
            n = self.pool.finish_fetch(reading)
            missing = len(reading.metas) - n
            if missing:
                self.num_short_reads += 1
                job = self._restore_jobs[job_id]
                keep = len(job.metas) - missing
                del job.metas[keep:]
                del job.block_ids[keep:]
                job.seq.num_cached_blocks -= missing
        return done

    def has_io_in_flight(self) -> bool:
        """Whether pool reads or puts run on the I/O threads (``take_finished_reads`` has results to apply)."""
        return bool(self._reads) or (self.pool is not None and self.pool.num_io_in_flight > 0)

    def set_io_waker(self, wake: Callable[[], None] | None) -> None:
        """``wake`` is called from an I/O thread when a pool read or put finishes (the engine loop's wake-up)."""
        if self.pool is not None:
            self.pool.wake = wake

    def close(self) -> None:
        """Let the pool's I/O threads finish and stop them."""
        if self.pool is not None:
            self.pool.close()

    def complete_restore(self, job_id: int) -> SequenceKV | None:
        """A restore job landed; once all jobs of the sequence's restore did, register its blocks on GPU
        (``BlockStored`` GPU) and unpin the CPU sources.

        Returns:
            The sequence it belongs to (now runnable, unless it was freed meanwhile: then its blocks are
            released here); ``None`` while other jobs of the same restore are in flight.

        Raises:
            KVCacheError: an unknown job.
        """
        job = self._restore_jobs.pop(job_id, None)
        if job is None:
            raise KVCacheError(f"unknown restore job {job_id}")
        job.remaining -= 1
        if job.remaining > 0:
            return None
        seq = job.seq
        self.gpu.cache_blocks(job.block_ids, job.metas)
        self.num_restored_blocks += len(job.block_ids)
        seq.restore_job_id = None
        seq.restore_job_ids = ()
        if seq.cpu_pinned:
            assert self.cpu is not None
            self.cpu.unpin(seq.cpu_pinned)
            seq.cpu_pinned = []
        if seq.is_freed:
            self._release(seq)
        return seq

    # maintenance ---------------------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block on every tier and emit ``AllBlocksCleared``.

        Returns:
            False (nothing changed) while any GPU block is in use, as vLLM does.
        """
        if self.gpu.num_free_blocks != self.gpu.num_blocks or not self.groups.reset():
            return False
        self.gpu.reset()
        if self.cpu is not None:
            self.cpu.reset()
        if self.pool is not None:
            self.pool.reset()
        self._events.append(AllBlocksCleared())
        return True

    def snapshot_events(self) -> list[KVEvent]:
        """The current cache as KV events, in an order an empty gateway index resolves (``workers.kv.snapshot``)."""
        return snapshot_events(self.gpu, self.cpu, self.pool, self.groups, self.block_size)

    def free_blocks_by_medium(self) -> dict[str, int]:
        """Free blocks per tier (GPU: ref_cnt 0, cached or not; CPU: empty slots plus stored entries, which are
        evicted on demand; the shared pool's figures come from ``PoolTier.block_counts``)."""
        out = {Medium.GPU.value: self.gpu.num_free_blocks}
        if self.cpu is not None:
            out[Medium.CPU.value] = self.cpu.num_free_blocks + self.cpu.num_stored_blocks
        return out
