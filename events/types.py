"""Normalized KV lifecycle events: the only event shapes code outside ``events/`` ever sees.

The decoder (``events.decode``) turns every wire shape vLLM and SGLang publish into these structs; the
encoder (``events.encode``) turns them back into vLLM's wire shapes for our reference worker. The wire format
itself is described in ``events/decode.py``.

Engine block hashes are opaque ids (``EngineBlockHash``): always an unsigned 64-bit int after normalization.
vLLM's int form is the low 64 bits of the digest (the last 8 bytes read big-endian); a ``bytes`` hash on the
wire is folded the same way, and a negative i64 (SGLang, old vLLM ``builtin``) is reinterpreted as u64.
They are used only to link a block to its parent and to apply removals; the prefix index keys blocks by its own
content hash (``router.block_hash``), never by these.

Tiers (``Medium``)::

    GPU       device memory of the worker                (vLLM "GPU", SGLang "GPU")
    CPU       host memory of the worker                  ("CPU", "CPU_PINNED")
    DISK      local disk of the worker                   ("DISK", "LOCAL_DISK")
    MOONCAKE  shared pool reachable by every attached    ("MOONCAKE", "EXTERNAL", "STORAGE", "L3")
              worker (Mooncake Store, LMCache remote)
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType

import msgspec

EngineBlockHash = NewType("EngineBlockHash", int)
"""An engine's block hash folded to u64 (see module docstring). Opaque: never compared across workers."""

U64_MASK = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 32) - 1
"""Largest token id accepted: the prefix index hashes token ids as little-endian uint32 (``router.block_hash``)."""


class Medium(StrEnum):
    """Storage tier a block lives on, ordered from fastest to slowest."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    MOONCAKE = "MOONCAKE"


MEDIUM_ALIASES: dict[str, Medium] = {
    "GPU": Medium.GPU,
    "CUDA": Medium.GPU,
    "DEVICE": Medium.GPU,
    "CPU": Medium.CPU,
    "CPU_PINNED": Medium.CPU,
    "HOST": Medium.CPU,
    "DISK": Medium.DISK,
    "LOCAL_DISK": Medium.DISK,
    "MOONCAKE": Medium.MOONCAKE,
    "EXTERNAL": Medium.MOONCAKE,
    "STORAGE": Medium.MOONCAKE,
    "L3": Medium.MOONCAKE,
}
"""Upper-cased wire ``medium`` string -> tier. ``None`` on the wire means ``GPU``."""


def normalize_medium(value: str | None) -> Medium | None:
    """Map a wire ``medium`` string to a tier.

    Args:
        value: the ``medium`` field as published (any case), or ``None``.

    Returns:
        The tier; ``Medium.GPU`` for ``None``; ``None`` for a string no engine is known to send
        (the caller counts and skips the event).
    """
    if value is None:
        return Medium.GPU
    return MEDIUM_ALIASES.get(value.upper())


def fold_engine_hash(value: int | bytes) -> EngineBlockHash:
    """Fold a wire block hash into a u64 the way vLLM's ``maybe_convert_block_hash`` does.

    Args:
        value: msgpack u64, negative i64, or raw digest bytes (sha256: 32 B, xxh3-128: 16 B).

    Returns:
        ``value & (2**64 - 1)`` for ints; the last 8 bytes read big-endian for bytes.

    Raises:
        ValueError: for empty bytes.
    """
    if isinstance(value, int):
        return EngineBlockHash(value & U64_MASK)
    if not value:
        raise ValueError("empty block hash")
    return EngineBlockHash(int.from_bytes(value[-8:], "big"))


class SpecKind(StrEnum):
    """vLLM's ``KVCacheSpecKind`` values, as ``BlockStored.kv_cache_spec_kind`` carries them on the wire.

    Source: vLLM ``vllm/v1/kv_cache_interface.py::KVCacheSpecKind``; ``KVCacheManager.take_events``
    (``vllm/v1/core/kv_cache_manager.py``) writes the group's kind and sliding window into every ``BlockStored``
    (``BlockRemoved`` carries only ``group_idx``). Kinds not listed are kept as plain strings.
    """

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


DENSE_SPEC_KINDS: frozenset[str] = frozenset(
    {SpecKind.FULL_ATTENTION, SpecKind.MLA_ATTENTION, SpecKind.SINK_FULL_ATTENTION}
)
"""Kinds whose groups keep every block of a request: their stores always carry one hash per token block.

