"""Pure helpers of ``PrefixIndex.match``: prefix depths from per-position holder masks, and hybrid hit rules.

A *slot* is one (worker, dp_rank) engine; it owns one bit of every holder mask. For a prompt of ``n`` blocks,
``masks[i]`` is the set of slots holding block ``i`` (a Python int used as a bitset). The contiguous depth of a
slot is the number of leading positions whose mask has its bit; the AND-accumulation of the masks is
monotone (bits only leave), so every slot's depth is where its bit leaves the accumulation, and the walk
stops at the first empty accumulation (early exit). When the masks themselves are monotone for some slots
(slots without gaps, ``router.index.state``), ``jump_depths`` finds those slots' depths by binary search and
reads ``O(log n)`` positions per distinct depth instead of all of them.

Hybrid models are answered per slot with position bitsets ``P`` (bit ``i`` set when the slot holds block
``i``) and one "usable lengths" bitset per group (bit ``L`` set when the group can serve a prefix of ``L``
blocks); the usable prefix is the highest bit of their AND (see ``usable_lengths``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, groupby, repeat, takewhile
from operator import and_, neg

from router.index.config import GroupKind, GroupSpec


def iter_bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def prefix_depths(masks: Iterable[int]) -> tuple[dict[int, int], int]:
    """Contiguous depth per slot from per-position holder masks.

    Args:
        masks: ``[n]`` holder masks in prefix order (lazy iterables are consumed only up to the first position
            no slot continues through: the early exit).

    Returns:
        ``(depth_by_bit, max_depth)``: for every slot holding block 0, the number of leading blocks it holds;
        ``max_depth`` is the largest of them (0 when nobody holds block 0).
    """
    acc = list(takewhile(bool, accumulate(masks, and_)))
    depths: dict[int, int] = {}
    if not acc:
        return depths, 0
    pos = 0
    prev = 0
    for value, run in groupby(acc):
        if pos:
            for bit in iter_bits(prev & ~value):
                depths[bit] = pos
        pos += len(list(run))
        prev = value
    for bit in iter_bits(prev):
        depths[bit] = pos
    return depths, pos


def prefix_levels(masks: Iterable[int]) -> tuple[dict[int, int], int]:
    """``prefix_depths`` as levels: depth -> the slots whose contiguous depth is exactly that.

    Returns:
        ``(levels, max_depth)``: ``{depth: slot mask}`` (depths ``>= 1``, disjoint non-zero masks) and the largest
        depth (0 when nobody holds block 0). The walk stops at the first position no slot continues through.
    """
    acc = list(takewhile(bool, accumulate(masks, and_)))
    levels: dict[int, int] = {}
    if not acc:
        return levels, 0
    pos = 0
    prev = 0
    for value, run in groupby(acc):
        if pos:
            levels[pos] = prev ^ value  # the bits leaving here (``value`` is a subset of ``prev``)
        pos += sum(1 for _ in run)
        prev = value
    levels[pos] = prev
    return levels, pos


def jump_levels(
    id_of: Callable[[int, int], int], masks: Sequence[int], hashes: Sequence[int], mask: int
) -> dict[int, int]:
    """Depths of slots whose bits are monotone along ``hashes``, by binary search over positions, as levels.

    Precondition (not checked): every bit of ``mask`` is set at position 0 and, once clear at some position,
    stays clear at every later one (true for slots without gaps along a hash chain, ``router.index.state``).
    Positions between two probes with equal masks are never read: the cost is 2 lookups when every slot
    holds all of ``hashes``, plus at most ``2 * ceil(log2 n)`` per distinct depth, whatever the number of slots.

    Args:
        id_of: ``dict.get`` of the block hash -> id table (called as ``id_of(block_hash, 0)``; id 0 must have
            mask 0).
        masks: the lane's holder masks, indexed by id.
        hashes: ``[n]`` block hashes, root-most first (``n >= 1``).
        mask: the slots to place (a subset of the holders of ``hashes[0]``).

    Returns:
        depth -> mask of the slots of ``mask`` that hold exactly the first ``depth`` positions (disjoint masks).
    """
    num_blocks = len(hashes)
    levels: dict[int, int] = {}
    last = masks[id_of(hashes[num_blocks - 1], 0)] & mask
    if last:
        levels[num_blocks] = last
    if last == mask:
        return levels
    # Intervals (lo, lo_mask, hi, hi_mask) with hi_mask a strict subset of lo_mask: bits leave in (lo, hi].
    stack = [(0, mask, num_blocks - 1, last)]
    while stack:
        lo, lo_mask, hi, hi_mask = stack.pop()
        if hi - lo == 1:
            levels[hi] = lo_mask ^ hi_mask  # intervals are disjoint: each ``hi`` is reached once
            continue
        mid = (lo + hi) >> 1
        mid_mask = (masks[id_of(hashes[mid], 0)] & lo_mask) | hi_mask
        if mid_mask != lo_mask:
            stack.append((lo, lo_mask, mid, mid_mask))
        if mid_mask != hi_mask:
            stack.append((mid, mid_mask, hi, hi_mask))
    return levels


MIN_RUN_PROBE = 8
MAX_RUN_PROBE = 256
"""Positions ``walk_levels`` tries to read as one run of consecutive ids (then bisects to the part that matches):
``MIN_RUN_PROBE`` first, doubling with each run up to ``MAX_RUN_PROBE`` (a walk that ends early reads little past
its end; a long one reads few runs)."""


def _run_length(hash_of: list[int], entry_id: int, window: list[int]) -> int:
    """How many leading positions of ``window`` (the prompt's hashes from some position on, ``entry_id`` the id of
    its first) have the consecutive ids ``entry_id, entry_id + 1, ...`` (``>= 1``): one list comparison when all
    of them do."""
    run = len(window)
    if hash_of[entry_id : entry_id + run] == window:
        return run
    lo, hi = 1, run  # hashes match for ``lo`` positions, not for ``hi``
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if hash_of[entry_id + lo : entry_id + mid] == window[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def walk_levels(
    id_of: Callable[[int, int], int], hash_of: list[int], masks: Sequence[int], hashes: Sequence[int], mask: int
) -> dict[int, int]:
    """``prefix_levels`` of ``masks[id] & mask`` along ``hashes``, for slots whose bits may have gaps.

    The walk reads positions in runs whose ids are consecutive (a chain stored in one go has consecutive ids,
    ``router.index.state``; a run is recognized by comparing ``hash_of[id : id + k]`` with the prompt's hashes,
    one list comparison): each run's masks are one slice and their AND-accumulation one C-level pass, and where
    the accumulation changes is found by bisection (it only loses bits, so it never grows as a number). Stops at
    the first position no slot of ``mask`` continues through.

    Args:
        id_of: ``dict.get`` of the block hash -> id table (``id_of(block_hash, 0)``; id 0 has mask 0).
        hash_of: id -> block hash.
        masks: the lane's holder masks, indexed by id.
        hashes: ``[n]`` block hashes, root-most first.
        mask: the slots to place (a subset of the holders of ``hashes[0]``).

    Returns:
        depth -> mask of the slots of ``mask`` whose contiguous depth is exactly ``depth`` (disjoint masks).
    """
    num_blocks = len(hashes)
    levels: dict[int, int] = {}
    acc = mask
    pos = 0
    probe = MIN_RUN_PROBE
    while pos < num_blocks:
        entry_id = id_of(hashes[pos], 0)
        if not entry_id:
            break
        window = hashes[pos : pos + probe]
        if probe < MAX_RUN_PROBE:
            probe <<= 1
        run = _run_length(hash_of, entry_id, window if type(window) is list else list(window))
        accs = list(accumulate(map(and_, masks[entry_id : entry_id + run], repeat(acc)), and_))
        k = 0
        while True:
            k = bisect_right(accs, -acc, k, run, key=neg)  # the first offset that lost a bit of ``acc``
            if k == run:
                break
            value = accs[k]
            if pos + k:
                levels[pos + k] = acc ^ value
            acc = value
            if not acc:
                return levels
        pos += run
    if acc and pos:
        levels[pos] = acc
    return levels


def jump_depths(
    id_of: Callable[[int, int], int], masks: Sequence[int], hashes: Sequence[int], mask: int
) -> dict[int, int]:
    """``jump_levels`` per slot: slot bit -> number of leading positions it holds, for every bit of ``mask``."""
    return {bit: depth for depth, holders in jump_levels(id_of, masks, hashes, mask).items()
            for bit in iter_bits(holders)}


def levels_of(depths: dict[int, int]) -> dict[int, int]:
    """Per-slot depths (slot bit -> depth) as levels (depth -> slot mask); zero depths are left out."""
    levels: dict[int, int] = {}
    for bit, depth in depths.items():
        if depth:
            levels[depth] = levels.get(depth, 0) | (1 << bit)
    return levels


def deepest_first(levels: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """Levels as ``((depth, mask), ...)``, deepest first."""
    return tuple(sorted(levels.items(), reverse=True))


def position_bitsets(masks: Sequence[int]) -> dict[int, int]:
    """Transpose per-position holder masks into per-slot position bitsets.

    Args:
        masks: ``[n]`` holder masks.

    Returns:
        slot bit -> bitset of the positions it holds.
    """
    out: dict[int, int] = {}
    for pos, mask in enumerate(masks):
        if not mask:
            continue
        flag = 1 << pos
        for bit in iter_bits(mask):
            out[bit] = out.get(bit, 0) | flag
    return out


def _trailing_ones(bits: int) -> int:
    return (~bits & (bits + 1)).bit_length() - 1


def usable_lengths(held: int, spec: GroupSpec, num_blocks: int, block_size: int) -> int:
    """Prefix lengths (in blocks) one cache group can serve, as a bitset over ``L in [0, num_blocks]``.

    Args:
        held: bitset of the positions the slot holds in this group.
        spec: the group's kind (and window).
        num_blocks: prompt length in blocks.
        block_size: tokens per block.

    Returns:
        Bitset with bit ``L`` set when the group can serve the prefix of ``L`` blocks (bit 0 always set).
    """
    all_lengths = (1 << (num_blocks + 1)) - 1
    depth = min(_trailing_ones(held), num_blocks)
    if spec.kind is GroupKind.FULL:
        return (1 << (depth + 1)) - 1
    if spec.kind is GroupKind.RECURRENT:
        return ((held << 1) | 1) & all_lengths
    window = spec.num_window_blocks(block_size)
    if window <= 0:
        return all_lengths
    # runs[j] set when blocks j .. j + window - 1 are all held (AND of shifts, by doubling).
    runs = held
    span = 1
    while span < window:
        step = min(span, window - span)
        runs &= runs >> step
        span += step
    short = (1 << (min(depth, window - 1) + 1)) - 1
    return ((runs << window) | short) & all_lengths


def hybrid_prefix_len(
    held_by_group: Sequence[int], specs: Sequence[GroupSpec], num_blocks: int, block_size: int
) -> int:
    """Longest prefix (in blocks) that every cache group can serve.

    Args:
        held_by_group: per group, the slot's position bitset.
        specs: per group, its spec (same order).
        num_blocks: prompt length in blocks.
        block_size: tokens per block.

    Returns:
        The largest ``L`` usable by all groups (0 when none).
    """
    ok = (1 << (num_blocks + 1)) - 1
    for held, spec in zip(held_by_group, specs, strict=True):
        ok &= usable_lengths(held, spec, num_blocks, block_size)
    return ok.bit_length() - 1
