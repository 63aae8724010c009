"""The worker's prefix-cache block hash: a SHA-256 chain over full blocks, rooted in a namespace.

Algorithm (kvgate worker, version 1)::

    root(lora, salt) = SHA-256( b"kvgate-kv-v1\\0" + utf8(lora or "") + b"\\0" + utf8(salt or "") )
    hash(block i)    = SHA-256( parent + token_ids[i*B:(i+1)*B] as little-endian uint32 )
        parent = root for block 0, else hash(block i - 1)

Only full blocks (``block_size`` tokens) are hashed. The namespace enters through the root, so every block of a
chain covers its LoRA adapter and cache salt: tenants and adapters never share entries. SHA-256 keeps
collisions out of reach (a collision here would serve one tenant another's KV). No process seed: the chain is
reproducible across processes and machines.

Cache groups (hybrid models, ``workers.kv.hybrid``): every group keeps its own table keyed by this hash (the main
pool, each sliding-window pool, each recurrent group's checkpoints), so a prefix-cache key is (group, hash) and one
group's entry can never be taken for, or evicted as, another's. The chain itself is the same for every group, as in
vLLM (whose internal key is the digest plus the group id), so a group's store may name a parent another group stored.

On the wire (KV events) a block hash is folded to u64 with ``events.types.fold_engine_hash`` (the last 8 bytes
of the digest, big-endian), as vLLM does.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

from events.types import EngineBlockHash, fold_engine_hash

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte SHA-256 digest identifying a block's content and its whole prefix."""

ROOT_PREFIX = b"kvgate-kv-v1\0"


def namespace_root(lora_name: str | None = None, cache_salt: str | None = None) -> BlockHash:
    """The parent hash of block 0 for a namespace (module docstring)."""
    data = ROOT_PREFIX + (lora_name or "").encode("utf-8") + b"\0" + (cache_salt or "").encode("utf-8")
    return BlockHash(hashlib.sha256(data).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block.

    Args:
        parent: the previous block's hash, or the namespace root for block 0.
        token_ids: the block's ``block_size`` tokens (each in ``[0, 2**32)``).

    Returns:
        The 32-byte digest.
    """
    return BlockHash(hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest())


def extend_block_hashes(
    hashes: list[BlockHash],
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    payloads: list[bytes] | None = None,
) -> list[BlockHash]:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes`` (in place).

    Args:
        hashes: hashes of the first ``len(hashes)`` blocks of ``token_ids`` (extended in place).
        root: the namespace root.
        token_ids: the whole sequence so far (prompt + output).
        block_size: tokens per block.
        payloads: when given, each new block's tokens as hashed (``block_size`` little-endian u32, the bytes the
            hash covers after the parent) are appended to it too: the pool tier's chunk payloads
            (``workers.kv.pool_chunk``), packed once here instead of at every store and restore. Kept in step with
            ``hashes`` by its owner (``SequenceKV.block_payloads``).

    Returns:
        ``hashes``, now ``len(token_ids) // block_size`` long.
    """
    parent = hashes[-1] if hashes else root
    pack = struct.Struct(f"<{block_size}I").pack
    sha256 = hashlib.sha256
    for i in range(len(hashes), len(token_ids) // block_size):
        payload = pack(*token_ids[i * block_size : (i + 1) * block_size])
        parent = BlockHash(sha256(parent + payload).digest())  # hash_block
        hashes.append(parent)
        if payloads is not None:
            payloads.append(payload)
    return hashes


def to_engine_hash(block_hash: BlockHash) -> EngineBlockHash:
    """The u64 wire form of ``block_hash``."""
    return fold_engine_hash(block_hash)
