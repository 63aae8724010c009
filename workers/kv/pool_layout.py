"""Layout agreement of the workers sharing one pool: a marker object, written by the first member, that every
other member reads when it attaches and refuses to attach against.

Members of one pool must lay their objects out the same way: a worker with another span length
(``kv-cache.pool.blocks-per-span``) writes spans under keys the others never look up (``common.pool_keys``: a span
is found only under its own length), and one with another chunk size or number of layer groups reads every other
member's objects as corrupt (``workers.kv.pool_chunk``: the object's size is checked first) and removes them. So a
member that disagrees would silently lose reuse, or destroy the others'; instead it does not attach.

The marker, under ``LAYOUT_KEY`` (``kvgate/v1/layout``), 24 bytes, little-endian::

    offset  bytes  field
    0       4      magic b"KVGP"
    4       2      layout version (``LAYOUT_VERSION``: 1, spans keyed as in ``common.pool_keys``)
    6       2      blocks_per_span (L, 1-64)
    8       2      chunk version (``workers.kv.pool_chunk.CHUNK_VERSION``)
    10      2      num_layer_groups (pieces per chunk)
    12      4      chunk_bytes (one block's value in the pool)
    16      4      block_size (tokens per block)
    20      4      0

Attaching (``attach_layout``, called by ``PoolTier`` when it is built: every member at start-up): put the own
marker (a Mooncake put of an existing key keeps the stored value, and the master serialises the puts of one key,
so of members starting together exactly one marker wins), read back what the pool holds, and compare. A mismatch
raises ``PoolLayoutError`` naming each field that differs, ours and the pool's. The marker is hard-pinned on
Mooncake (never evicted) and kept apart from the blocks in the sim pool (no capacity, no LRU).

What it does not cover: a marker lives on the segment of one member; when that member leaves (its segment is
unmounted after the master's ``client_ttl``) or the master restarts, the marker goes with the pool's other objects
there, and the next member to attach writes its own. The members attached then do not check again. The gateway's
pool watcher (``pool_watch.blocks_per_span``) sees the span keys of every member in the master's listing and
counts and logs the ones of another length, so a mixed pool is visible there too.

Where this comes from: LMCache and vLLM's Mooncake connector keep members apart by key (LMCache's
``CacheEngineKey`` carries the format, model, world size and chunk hash; vLLM's Mooncake key the model, TP and PP
ranks), and LMCache's remote connectors can store a ``RemoteMetadata`` header (length, shape, dtype, format)
with each object (``lmcache/v1/storage_backend/connector/mooncakestore_connector.py``,
``_process_buffer_with_metadata``); a mismatch there is a miss, never an error. Per object we have the same (each
chunk's manifest); the pool-wide check is a superblock, as a file system's records its block size for every
later mount, and the refusal names both values, as vLLM's start-up checks of a block size do ("block_size (N) is
not supported by the X attention backend", vllm-project/vllm#42682).
"""

from __future__ import annotations

import logging
import struct
from typing import NamedTuple, Protocol

from common.pool_keys import LAYOUT_KEY
from workers.errors import ConfigError

__all__ = ["LAYOUT_KEY", "LAYOUT_VERSION", "PoolLayout", "PoolLayoutError", "attach_layout"]

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1
_MAGIC = b"KVGP"
_MARKER = struct.Struct("<4sHHHHIII")  # 24 bytes


class PoolLayoutError(ConfigError):
    """This worker's pool layout is not the one the pool's other members use (``attach_layout``).

    Attributes:
        ours: this worker's layout.
        pool: the layout the pool's marker records.
    """

    def __init__(self, message: str, ours: PoolLayout, pool: PoolLayout) -> None:
        super().__init__(message)
        self.ours = ours
        self.pool = pool


class PoolLayout(NamedTuple):
    """What the members of one pool must agree on (module docstring)."""

    blocks_per_span: int
    num_layer_groups: int
    chunk_bytes: int
    block_size: int
    chunk_version: int
    layout_version: int = LAYOUT_VERSION

    def encode(self) -> bytes:
        """The marker's 24 bytes (module docstring)."""
        return _MARKER.pack(_MAGIC, self.layout_version, self.blocks_per_span, self.chunk_version,
                            self.num_layer_groups, self.chunk_bytes, self.block_size, 0)  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> PoolLayout | None:
        """The layout a marker records, ``None`` when ``data`` is no marker (size or magic)."""
        if len(data) != _MARKER.size:
            return None
        magic, version, span_len, chunk_version, num_groups, chunk_bytes, block_size, _ = _MARKER.unpack(data)
        if magic != _MAGIC:
            return None
        return cls(span_len, num_groups, chunk_bytes, block_size, chunk_version, version)


_FIELDS = (
    ("layout_version", "layout version"),
    ("blocks_per_span", "blocks-per-span"),
    ("chunk_version", "chunk version"),
    ("num_layer_groups", "num-layer-groups"),
    ("chunk_bytes", "chunk bytes (value-bytes-per-block)"),
    ("block_size", "block-size"),
)


class _MarkerStore(Protocol):
    def put_marker(self, key: str, value: bytes) -> bytes | None: ...


def attach_layout(store: _MarkerStore, ours: PoolLayout, where: str) -> PoolLayout | None:
    """Write ``ours`` as the pool's marker unless one is there, read back the pool's, and compare (module
    docstring); ``where`` names the pool in the error (its master's address, or the sim pool's name).

    Returns:
        The pool's layout (``ours`` when this worker wrote the marker or agrees), ``None`` when the pool could not
        be asked (a master that is down: the check is skipped and logged; the store's calls fail soft until then).

    Raises:
        PoolLayoutError: the pool's marker records another layout (each differing field named, ours and the
            pool's), or the marker key holds something that is no marker.
    """
    held = store.put_marker(LAYOUT_KEY, ours.encode())
    if held is None:
        logger.warning("pool %s did not take or return its layout marker (%s): the layout was not checked", where,
                       LAYOUT_KEY)  # fmt: skip
        return None
    pool = PoolLayout.decode(held)
    if pool is None:
        raise PoolLayoutError(f"pool {where}: {LAYOUT_KEY} holds {len(held)} bytes that are no kvgate layout marker",
                              ours, ours)  # fmt: skip
    if pool == ours:
        return pool
    diffs = "; ".join(f"{label} {getattr(ours, name)} here, {getattr(pool, name)} in the pool"
                      for name, label in _FIELDS if getattr(ours, name) != getattr(pool, name))  # fmt: skip
    raise PoolLayoutError(
        f"pool {where} is laid out for other workers ({diffs}): a worker of another layout would store objects the "
        f"others never find or read as corrupt, so this one does not attach; set kv-cache.pool to the pool's "
        f"values, or use another pool",
        ours,
        pool,
    )
