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
are numpy column writes over the run), and a run is checked every byte: chunks shorter than 64 KiB by building
what ``write_run`` builds into a scratch buffer of the same layout and comparing the two (one ``memcmp`` per MiB
of the run), so the cost per block is the packing and one ``xxh3_64`` call, whatever the layer groups and the
padding; longer ones in one read of their bytes (the manifest and payload columns compared with the ones
expected, each padding range's 64-bit words with zero, in slices on several threads: ``workers.kv.pool_zero``), as
a GPU engine's pieces would be against their digests. With ``check_padding`` off, the manifest and payload columns
only.

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
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from workers.kv.pool_zero import ZeroCheck

CHUNK_MAGIC = b"KVGC"
CHUNK_VERSION = 1
_HEAD = struct.Struct("<4sBBHII32s")
HEAD_BYTES = _HEAD.size  # 48


_SLAB_BYTES = 64 << 10
"""Chunks shorter than this are checked rebuilt (``ChunkLayout._check_rebuilt``); in longer ones, padding ranges
at least this long are checked as 64-bit words on the check threads (``ChunkLayout._zero_rows``)."""
_REBUILD_BYTES = 1 << 20
"""Bytes of short chunks rebuilt and compared at a time (each thread's scratch buffer: this, about)."""


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
        num_check_threads: threads checking long padding ranges (``workers.kv.pool_zero``; ``close`` stops them).

    Raises:
        ValueError: ``num_pieces`` out of range, ``block_size`` or ``num_check_threads`` not positive.
    """

    def __init__(self, block_size: int, num_pieces: int = 1, value_bytes: int = 0, num_check_threads: int = 1) -> None:
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
        pads = [(start + self.payload_bytes, start + self.piece_bytes) for start in self._piece_offsets]
        pads[-1] = (pads[-1][0], self.chunk_bytes)  # the last piece's padding runs on into the chunk's tail
        self._local = threading.local()
        """Each thread's ``_scratch`` array (a tier's read threads check runs at once)."""
        self.zero_check = ZeroCheck(num_check_threads)  # ValueError: not positive
        self._zero_ranges = tuple((lo, hi) for lo, hi in pads if hi > lo)
        """Each chunk's zero ranges (offsets in the chunk): every piece's padding, the tail with the last."""

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

    def _scratch(self, num: int) -> np.ndarray:
        """A ``[num, header_bytes + payload_bytes]`` uint8 array of this thread's, reused by its next ``_heads``
        (a new array of a run's size is a fresh mapping, its pages faulted in at every call: 40 us of a 558-block
        run's 110)."""
        held: np.ndarray | None = getattr(self._local, "heads", None)
        if held is None or len(held) < num:
            held = self._local.heads = np.empty((max(num, 2 * len(held) if held is not None else num),
                                                 self.header_bytes + self.payload_bytes), np.uint8)  # fmt: skip
        return held[:num]

    def _heads(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[Sequence[int]],
        payloads: Sequence[bytes] | None,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """The first ``header_bytes + payload_bytes`` bytes of each block's chunk (the manifest, then the first
        piece's payload), a ``[len(hashes), header_bytes + payload_bytes]`` uint8 array: what ``write_run`` writes
        and ``check_run`` compares. ``payloads``: each block's tokens packed already, used instead of ``tokens``.
        With ``payloads`` the digests are one ``xxh3_64_digest`` call per block, joined and byte-reversed per row
        into the little-endian column (``xxh3_64_digest`` is the canonical big-endian form of
        ``xxh3_64_intdigest``, python-xxhash's README), with no Python int per block. ``into``: with ``payloads``,
        the array to fill (a ``[len(hashes), header_bytes + payload_bytes]`` view, rows may be strided: the chunks'
        own slots, so ``write_run`` copies nothing twice); else this thread's scratch array is filled.

        Raises:
            ValueError: a block that is not ``block_size`` tokens, or a hash that is not 32 bytes.
        """
        num, head_bytes, n = len(hashes), self.header_bytes, self.payload_bytes
        joined = b"".join(hashes)
        if len(joined) != 32 * num or (payloads is None and len(tokens) != num):
            raise ValueError("a chunk holds one full block and its 32-byte hash")
        out = into if into is not None and payloads is not None else self._scratch(num)
        if payloads is not None:
            together = b"".join(payloads)
            if len(together) != n * num or len(payloads) != num:
                raise ValueError("a chunk holds one full block and its 32-byte hash")
            out[:, head_bytes:] = np.frombuffer(together, np.uint8).reshape(num, n)
            canonical = np.frombuffer(b"".join(map(xxhash.xxh3_64_digest, payloads)), np.uint8).reshape(num, 8)
            sums = canonical[:, ::-1]
        else:
            digest = xxhash.xxh3_64_intdigest
            pack_into = self._tokens.pack_into
            digests = []
            flat = out.reshape(-1)
            row = memoryview(flat)  # type: ignore[arg-type]  # a contiguous uint8 array exports a byte buffer
            at, step = head_bytes, head_bytes + n
            try:
                for token_ids in tokens:
                    pack_into(row, at, *token_ids)
                    digests.append(digest(row[at : at + n]))
                    at += step
            except struct.error as exc:
                raise ValueError("a chunk holds one full block and its 32-byte hash") from exc
            sums = np.array(digests, "<u8").view(np.uint8).reshape(num, 8)
        out[:, :16] = np.frombuffer(self._head, np.uint8)
        out[:, 16:HEAD_BYTES] = np.frombuffer(joined, np.uint8).reshape(num, 32)
        for i in range(self.num_pieces):
            out[:, HEAD_BYTES + 8 * i : HEAD_BYTES + 8 * i + 8] = sums
        return out

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
        (which may then be empty).

        Raises:
            ValueError: a block that is not ``block_size`` tokens, or a hash that is not 32 bytes.
        """
        if not hashes:
            return
        rows = self._rows(buffer.data, offset, len(hashes))
        head_bytes, n = self.header_bytes, self.payload_bytes
        heads = self._heads(hashes, tokens, payloads, rows[:, : head_bytes + n])
        if payloads is None:  # built in this thread's scratch array (with payloads: in place)
            rows[:, : head_bytes + n] = heads
        for start in self._piece_offsets[1:]:
            rows[:, start : start + n] = heads[:, head_bytes:]

    def _zero_rows(self, data: bytearray, offset: int, num: int, lo: int, hi: int) -> np.ndarray | None:
        """Whether bytes ``lo .. hi - 1`` of each of ``num`` chunks from ``data[offset:]`` are all zero: ``None``
        when every row's are (the common case, answered without a per-row array), else a bool per row. One read
        of those bytes: numpy's ``any`` over the strided columns for ranges shorter than ``_SLAB_BYTES``; longer
        ones as 64-bit words whose maximum must be zero, in slices spread over the layout's check threads
        (``workers.kv.pool_zero.ZeroCheck``: exact, and off the GIL)."""
        if hi <= lo:
            return None
        width, step = hi - lo, self.chunk_bytes
        if width < _SLAB_BYTES:
            nonzero = np.asarray(self._rows(data, offset, num)[:, lo:hi].any(axis=1))
            return None if not nonzero.any() else ~nonzero
        return self.zero_check.rows(data, offset, num, step, lo, hi)

    def check_run(
        self,
        data: bytearray,
        offset: int,
        hashes: Sequence[bytes],
        tokens: Sequence[Sequence[int]],
        check_padding: bool = True,
        payloads: Sequence[bytes] | None = None,
    ) -> int:
        """How many of the ``len(hashes)`` chunks in consecutive slots from ``data[offset:]``, from the first, are
        exactly what ``write_run`` builds for these blocks (as ``check`` one by one: manifest, hash, digests,
        payloads and, with ``check_padding``, the zero padding); ``payloads`` as for ``write_run`` (``tokens``
        then may be empty). Chunks shorter than ``_SLAB_BYTES`` (with ``check_padding``): rebuilt in a scratch
        buffer of this thread's, ``_REBUILD_BYTES`` at a time, and compared in one ``memcmp`` each (a run of short
        chunks costs its per-block work, not its bytes). Longer ones: one read of every byte checked, the
        manifests and payloads compared with the ones expected (``[num, header_bytes + payload_bytes]``, built as
        ``write_run`` builds them), the padding with zeros (``_zero_rows``)."""
        num = len(hashes)
        if not num:
            return 0
        if check_padding and self.chunk_bytes < _SLAB_BYTES:
            return self._check_rebuilt(data, offset, hashes, tokens, payloads)
        heads = self._heads(hashes, tokens, payloads)
        rows = self._rows(data, offset, num)
        head_bytes, n = self.header_bytes, self.payload_bytes
        checks = [(rows[:, : head_bytes + n], heads)]
        checks += [(rows[:, start : start + n], heads[:, head_bytes:]) for start in self._piece_offsets[1:]]
        same: np.ndarray | None = None
        for got, want in checks:
            if not np.array_equal(got, want):
                row_same = (got == want).all(axis=1)
                same = row_same if same is None else same & row_same
        if check_padding:
            for lo, hi in self._zero_ranges:
                zero = self._zero_rows(data, offset, num, lo, hi)
                if zero is not None:
                    same = zero if same is None else same & zero
        if same is None or bool(same.all()):
            return num
        return int(np.argmin(same))

    def _check_rebuilt(
        self, data: bytearray, offset: int, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]],
        payloads: Sequence[bytes] | None,
    ) -> int:  # fmt: skip
        """``check_run`` of short chunks, every byte: rebuilt (``write_run``) into this thread's scratch buffer
        (zero-filled and only ever holding this layout's chunks, so its padding stays zero) and compared."""
        num, step = len(hashes), self.chunk_bytes
        per = max(1, _REBUILD_BYTES // step)
        scratch: HostBuffer | None = getattr(self._local, "rebuilt", None)
        if scratch is None or scratch.num_bytes < min(num, per) * step:
            scratch = self._local.rebuilt = HostBuffer(per * step)
        for lo in range(0, num, per):
            hi = min(num, lo + per)
            self.write_run(scratch, 0, hashes[lo:hi], tokens[lo:hi] if payloads is None else (),
                           None if payloads is None else payloads[lo:hi])  # fmt: skip
            if not data.startswith(scratch.view[: (hi - lo) * step], offset + lo * step):
                got, want = self._rows(data, offset + lo * step, hi - lo), self._rows(scratch.data, 0, hi - lo)
                return lo + int(np.argmin((got == want).all(axis=1)))
        return num

    def close(self) -> None:
        """Stop the check threads (``num_check_threads`` above 1)."""
        self.zero_check.close()

    def build(self, block_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """One chunk as ``bytes`` (tests, tools)."""
        buf = HostBuffer(self.chunk_bytes)
        self.write(buf.view, 0, block_hash, token_ids)
        return bytes(buf.data)
