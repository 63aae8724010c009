"""The shared pool tier (``Medium.MOONCAKE``): below the CPU tier, shared by every worker attached to it.

Blocks are written through from the GPU (like the CPU tier, under ``pool-store-policy``) and restored from the
pool into GPU blocks reserved for them. The pool is keyed by the worker's collision-resistant block hash
(SHA-256 chain rooted in the namespace, ``workers.kv.hashing``)::

    key(block) = "kvgate/v1/" + hex(block_hash)

so a block stored by one worker is found and restored by any other worker attached to the same pool.

The store seam (``PoolStore``) has two implementations:

* ``SimPoolClient`` over a ``SimPool``: an in-process dict shared by every worker of the process that names the
  same pool (``sim_pool(name)``), with a block capacity and LRU eviction. It reports its evictions to the
  worker that stored each block, which publishes ``BlockRemoved`` (MOONCAKE). This is what tests and
  single-process fleets use: no sockets, no shared memory. Every attached worker hears every eviction; each
  publishes ``BlockRemoved`` for the keys it announced or listed in its snapshot.
* ``MooncakePoolStore``: a real Mooncake Store client (``mooncake.store.MooncakeDistributedStore``, optional
  extra ``mooncake``) talking to a ``mooncake_master``. Mooncake evicts on its own and does not tell clients,
  so no ``BlockRemoved`` is published for it; a lease taken by the lookup (``batch_is_exist``) keeps blocks
  readable until the restore fetches them.

Values: the sim engine has no KV bytes, so a block's value is its token ids (little-endian u32); a restore
checks them against the tokens it expects (a mismatch is a miss). A GPU engine would put the KV bytes.

Store rules (as the CPU tier): a block whose store is in flight from this worker is skipped (rule 1); a block
already in the pool, stored by any worker, is skipped (rule 2); a store once scheduled completes even if the
GPU copy is evicted meanwhile: its value is taken when the job is prepared (rule 3). A completed store emits
one ``BlockStored`` (MOONCAKE) per job, token-less when all its blocks are still in the GPU prefix index (else
with parent and tokens). Puts are best effort (a full pool refuses them): only blocks put are announced.

Snapshot (``snapshot_metas``): the blocks this worker stored and announced, plus the pool blocks it read for a
restore (at most ``max_known_fetched`` of them, least recently read dropped first), so that a cold gateway index
fed the worker's snapshot resolves every announced block's parent chain (a block another worker stored is
reachable through the pool by every member, so announcing it here predicts the same hits).

Restores: ``fetch`` reads the blocks into host memory when the request is admitted (its GPU targets are
reserved then), so a pool eviction after admission cannot break the restore; blocks it cannot read shorten
the hit (they are computed instead).
"""

from __future__ import annotations

import functools
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from events.types import BlockRemoved, EngineBlockHash, KVEvent, Medium
from workers.config import PoolConfig
from workers.errors import ConfigError, KVCacheError
from workers.kv.block_pool import BlockMeta, emit_tier_stored, engine_hash_of
from workers.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvgate/v1/"


def pool_key(block_hash: BlockHash) -> str:
    """The pool key of a block (module docstring)."""
    return KEY_PREFIX + block_hash.hex()


def block_value(token_ids: Sequence[int], size_bytes: int = 0) -> bytes:
    """A block's value in the sim engine: its token ids as little-endian u32, padded with zeros to
    ``size_bytes`` (``PoolConfig.value_bytes_per_block``; never cut)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids).ljust(size_bytes, b"\0")


@functools.lru_cache(maxsize=8)
def _zeros(num_bytes: int) -> bytes:
    return bytes(num_bytes)


def is_block_value(value: bytes, token_ids: Sequence[int], size_bytes: int = 0) -> bool:
    """Whether ``value`` is ``block_value(token_ids, size_bytes)``, compared in place (memcmp of the token ids and
    of the padding against a cached run of zeros; no padded copy is built)."""
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    n = len(packed)
    if len(value) != max(n, size_bytes) or not value.startswith(packed):
        return False
    return n >= size_bytes or value.endswith(_zeros(size_bytes - n))


class PoolStore(Protocol):
    """A shared key -> bytes block store (the seam)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (and readable)."""
        ...

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store values (best effort; an existing key keeps its value); whether each key is stored now."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, ``None`` when missing."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...

    def num_blocks(self) -> tuple[int, int] | None:
        """``(used, capacity)`` of the whole pool in blocks, or ``None`` where the store does not say."""
        ...


class SimPool:
    """An in-process pool shared by the workers of one process (module docstring)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._data: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._listeners: dict[int, Callable[[list[str]], None]] = {}
        """Every attached client's eviction callback: each gets every evicted key (a worker forgets what it knew)."""
        self._next_client = 0
        self.num_evicted = 0

    def attach(self, on_evict: Callable[[list[str]], None] | None = None) -> SimPoolClient:
        """A client for one worker; ``on_evict`` gets every key the pool evicts (the worker keeps what it knew)."""
        self._next_client += 1
        if on_evict is not None:
            self._listeners[self._next_client] = on_evict
        return SimPoolClient(self, self._next_client)

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list[str]:
        """Stored keys, evicted-next first."""
        return list(self._data)