The other kinds (sliding window, Mamba in vLLM's ``align`` prefix-caching mode, chunked local attention) replace
blocks a request no longer needs with the null block; vLLM's ``BlockPool.cache_full_blocks`` skips null (and
masked) blocks when it lists ``block_hashes`` but still sends the tokens of the whole range, so such a store may
carry more token blocks than hashes (``BlockStored.num_skipped_blocks``)."""


def is_sparse_group(kind: str | None, group_idx: int) -> bool:
    """Whether a store of this group may skip blocks (``DENSE_SPEC_KINDS``).

    Args:
        kind: the wire ``kv_cache_spec_kind``, or ``None`` (vLLM before the field existed).
        group_idx: the wire ``group_idx`` (0 when absent).

    Returns:
        True for a kind outside ``DENSE_SPEC_KINDS``; without a kind, True for any group but 0 (the main group,
        full attention on every model vLLM ran before it sent kinds).
    """
    if kind is None:
        return group_idx != 0
    return kind not in DENSE_SPEC_KINDS


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """A run of blocks newly cached on one tier, in prefix order (vLLM's ``BlockStored`` semantics).

    Invariants (enforced by the decoder before a struct is built):
      * GPU tier: ``len(token_ids) == block_size * (len(block_hashes) + num_skipped_blocks)``, where
        ``num_skipped_blocks`` is 0 except for a sparse group (``is_sparse_group``): there the tokens cover the
        whole range from the parent on, and the hashes name its **last** ``len(block_hashes)`` blocks (the null
        blocks vLLM skips are the ones a sliding window left behind, or the states Mamba's ``align`` mode did
        not keep: both lie before the kept ones; ``vllm/v1/core/block_pool.py::cache_full_blocks``).
      * Offload tiers (CPU, DISK, MOONCAKE) may carry no ``token_ids`` and no parent; their ``block_size`` may be
        a multiple of the GPU block size, with one hash per group of GPU blocks.
      * ``block_hashes`` holds no repeated hash.

    Attributes:
        block_hashes: engine hashes of the blocks, u64, root-most first.
        parent_block_hash: engine hash of the block just before ``block_hashes[0]``; ``None`` at the root
            (or unknown, for offload stores).
        token_ids: flat token ids, ``block_size`` per block, each in ``[0, 2**32)``; empty for token-less offload
            stores.
        block_size: tokens per block as published.
        medium: tier the blocks were stored on.
        lora_name: LoRA adapter name that feeds the engine's hash, or ``None``.
        extra_keys: vLLM's per-block extra keys (``cache_salt`` sits in block 0's tuple), or ``None``.
        group_idx: KV-cache group (hybrid models; 0 = main group).
        kv_cache_spec_kind: e.g. ``"full_attention"``, ``"sliding_window"``, ``"mamba"``; ``None`` if unsent.
        sliding_window_tokens: the sliding window in tokens for sliding-window groups, else ``None``.
    """

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium = Medium.GPU
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    sliding_window_tokens: int | None = None

    @property
    def num_skipped_blocks(self) -> int:
        """Token blocks before the first hashed block that the store does not name (sparse groups; else 0)."""
        if not self.token_ids or self.block_size <= 0:
            return 0
        return max(0, len(self.token_ids) // self.block_size - len(self.block_hashes))


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks evicted from one tier (vLLM: one event per evicted block).

    Attributes:
        block_hashes: engine hashes, u64.
        medium: tier the blocks left.
        group_idx: KV-cache group.
    """

    block_hashes: tuple[EngineBlockHash, ...]
    medium: Medium = Medium.GPU
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """Every block of the worker dropped (``reset_prefix_cache``).

    Attributes:
        medium: a clear scoped to one tier (newer vLLM), or ``None`` for all of the worker's own tiers
            (a shared pool is not the worker's own and is never cleared by it).
    """

    medium: Medium | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One decoded wire batch, attributed to the worker that published it.

    Attributes:
        worker_id: the worker, from configuration or from an llm-d style topic ``kv@<worker>@<model>``.
        dp_rank: data-parallel rank from the batch, else the rank configured for the endpoint (0).
        seq: publisher sequence number (u64, from 0, +1 per batch).
        ts_s: publisher wall-clock time of the batch in seconds.
        events: the normalized events, in wire order (skipped events removed).
    """

    worker_id: str
    dp_rank: int
    seq: int
    ts_s: float
    events: tuple[KVEvent, ...]


class Resync(msgspec.Struct, frozen=True, gc=False):
    """Control record from the subscriber: drop everything known about one engine of ``worker_id`` (its own tiers)
    before applying any later batch of it. Emitted on a publisher restart, an unclosable gap, or a new worker start
    id. Each data-parallel rank publishes its own sequenced stream (vLLM), so a break in one rank's stream clears
    that rank only.

    Attributes:
        worker_id: the worker to clear.
        reason: ``"seq_backwards"``, ``"gap_unrecoverable"``, ``"reconnect"``, ``"start_id_changed"``...
        dp_rank: the data-parallel rank whose stream broke; ``None`` clears every rank of the worker.
    """

    worker_id: str
    reason: str
    dp_rank: int | None = None
