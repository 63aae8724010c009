"""Pool keys and spans: which Mooncake object holds which blocks of a chain (the worker's pool tier writes them,
``workers.kv.pool_tier``; the gateway's pool watcher reads them, ``router.pool_watch``).

Mooncake's cost per object dominates its batch calls (``batch_put_from`` / ``batch_get_into`` /
``batch_is_exist``: a master lookup or allocation and a transfer descriptor per key), so the pool tier packs the
blocks of a chain into *spans*: one object per run of ``span_len`` aligned blocks (positions ``k·L .. k·L + L-1``
of the chain, ``L = PoolConfig.blocks_per_span``), keyed by the chain hash of its last block. A chain's unfinished
tail (the blocks after its last full span, fewer than ``L``) is stored as one object per block, as with ``L = 1``::

    chain positions   0 .. 15   16 .. 31   32 33 .. 39          (L = 16, a 40-block chain)
    objects           span 0    span 1     single × 8
    keys              span_key(hashes[0:16]), span_key(hashes[16:32]), pool_key(hashes[32]) .. pool_key(hashes[39])

Keys (ASCII; ``hex`` of the worker's 32-byte SHA-256 chain hash, ``workers.kv.hashing``)::

    single block    kvgate/v1/<hex(block_hash)>                                      74 characters
    span of L >= 2  kvgate/v1/span/<eh(member 0)>..<eh(member L-2)>/<hex(last block's hash)>
                                                                                      80 + 16·(L-1) characters

``eh(h)`` is the member's engine hash as 16 hex digits (the last 8 bytes of its hash, big-endian:
``events.types.fold_engine_hash``, what its ``BlockStored`` event carries). The last block's hash names the whole
span (its chain hash binds every earlier block), so the key is content-addressed like a single block's; the
members' engine hashes make the key say which blocks it holds, so a reader of the master's key listing (the
gateway's pool watcher, ``router.pool_watch``) knows every member of a span from its key alone, with no event
field and no index walk: ``member_engine_hashes``. With ``L = 1`` a span is its block's single object
(``pool_key``), so the layout is exactly the one-object-per-block one.

Presence is exact per block: a block at position ``p`` of a chain is in the pool iff its span object (the span
``p // L``, when the chain is known up to that span's last position) or its single object exists. A position
``k·L + L-1`` is never a tail position, so a block is found through singles only inside the first span that is
missing, and a lookup (``PoolTier.lookup``) needs at most two batched existence checks: the spans and the tail,
then (only when a span is missing) that span's singles.

Layout marker: ``kvgate/v1/layout`` holds the span length and chunk layout every member of the pool uses
(``workers.kv.pool_layout``, checked by each worker when it attaches); it names no block.

Value of a span: its members' chunks (``workers.kv.pool_chunk``) back to back in chain order, each with its own
manifest (magic, the block's hash, each layer group's digest), ``L × chunk_bytes`` bytes; a read checks the
object's size and then every member it restores, against that member's hash, digests and tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "KEY_PREFIX",
    "LAYOUT_KEY",
    "MAX_BLOCKS_PER_SPAN",
    "SPAN_PREFIX",
    "PoolObject",
    "key_num_blocks",
    "member_engine_hashes",
    "pool_key",
    "span_key",
]

KEY_PREFIX = "kvgate/v1/"
SPAN_PREFIX = KEY_PREFIX + "span/"
LAYOUT_KEY = KEY_PREFIX + "layout"
"""The pool's layout marker (``workers.kv.pool_layout``): which span length and chunk layout its members use."""
MAX_BLOCKS_PER_SPAN = 64
"""Largest span (its key is then 1,088 characters)."""
_HEX = frozenset("0123456789abcdef")


def pool_key(block_hash: bytes) -> str:
    """The key of one block's own object (module docstring)."""
    return KEY_PREFIX + block_hash.hex()


def span_key(member_hashes: Sequence[bytes]) -> str:
    """The key of the span holding ``member_hashes`` (chain order; one member: ``pool_key`` of it).

    Raises:
        ValueError: no members, or more than ``MAX_BLOCKS_PER_SPAN``.
    """
    if not 1 <= len(member_hashes) <= MAX_BLOCKS_PER_SPAN:
        raise ValueError(f"a span holds 1 to {MAX_BLOCKS_PER_SPAN} blocks, not {len(member_hashes)}")
    if len(member_hashes) == 1:
        return pool_key(member_hashes[0])
    return SPAN_PREFIX + b"".join([h[-8:] for h in member_hashes[:-1]]).hex() + "/" + member_hashes[-1].hex()


def member_engine_hashes(key: str) -> tuple[int, ...] | None:
    """The engine hashes (u64) of every block a span key names, in chain order (the last from its 64 hex digits,
    as for a single key), or ``None`` when ``key`` is not a well-formed span key."""
    if not key.startswith(SPAN_PREFIX):
        return None
    body = key[len(SPAN_PREFIX) :]
    members, sep, last = body.partition("/")
    n, rest = divmod(len(members), 16)
    if not sep or rest or not 1 <= n < MAX_BLOCKS_PER_SPAN or len(last) != 64:
        return None
    if not (_HEX.issuperset(members) and _HEX.issuperset(last)):
        return None
    out = [int(members[i : i + 16], 16) for i in range(0, len(members), 16)]
    out.append(int(last[48:], 16))
    return tuple(out)


def key_num_blocks(key: str) -> int:
    """Blocks an object of ours holds (a span's members, else 1): what the sim pool charges against its capacity."""
    if key.startswith(SPAN_PREFIX):
        members, sep, _ = key[len(SPAN_PREFIX) :].partition("/")
        if sep:
            return len(members) // 16 + 1
    return 1


class PoolObject(NamedTuple):
    """One pool object a restore reads: its key, the chain position of its first member, and every member's hash
    (one for a single block). Built by ``PoolTier.lookup`` from the chain it checked."""

    key: str
    first_depth: int
    member_hashes: tuple[bytes, ...]

    @property
    def num_blocks(self) -> int:
        """Members of the object."""
        return len(self.member_hashes)
