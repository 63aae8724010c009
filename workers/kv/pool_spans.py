"""Which pool objects hold which blocks of a chain (``common.pool_keys``): the keys a lookup checks, the objects a
store job writes and a restore reads. Pure functions over chain positions; the tier (``workers.kv.pool_tier``)
makes the store calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from common.pool_keys import KEY_PREFIX, SPAN_PREFIX, PoolObject, pool_key, span_key
from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import BlockHash

__all__ = ["PoolHit", "hit_of", "lookup_objects", "objects_of", "positions_of", "singles_inside", "store_objects"]


class PoolHit(NamedTuple):
    """What ``PoolTier.lookup`` found: how many blocks from the first position asked, and the objects holding
    them in chain order (what the restore reads)."""

    num_blocks: int
    objects: tuple[PoolObject, ...]


def _single(hashes: Sequence[BlockHash], depth: int) -> PoolObject:
    return PoolObject(pool_key(hashes[depth]), depth, (hashes[depth],))


def lookup_objects(
    hashes: Sequence[BlockHash], first: int, end: int, span_len: int
) -> tuple[list[PoolObject], list[PoolObject]]:
    """The objects a lookup of chain positions ``first .. end - 1`` checks first: every span overlapping them that
    the chain ``hashes`` covers whole (its last position may lie past ``end``), then a single per position after
    the chain's last full span."""
    num_full = len(hashes) // span_len
    spans: list[PoolObject] = []
    for k in range(first // span_len, min(num_full, -(-end // span_len))):
        members = tuple(hashes[k * span_len : (k + 1) * span_len])
        spans.append(PoolObject(span_key(members), k * span_len, members))
    return spans, [_single(hashes, d) for d in range(max(first, num_full * span_len), end)]


def singles_inside(hashes: Sequence[BlockHash], span: PoolObject, first: int, end: int) -> list[PoolObject]:
    """The singles a missing span's blocks may have (from ``first``, before ``end``): every position but its last,
    which is never a tail's."""
    lo = max(first, span.first_depth)
    hi = min(end, span.first_depth + span.num_blocks - 1)
    return [_single(hashes, d) for d in range(lo, hi)]


def hit_of(
    first: int, end: int, found: list[PoolObject], singles: Sequence[PoolObject], present: Sequence[bool]
) -> PoolHit:
    """The hit of ``found`` (objects present, in order) continued by the leading present ``singles``, from
    position ``first`` and capped at ``end``."""
    for obj, ok in zip(singles, present, strict=True):
        if not ok:
            break
        found.append(obj)
    if not found:
        return PoolHit(0, ())
    last = found[-1]
    return PoolHit(min(end, last.first_depth + last.num_blocks) - first, tuple(found))


def _tags(hashes: Sequence[bytes]) -> str:
    """Each hash's last 8 bytes in hex, joined (``span_key``'s member tags, 16 digits per block): for 32-byte
    hashes one numpy column of the joined hashes (a slice per hash costs 4 times that: 44 against 11 us for 558)."""
    joined = b"".join(hashes)
    if len(joined) != 32 * len(hashes):
        return b"".join([h[-8:] for h in hashes]).hex()
    return np.frombuffer(joined, np.uint8).reshape(-1, 32)[:, 24:].tobytes().hex()


def store_objects(metas: Sequence[BlockMeta], span_len: int, num_context_blocks: int) -> list[tuple[str, int, int]]:
    """The objects a store job writes, as ``(key, start, end)`` ranges of ``metas``: every span ``metas`` covers
    whole, and a single for each other block except the leading ``num_context_blocks`` (written only inside a
    span).

    Raises:
        ValueError: ``metas`` is not one run of consecutive chain positions.
    """
    if not metas:
        return []
    d0 = metas[0].depth
    if metas[-1].depth - d0 != len(metas) - 1:
        raise ValueError("a pool store job is one run of consecutive chain positions")
    if span_len == 1:  # every block its own object
        return [(pool_key(m.block_hash), i, i + 1) for i, m in enumerate(metas)]
    hashes = [m.block_hash for m in metas]
    tags = ""  # every block's 16 hex digits in a span key (span_key: its hash's last 8 bytes), made once (_tags)
    out: list[tuple[str, int, int]] = []
    i, n = 0, len(metas)
    while i < n:
        if (d0 + i) % span_len == 0 and i + span_len <= n:  # a full span starts here: span_key of its members
            tags = tags or _tags(hashes)
            last = i + span_len - 1
            out.append((SPAN_PREFIX + tags[16 * i : 16 * last] + "/" + hashes[last].hex(), i, i + span_len))
            i += span_len
            continue
        if i >= num_context_blocks:
            out.append((KEY_PREFIX + hashes[i].hex(), i, i + 1))
        i += 1
    return out


def positions_of(objects: Sequence[tuple[str, int, int]]) -> list[int]:
    """Every position of the ``(key, start, end)`` ranges ``objects`` (``store_objects``' order), in order: one
    ``range`` where they lie back to back (a job storing all its objects), else range by range."""
    lo, hi = (objects[0][1], objects[-1][2]) if objects else (0, 0)
    if sum(end - start for _, start, end in objects) == hi - lo:
        return list(range(lo, hi))
    return [i for _, start, end in objects for i in range(start, end)]


def objects_of(metas: Sequence[BlockMeta], span_len: int) -> list[PoolObject]:
    """The objects holding ``metas`` (consecutive chain positions) when no lookup gave them: the spans ``metas``
    covers whole, singles for the rest."""
    if span_len == 1:  # every block its own object (store_objects' first case, without the ranges)
        return [PoolObject(KEY_PREFIX + m.block_hash.hex(), m.depth, (m.block_hash,)) for m in metas]
    hashes = [m.block_hash for m in metas]
    return [PoolObject(key, metas[lo].depth, tuple(hashes[lo:hi])) for key, lo, hi in store_objects(metas, span_len, 0)]
