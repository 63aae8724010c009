"""A sequence's KV state as the KV cache manager keeps it, and the prefix hit a lookup returns.

Cached tokens (what ``usage.prompt_tokens_details.cached_tokens`` reports), exactly as vLLM computes them: the
last prompt token is always computed (its logits are needed), so a hit may cover at most
``(num_prompt_tokens - 1) // block_size`` blocks::

    cached_tokens = block_size * min(num_hit_blocks, (num_prompt_tokens - 1) // block_size)

where ``num_hit_blocks`` counts consecutive full blocks from the first found on GPU, continued on CPU (a
restore). E.g. block_size 16: a 32-token prompt fully cached reports 16; a 33-token one reports 32.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from common.pool_keys import PoolObject
from workers.kv.hashing import BlockHash, namespace_root


class SequenceKV:
    """A sequence's KV state, owned by the manager's caller (one per request).

    Attributes:
        request_id: the request.
        root: namespace root hash (LoRA name, cache salt).
        block_hashes: hashes of the sequence's full blocks so far.
        block_payloads: each of those blocks' tokens as hashed (``extend_block_hashes``' ``payloads``), the pool
            tier's chunk payloads (as many as ``block_hashes``).
        block_ids: the GPU block table.
        num_cached_blocks: leading blocks of ``block_ids`` already registered (or being restored).
        cpu_pinned: CPU blocks this sequence pinned for its restore.
        restore_job_id: the restore in flight into this sequence's blocks (its first job), or ``None``.
        restore_job_ids: every job of that restore (CPU part, pool part); the blocks register when all landed.
        is_freed: ``free`` was called (blocks released, or to be released when the restore lands).
    """

    __slots__ = (
        "request_id",
        "lora_name",
        "cache_salt",
        "root",
        "block_hashes",
        "block_payloads",
        "block_ids",
        "num_cached_blocks",
        "cpu_pinned",
        "restore_job_id",
        "restore_job_ids",
        "is_freed",
    )

    def __init__(self, request_id: str, lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.root = namespace_root(lora_name, cache_salt)
        self.block_hashes: list[BlockHash] = []
        self.block_payloads: list[bytes] = []
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        self.cpu_pinned: list[BlockHash] = []
        self.restore_job_id: int | None = None
        self.restore_job_ids: tuple[int, ...] = ()
        self.is_freed = False


class PrefixHit(msgspec.Struct, frozen=True, gc=False):
    """A sequence's usable prefix.

    Attributes:
        gpu_block_ids: GPU blocks of the leading hit, in order.
        num_cpu_blocks: further blocks found on the CPU tier (to restore).
        block_size: tokens per block.
        num_pool_blocks: further blocks found in the shared pool after those (to restore).
    """

    gpu_block_ids: tuple[int, ...]
    num_cpu_blocks: int
    block_size: int
    num_pool_blocks: int = 0
    token_ids: Sequence[int] = ()
    """The tokens looked up (a reference, not a copy): a restore builds its blocks' metas from them."""
    pool_objects: tuple[PoolObject, ...] = ()
    """The pool objects holding the pool part of the hit, in chain order (``PoolTier.lookup``): what its restore
    reads."""

    @property
    def num_blocks(self) -> int:
        """GPU plus CPU plus pool hit blocks."""
        return len(self.gpu_block_ids) + self.num_cpu_blocks + self.num_pool_blocks

    @property
    def num_cached_tokens(self) -> int:
        """Tokens served from the cache (any tier)."""
        return self.num_blocks * self.block_size


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most prompt blocks a hit may cover: the last prompt token is always computed (vLLM's rule)."""
    return max(0, (num_prompt_tokens - 1) // block_size)
