"""The shared pool's store seam (``PoolStore``) and its two implementations.

* ``SimPoolClient`` over a ``SimPool``: an in-process dict shared by every worker of the process that names the
  same pool (``sim_pool(name)``), with a block capacity (a span object counts its members,
  ``common.pool_keys.key_num_blocks``) and LRU eviction of whole objects, as Mooncake evicts. It
  reports its evictions to every attached worker, which publishes ``BlockRemoved`` (MOONCAKE) for the keys it
  announced. Tests and single-process fleets use it: no sockets, no shared memory.
* ``MooncakePoolStore``: a Mooncake Store client (``mooncake.store.MooncakeDistributedStore``, optional extra
  ``mooncake``) talking to a ``mooncake_master``. Chunks move by pointer from registered host buffers
  (``batch_put_from`` / ``batch_get_into``, the client's zero-copy batch calls). Mooncake evicts on its own and
  tells no client; a lease taken by a lookup (``batch_is_exist``) keeps objects readable until the restore reads
  them. A call that fails (master down or restarting, segment gone) reads as "not stored": puts are best effort,
  a failed read is a miss, and the client keeps working once the master is back (it remounts its segment).
  Outages: once the master is gone, the client's calls block for seconds each (it retries its RPCs: about 4 s
  for ``batch_is_exist``, 9 s for a put, measured on loopback), so after a failed call the store probes the
  master's RPC port (a TCP connect, ``probe_timeout_s``); while the probe fails, every call answers at once as
  "not stored" (``num_skipped_calls``) and the port is probed again every ``probe_interval_s``.

Return codes of the Mooncake calls are its ``ErrorCode`` values (``mooncake-store/include/types.h``): 0 or a
byte count for success, negative for errors (-704 ``OBJECT_NOT_FOUND``, -200 ``NO_AVAILABLE_HANDLE`` when the
pool is full, -800 ``TRANSFER_FAIL``...).
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from common.pool_keys import key_num_blocks
from workers.config import PoolConfig
from workers.errors import ConfigError
from workers.kv.pool_chunk import HostBuffer

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704


class PoolStore(Protocol):
    """A shared key -> bytes object store (the seam). Objects are immutable: a put of an existing key keeps the
    stored value."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (and readable)."""
        ...

    def put(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        """Store values (best effort; an existing key keeps its value); whether each key is stored now."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, ``None`` when missing."""
        ...

    def new_buffer(self, num_bytes: int) -> HostBuffer:
        """A zero-filled host buffer the store reads from and writes into directly (``put_from``/``get_into``)."""
        ...

    def release_buffer(self, buffer: HostBuffer) -> None:
        """Give back a buffer from ``new_buffer`` (never used again)."""
        ...

    def put_from(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """Store ``buffer.view[offsets[i] : offsets[i] + sizes[i]]`` under ``keys[i]`` (best effort, as ``put``)."""
        ...

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Read each key's value into ``buffer.view[offsets[i]:]`` (at most ``sizes[i]`` bytes); the bytes read
        per key, negative when missing or unreadable."""
        ...

    def remove(self, keys: Sequence[str]) -> None:
        """Drop objects (best effort; a chunk found corrupt)."""
        ...

    def put_marker(self, key: str, value: bytes) -> bytes | None:
        """Store a small marker object unless ``key`` holds one already, never evicted (``workers.kv.pool_layout``);
        the value the pool holds under ``key`` then, ``None`` when the pool did not answer."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...

    def num_blocks(self) -> tuple[int, int] | None:
        """``(used, capacity)`` of the whole pool in blocks, or ``None`` where the store does not say."""
        ...


class SimPool:
    """An in-process pool shared by the workers of one process (module docstring); evicts least recently used
    objects first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._data: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self.num_used_blocks = 0
        """Blocks the stored objects hold (``key_num_blocks`` each), at most ``capacity_blocks``."""
        self._listeners: dict[int, Callable[[list[str]], None]] = {}
        """Every attached client's eviction callback: each gets every evicted key (a worker forgets what it knew)."""
        self._next_client = 0
        self.num_evicted = 0
        self.markers: dict[str, bytes] = {}
        """Marker objects (``PoolStore.put_marker``): kept apart from the blocks, never evicted, no capacity."""

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

    def evict(self, keys: Sequence[str]) -> None:
        """Evict ``keys`` now, as the pool's own LRU would (tests: one object gone, every worker told)."""
        self.num_evicted += len(self.drop(keys))

    def drop(self, keys: Sequence[str]) -> list[str]:
        """Remove ``keys`` and tell every attached worker (as an eviction); the keys that were stored."""
        gone = [k for k in keys if self._data.pop(k, None) is not None]
        self.num_used_blocks -= sum(map(key_num_blocks, gone))
        if gone:
            for listener in list(self._listeners.values()):
                listener(gone)
        return gone


class SimPoolClient:
    """``PoolStore`` over a ``SimPool``."""

    def __init__(self, pool: SimPool, client_id: int) -> None:
        self.pool = pool
        self.client_id = client_id

    def exists(self, keys: Sequence[str]) -> list[bool]:
        data = self.pool._data
        return [k in data for k in keys]

    def put(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        pool = self.pool
        data = pool._data
        gone: list[str] = []
        ok = [True] * len(keys)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k in data:
                continue
            weight = key_num_blocks(k)
            if weight > pool.capacity_blocks:  # larger than the whole pool: refused, as a full Mooncake refuses
                ok[i] = False
                continue
            while pool.num_used_blocks + weight > pool.capacity_blocks:
                old, _ = data.popitem(last=False)
                gone.append(old)
                pool.num_used_blocks -= key_num_blocks(old)
                pool.num_evicted += 1
            data[k] = (bytes(v), self.client_id)
            pool.num_used_blocks += weight
        if gone:
            for listener in list(pool._listeners.values()):
                listener(gone)
        return ok

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        data = self.pool._data
        out: list[bytes | None] = []
        for k in keys:
            item = data.get(k)
            if item is not None:
                data.move_to_end(k)
            out.append(None if item is None else item[0])
        return out

    def new_buffer(self, num_bytes: int) -> HostBuffer:
        return HostBuffer(num_bytes)

    def release_buffer(self, buffer: HostBuffer) -> None:
        pass

    def put_from(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        view = buffer.view
        return self.put(keys, [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)])  # put copies each

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        view = buffer.view
        out: list[int] = []
        for value, o, size in zip(self.get(keys), offsets, sizes, strict=True):
            if value is None or len(value) > size:
                out.append(OBJECT_NOT_FOUND if value is None else -1)
                continue
            view[o : o + len(value)] = value
            out.append(len(value))
        return out

    def remove(self, keys: Sequence[str]) -> None:
        self.pool.drop(keys)

    def put_marker(self, key: str, value: bytes) -> bytes | None:
        return self.pool.markers.setdefault(key, bytes(value))

    def close(self) -> None:
        self.pool._listeners.pop(self.client_id, None)

    def num_blocks(self) -> tuple[int, int] | None:
        return self.pool.num_used_blocks, self.pool.capacity_blocks


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
        probe_timeout_s: float = 0.2,
        probe_interval_s: float = 0.5,
    ) -> None:
        """Connect (``setup``); blocks while the master is unreachable (about 90 s), so callers probe it first.

        Raises:
            ConfigError: the package is missing or ``setup`` fails.
        """
        host, _, port = master_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"mooncake master address {master_address!r} is not host:port")
        self._master = (host, int(port))
        self._probe_timeout_s = probe_timeout_s
        self._probe_interval_s = probe_interval_s
        self._down_since: float | None = None
        self._next_probe_s = 0.0
        self.num_skipped_calls = 0
        """Calls answered at once as "not stored" while the master was unreachable."""
        self.num_outages = 0
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the optional extra
            raise ConfigError(f"pool backend 'mooncake' needs the mooncake extra: {exc}") from exc
        self.master_address = master_address
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, "", master_address
        )
        if rc != 0:
            raise ConfigError(f"mooncake setup against {master_address} failed: {rc}")
        self.num_failed_calls = 0
        """Calls that raised (translated to "not stored" / "missing")."""

    def _failed(self, call: str, exc: Exception | None = None) -> None:
        """A call failed (raised, or returned RPC errors): probe the master, maybe mark it down."""
        if exc is not None:
            self.num_failed_calls += 1
            logger.warning("mooncake %s against %s failed: %s", call, self.master_address, exc)
        if self._down_since is None and not self._probe():
            self._down_since = time.monotonic()
            self._next_probe_s = self._down_since + self._probe_interval_s
            self.num_outages += 1
            logger.warning("mooncake master %s unreachable: pool calls skipped until it answers", self.master_address)

    def _probe(self) -> bool:
        try:
            socket.create_connection(self._master, timeout=self._probe_timeout_s).close()
        except OSError:
            return False
        return True

    def is_usable(self) -> bool:
        """Whether calls go to the master now (not during an outage, between probes)."""
        if self._down_since is None:
            return True
        now = time.monotonic()
        if now >= self._next_probe_s:
            if self._probe():
                logger.info("mooncake master %s answers again after %.1f s", self.master_address,
                            now - self._down_since)  # fmt: skip
                self._down_since = None
                return True
            self._next_probe_s = now + self._probe_interval_s
        self.num_skipped_calls += 1
        return False

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        if not self.is_usable():
            return [False] * len(keys)
        try:
            codes = self._store.batch_is_exist(list(keys))
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeError and others
            self._failed("batch_is_exist", exc)
            return [False] * len(keys)
        if any(c < 0 for c in codes):
            self._failed("batch_is_exist")
        return [r == 1 for r in codes]

    def put(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        if not keys:
            return []
        if not self.is_usable():
            return [False] * len(keys)
        try:
            if self._store.put_batch(list(keys), list(values)) == 0:
                return [True] * len(keys)
            self._failed("put_batch")
            if self._down_since is not None:
                return [False] * len(keys)
            return [self._store.put(k, v) == 0 for k, v in zip(keys, values, strict=True)]
        except Exception as exc:  # noqa: BLE001
            self._failed("put_batch", exc)
            return [False] * len(keys)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        if not self.is_usable():
            return [None] * len(keys)
        try:
            return [v if v else None for v in self._store.get_batch(list(keys))]
        except Exception as exc:  # noqa: BLE001
            self._failed("get_batch", exc)
            return [None] * len(keys)

    def new_buffer(self, num_bytes: int) -> HostBuffer:
        buffer = HostBuffer(num_bytes)
        rc = self._store.register_buffer(buffer.address, num_bytes)
        if rc != 0:
            raise ConfigError(f"mooncake register_buffer of {num_bytes} bytes failed: {rc}")
        return buffer

    def release_buffer(self, buffer: HostBuffer) -> None:
        self._store.unregister_buffer(buffer.address)

    def put_from(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        if not keys:
            return []
        if not self.is_usable():
            return [False] * len(keys)
        base = buffer.address
        try:
            codes = self._store.batch_put_from(list(keys), [base + o for o in offsets], list(sizes))
        except Exception as exc:  # noqa: BLE001
            self._failed("batch_put_from", exc)
            return [False] * len(keys)
        if any(codes):
            self._failed("batch_put_from")  # a full pool too (-200): the probe tells them apart
        return [c == 0 for c in codes]

    def get_into(
        self, keys: Sequence[str], buffer: HostBuffer, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        if not keys:
            return []
        if not self.is_usable():
            return [-1] * len(keys)
        base = buffer.address
        try:
            got = list(self._store.batch_get_into(list(keys), [base + o for o in offsets], list(sizes)))
        except Exception as exc:  # noqa: BLE001
            self._failed("batch_get_into", exc)
            return [-1] * len(keys)
        if any(n < 0 and n != OBJECT_NOT_FOUND for n in got):
            self._failed("batch_get_into")
        return got

    def remove(self, keys: Sequence[str]) -> None:
        if keys and self.is_usable():
            try:
                self._store.batch_remove(list(keys), True)
            except Exception as exc:  # noqa: BLE001
                self._failed("batch_remove", exc)

    def put_marker(self, key: str, value: bytes) -> bytes | None:
        if not self.is_usable():
            return None
        try:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.with_hard_pin = True  # never evicted (docs/source/design/store/mooncake-store.md, "Soft Pin")
            rc = self._store.put(key, value, config)  # an existing key keeps its value (and the call returns 0)
            held = self._store.get(key)
        except Exception as exc:  # noqa: BLE001
            self._failed("put (marker)", exc)
            return None
        if not held:
            logger.warning("mooncake put of marker %s against %s failed: %s", key, self.master_address, rc)
            return None
        return bytes(held)

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
