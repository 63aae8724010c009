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

Runs (``write_run`` / ``check_run``): the chunks of consecutive slots are built in one pass (per block only the
token ids' packing and the payload's digest; the manifest columns, the hashes and the other layer groups' copies
are numpy column writes over the run), and a run is checked by building what ``write_run`` builds into a scratch
buffer of the same layout and comparing the two (one ``memcmp`` of the whole run, every byte; with
``check_padding`` off, the manifest and payload columns only), so the cost per block is the packing and one
``xxh3_64`` call, whatever the layer groups and the padding.

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

import numpy as np
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

    def _rows(self, data: bytearray, offset: int, num_chunks: int) -> np.ndarray:
        """``data[offset : offset + num_chunks × chunk_bytes]`` as a ``[num_chunks, chunk_bytes]`` uint8 view."""
        return np.frombuffer(data, np.uint8, num_chunks * self.chunk_bytes, offset).reshape(num_chunks, -1)

    def write_run(
        self,
        buffer: HostBuffer,
        offset: int,
        hashes: Sequence[bytes],
        tokens: Sequence[Sequence[int]],
        payloads: Sequence[bytes] | None = None,
    ) -> None:
        """Build the chunks of ``len(hashes)`` blocks in consecutive slots from ``buffer.data[offset:]`` (slots whose
        padding is zero), exactly as ``write`` would one by one (module docstring, Runs). ``payloads``: each
        block's tokens packed already (``workers.kv.hashing.extend_block_hashes``), used instead of ``tokens``
        (which may then be empty). With ``payloads`` the digests are one ``xxh3_64_digest`` call per block, joined
        and byte-reversed per row into the little-endian column (``xxh3_64_digest`` is the canonical big-endian
        form of ``xxh3_64_intdigest``, python-xxhash's README), with no Python int per block.

        Raises:
            ValueError: a block that is not ``block_size`` tokens, or a hash that is not 32 bytes.
        """
        num = len(hashes)
        if not num:
            return
        data, view, step = buffer.data, buffer.view, self.chunk_bytes
        head_bytes, n = self.header_bytes, self.payload_bytes
        joined = b"".join(hashes)
        if len(joined) != 32 * num or (payloads is None and len(tokens) != num):
            raise ValueError("a chunk holds one full block and its 32-byte hash")
        rows = self._rows(data, offset, num)
        if payloads is not None:
            together = b"".join(payloads)
            if len(together) != n * num or len(payloads) != num:
                raise ValueError("a chunk holds one full block and its 32-byte hash")
            rows[:, head_bytes : head_bytes + n] = np.frombuffer(together, np.uint8).reshape(num, n)
            canonical = np.frombuffer(b"".join(map(xxhash.xxh3_64_digest, payloads)), np.uint8).reshape(num, 8)
            sums = canonical[:, ::-1]
        else:
            digest = xxhash.xxh3_64_intdigest
            pack_into = self._tokens.pack_into
            digests = []
            at = offset + head_bytes
            try:
                for token_ids in tokens:
                    pack_into(data, at, *token_ids)
                    digests.append(digest(view[at : at + n]))
                    at += step
            except struct.error as exc:
                raise ValueError("a chunk holds one full block and its 32-byte hash") from exc
            sums = np.array(digests, "<u8").view(np.uint8).reshape(num, 8)
        rows[:, :16] = np.frombuffer(self._head, np.uint8)
        rows[:, 16:HEAD_BYTES] = np.frombuffer(joined, np.uint8).reshape(num, 32)
        for i in range(self.num_pieces):
            rows[:, HEAD_BYTES + 8 * i : HEAD_BYTES + 8 * i + 8] = sums
        for start in self._piece_offsets[1:]:
            rows[:, start : start + n] = rows[:, head_bytes : head_bytes + n]

    def check_run(
        self,
        data: bytearray,
        offset: int,
        scratch: HostBuffer,
        hashes: Sequence[bytes],
        tokens: Sequence[Sequence[int]],
        check_padding: bool = True,
        payloads: Sequence[bytes] | None = None,
    ) -> int:
        """How many of the ``len(hashes)`` chunks in consecutive slots from ``data[offset:]``, from the first, are
        exactly what ``write_run`` builds for these blocks (as ``check`` one by one: manifest, hash, digests,
        payloads and, with ``check_padding``, the zero padding). Builds them into ``scratch`` (slot ``j`` at
        ``j × chunk_bytes``: a buffer only ever used for this layout's runs, so its padding is zero) and compares;
        the scratch buffer holds at least ``len(hashes)`` chunks; ``payloads`` as for ``write_run`` (``tokens``
        then may be empty)."""
        num = len(hashes)
        if not num:
            return 0
        self.write_run(scratch, 0, hashes, tokens, payloads)
        size = num * self.chunk_bytes
        if check_padding and data.startswith(scratch.view[:size], offset):
            return num  # every byte, in one compare
        got, want = self._rows(data, offset, num), self._rows(scratch.data, 0, num)
        if check_padding:
            same = (got == want).all(axis=1)
        else:
            n = self.payload_bytes
            same = (got[:, : self.header_bytes + n] == want[:, : self.header_bytes + n]).all(axis=1)
            for start in self._piece_offsets[1:]:
                same &= (got[:, start : start + n] == want[:, start : start + n]).all(axis=1)
        return num if bool(same.all()) else int(np.argmin(same))

    def build(self, block_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """One chunk as ``bytes`` (tests, tools)."""
        buf = HostBuffer(self.chunk_bytes)
        self.write(buf.view, 0, block_hash, token_ids)
        return bytes(buf.data)
