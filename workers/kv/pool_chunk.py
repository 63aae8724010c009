"""A block's value in the shared pool: one chunk holding every layer group's piece, written and evicted as one
object.

An engine whose layers are split into groups (pipeline-parallel stages, or the layer groups a multi-group layout
stores apart) holds a block's KV as several pieces. vLLM's Mooncake store connector writes one key per piece
(``<model>@tp_rank:T@pcp0@dcp0@pp_rank:P@group:G@<hash>``, ``mooncake/store/worker.py``), so the master may evict
one piece and keep the others: a reader that loads what it finds restores half a block. Here a block is one
object whose value is a manifest header followed by all its pieces (``PoolConfig.num_layer_groups`` of them), put
in one call from one staging buffer, so the master keeps or evicts all of it; a read accepts the chunk only when
the manifest and every byte check out, else the whole block is a miss (never a partial load)::

    offset        bytes            field
    0             4                magic b"KVGC"
    4             1                version (1)
    5             1                num_pieces (P, the layer groups)
    6             2                0
    8             4                piece_bytes (each piece, payload + zero padding)
    12            4                payload_bytes (the piece's content; the sim engine: 4 × block_size)
    16            32               block_hash (the worker's SHA-256 chain hash; the key's hex, bound here)
    48            8 × P            xxh3_64 of each piece's payload
    H = 48 + 8P   P × piece_bytes  the pieces, in layer-group order
    H + P·piece   rest             zero padding up to chunk_bytes

    chunk_bytes = max(value_bytes_per_block, H + P × payload_bytes)
    piece_bytes = (chunk_bytes - H) // P

The sim engine has no KV bytes: each piece's payload is the block's token ids (little-endian u32), so a read is
checked against the tokens the restore expects, the manifest's digests, and zero padding: every byte of the chunk.
A GPU engine would put each layer group's KV as its piece and check the digests.

Staging (``HostBuffer``): chunks are built in place in host buffers the store can read from directly (registered
with Mooncake: ``batch_put_from`` and ``batch_get_into`` move them without another copy). A buffer's slot ``j``
always holds a chunk of the same layout at ``j × chunk_bytes``, and only the header and payload ranges are ever
written, so its padding stays zero from allocation on: building a chunk writes ``H + P × payload_bytes`` bytes,
not ``chunk_bytes``.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence

import xxhash

CHUNK_MAGIC = b"KVGC"
CHUNK_VERSION = 1
_HEAD = struct.Struct("<4sBBHII32s")
HEAD_BYTES = _HEAD.size  # 48


@functools.lru_cache(maxsize=16)
def _zeros(num_bytes: int) -> bytes:
    return bytes(num_bytes)


class HostBuffer:
    """A zero-filled host memory region (``num_bytes``) with a stable address, for a store's direct reads and
    writes (``view`` for Python, ``address`` for the Mooncake client's pointer calls)."""

    __slots__ = ("data", "view", "address", "num_bytes", "_anchor")

    def __init__(self, num_bytes: int) -> None:
        if num_bytes <= 0:
            raise ValueError("num_bytes must be positive")
        self.data = bytearray(num_bytes)
        self.view = memoryview(self.data)
        self._anchor = ctypes.c_char.from_buffer(self.data)  # pins the bytearray (no resize) and gives its address
        self.address = ctypes.addressof(self._anchor)
        self.num_bytes = num_bytes


class ChunkLayout:
    """Sizes and offsets of one tier's chunks (module docstring); builds and checks chunks in a ``HostBuffer``.

    Args:
        block_size: tokens per block (a piece's sim payload is ``4 × block_size`` bytes).
        num_pieces: layer groups per block (``>= 1``, ``<= 255``).
        value_bytes: the chunk's size target in bytes (``PoolConfig.value_bytes_per_block``; 0: no padding).

    Raises:
        ValueError: ``num_pieces`` out of range or ``block_size`` not positive.
    """

    def __init__(self, block_size: int, num_pieces: int = 1, value_bytes: int = 0) -> None:
        if not 1 <= num_pieces <= 255:
            raise ValueError(f"num_pieces must be in [1, 255], not {num_pieces}")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_pieces = num_pieces
        self.payload_bytes = 4 * block_size
        self.header_bytes = HEAD_BYTES + 8 * num_pieces
        self.chunk_bytes = max(value_bytes, self.header_bytes + num_pieces * self.payload_bytes)
        self.piece_bytes = (self.chunk_bytes - self.header_bytes) // num_pieces
        self._tokens = struct.Struct(f"<{block_size}I")
        self._head = _HEAD.pack(CHUNK_MAGIC, CHUNK_VERSION, num_pieces, 0, self.piece_bytes, self.payload_bytes,
                                bytes(32))[:16]  # fmt: skip
        """The manifest's bytes before the block hash (the same for every chunk of this layout)."""
        self._pad = bytes(self.piece_bytes - self.payload_bytes)
        self._piece_offsets = tuple(self.header_bytes + i * self.piece_bytes for i in range(num_pieces))
        end = self.header_bytes + num_pieces * self.piece_bytes
        self._tail = (end, self.chunk_bytes - end)

    def write(self, view: memoryview, offset: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Build the chunk of one block at ``view[offset : offset + chunk_bytes]`` (a slot whose padding is zero).

        Raises:
            ValueError: ``token_ids`` is not one full block, or ``block_hash`` is not 32 bytes.
        """
        if len(token_ids) != self.block_size or len(block_hash) != 32:
            raise ValueError("a chunk holds one full block and its 32-byte hash")
        payload = self._tokens.pack(*token_ids)
        head = self._head + block_hash + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") * self.num_pieces
        view[offset : offset + len(head)] = head
        n = self.payload_bytes
        for start in self._piece_offsets:
            view[offset + start : offset + start + n] = payload

    def check(
        self,
        data: bytearray,
        offset: int,
        num_read: int,
        block_hash: bytes,
        token_ids: Sequence[int],
        check_padding: bool = True,
    ) -> bool:
        """Whether ``data[offset : offset + num_read]`` is exactly the chunk ``write`` builds for this block: the
        manifest (magic, version, every layer group present, sizes, the block's hash), each piece's payload and
        its digest, and (``check_padding``) the zero padding. Any difference, a short read included, makes the
        whole block a miss. Compares in place (``bytearray.startswith``: a memcmp, no copy)."""
        if num_read != self.chunk_bytes:
            return False
        payload = self._tokens.pack(*token_ids)
        digest = xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little")
        if not data.startswith(self._head + block_hash + digest * self.num_pieces, offset):
            return False  # the manifest, the block's hash and each piece's digest, in one compare
        n = self.payload_bytes
        pad = self._pad
        for start in self._piece_offsets:
            at = offset + start
            if not data.startswith(payload, at) or (check_padding and not data.startswith(pad, at + n)):
                return False
        tail_at, tail_bytes = self._tail
        return not (check_padding and tail_bytes) or data.startswith(_zeros(tail_bytes), offset + tail_at)

    def build(self, block_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """One chunk as ``bytes`` (tests, tools)."""
        buf = HostBuffer(self.chunk_bytes)
        self.write(buf.view, 0, block_hash, token_ids)
        return bytes(buf.data)