class SimPoolClient:
    """``PoolStore`` over a ``SimPool``."""

    def __init__(self, pool: SimPool, client_id: int) -> None:
        self.pool = pool
        self.client_id = client_id

    def exists(self, keys: Sequence[str]) -> list[bool]:
        data = self.pool._data
        return [k in data for k in keys]

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        pool = self.pool
        data = pool._data
        evicted: dict[int, list[str]] = {}
        for k, v in zip(keys, values, strict=True):
            if k in data:
                continue
            while len(data) >= pool.capacity_blocks:
                old, (_v, owner) = data.popitem(last=False)
                evicted.setdefault(owner, []).append(old)
                pool.num_evicted += 1
            data[k] = (v, self.client_id)
        if evicted:
            gone = [k for keys_of_owner in evicted.values() for k in keys_of_owner]
            for listener in list(pool._listeners.values()):
                listener(gone)
        return [True] * len(keys)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        data = self.pool._data
        out: list[bytes | None] = []
        for k in keys:
            item = data.get(k)
            if item is not None:
                data.move_to_end(k)
            out.append(None if item is None else item[0])
        return out

    def close(self) -> None:
        self.pool._listeners.pop(self.client_id, None)

    def num_blocks(self) -> tuple[int, int] | None:
        return len(self.pool._data), self.pool.capacity_blocks


_SIM_POOLS: dict[str, SimPool] = {}


def sim_pool(name: str, capacity_blocks: int) -> SimPool:
    """The process-wide sim pool called ``name`` (created with ``capacity_blocks`` on first use)."""
    pool = _SIM_POOLS.get(name)
    if pool is None:
        pool = _SIM_POOLS[name] = SimPool(capacity_blocks)
    return pool


class MooncakePoolStore:
    """``PoolStore`` over a Mooncake Store client (needs the ``mooncake`` extra and a reachable master)."""

    def __init__(
        self,
        master_address: str,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        protocol: str = "tcp",
    ) -> None:
        """Connect (``setup``); blocks while the master is unreachable, so callers probe it first.

        Raises:
            ConfigError: the package is missing or ``setup`` fails.
        """
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the optional extra
            raise ConfigError(f"pool backend 'mooncake' needs the mooncake extra: {exc}") from exc
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, "", master_address
        )
        if rc != 0:
            raise ConfigError(f"mooncake setup against {master_address} failed: {rc}")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [r == 1 for r in self._store.batch_is_exist(list(keys))]

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        if self._store.put_batch(list(keys), list(values)) == 0:
            return [True] * len(keys)
        return [self._store.put(k, v) == 0 for k, v in zip(keys, values, strict=True)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return [v if v else None for v in self._store.get_batch(list(keys))]

    def close(self) -> None:
        self._store.close()

    def num_blocks(self) -> tuple[int, int] | None:
        return None  # values of any size share Mooncake segments: no block count to report


def build_pool_store(config: PoolConfig, on_evict: Callable[[list[str]], None] | None = None) -> PoolStore:
    """The store ``config`` names: a client of the process's sim pool ``config.name``, or a Mooncake client.

    Raises:
        ConfigError: ``mooncake`` without the package or without a reachable master.
    """
    if config.backend == "sim":
        return sim_pool(config.name, config.capacity_blocks).attach(on_evict)
    return MooncakePoolStore(
        config.master_address,
        config.metadata_server,
        config.local_hostname,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
    )


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
    ) -> None:
        """Wrap ``store``; events go to ``emit``; ``on_gpu`` picks the store event's shape; ``max_known_fetched``
        bounds the fetched blocks kept for snapshots; values are padded to ``value_bytes_per_block`` (module
        docstring)."""
        self.store = store
        self.block_size = block_size
        self._emit = emit
        self._on_gpu = on_gpu
        self._in_flight: set[BlockHash] = set()
        self._jobs: dict[int, tuple[list[BlockHash], list[BlockMeta], list[bytes]]] = {}
        self._stored_here: dict[str, BlockMeta] = {}
        self._fetched: OrderedDict[str, BlockMeta] = OrderedDict()
        self._max_known_fetched = max_known_fetched
        self.value_bytes_per_block = value_bytes_per_block
        self.num_stores_skipped_in_flight = 0
        self.num_stores_skipped_stored = 0
        self.num_stores_failed = 0
        self.num_blocks_stored = 0
        self.num_blocks_fetched = 0
        self.num_fetch_mismatches = 0

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
        """How many of ``block_hashes``, from the first, are in the pool."""
        n = 0
        for ok in self.store.exists([pool_key(h) for h in block_hashes]):
            if not ok:
                break
            n += 1
        return n

    def prepare_store(self, job_id: int, hashes: list[BlockHash], metas: Sequence[BlockMeta]) -> list[int]:
        """Choose the blocks to store (rules 1 and 2) and snapshot their values (rule 3).

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
            size = self.value_bytes_per_block
            self._jobs[job_id] = (job_hashes, job_metas, [block_value(m.token_ids, size) for m in job_metas])
        return chosen

    def complete_store(self, job_id: int) -> None:
        """The copy of ``job_id`` landed: put the blocks, announce those stored (``BlockStored`` MOONCAKE).

        Raises:
            KVCacheError: an unknown job.
        """
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise KVCacheError(f"unknown pool store job {job_id}")
        hashes, metas, values = job
        self._in_flight.difference_update(hashes)
        keys = [pool_key(h) for h in hashes]
        ok = self.store.put(keys, values)
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
        """Read blocks for a restore (into host memory); returns how many, from the first, were read intact."""
        values = self.store.get([pool_key(m.block_hash) for m in metas])
        n = 0
        for meta, value in zip(metas, values, strict=True):
            if value is None:
                break
            if not is_block_value(value, meta.token_ids, self.value_bytes_per_block):
                self.num_fetch_mismatches += 1  # bytes that are not the block's: never restored
                logger.warning("pool block %s read back with other bytes; computed instead", meta.block_hash.hex())
                break
            n += 1
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
