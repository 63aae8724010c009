"""The zero-padding check of long chunk ranges (``workers.kv.pool_chunk``), exact and spread over threads.

A restored chunk's padding is checked byte for byte: each range is read as 64-bit words and its maximum compared
with zero (numpy's ``maximum.reduce`` on a ``uint64`` view: exact, about as fast as a ``memcmp`` of the bytes
against a cached zero slab, and it releases the GIL over the array, so the range is read on several cores at once
and the restore's read ahead, the Mooncake client's call on another thread, is never held up by it), the few
bytes before the first aligned word and after the last one compared as bytes. ``xxh3_128`` (the check before)
holds the GIL for the whole range: one core, and the next batch's read waits behind it for its Python parts.

A range longer than ``SLICE_BYTES`` is cut into slices of about that size; a run's slices are split into
``num_threads`` contiguous groups, one checked by the calling thread and the others on a pool of its own
(``num_threads - 1`` threads; none with one), so a 128 MiB object is checked in parallel though it is one read.
"""

from __future__ import annotations

import os
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np

SLICE_BYTES = 2 << 20
"""Bytes of a range checked by one reduction at most (a 2 MiB slice: 150 us at 14 GB/s, beside a 2-5 us call)."""
MAX_CHECK_THREADS = 8
"""Threads a check uses at most (memory bandwidth, not cores, bounds the check past a few)."""


def default_check_threads(cores: int | None = None) -> int:
    """Threads for the check on this host: half the cores this process may run on (``os.sched_getaffinity``; the
    other half for the Mooncake transfer's threads and the engine), at least 1 and at most ``MAX_CHECK_THREADS``.
    ``cores``: the count to size from instead (tests)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_CHECK_THREADS, cores // 2))


def _nonzero_slices(words: np.ndarray, slices: list[tuple[int, int, int]]) -> list[int]:
    """The rows of the ``(row, first word, end word)`` slices of ``words`` holding a nonzero word."""
    return [row for row, lo, hi in slices if words[lo:hi].max()]


class ZeroCheck:
    """Checks that ranges of a buffer are all zero bytes, on ``num_threads`` threads (module docstring).

    Raises:
        ValueError: ``num_threads`` not positive.
    """

    def __init__(self, num_threads: int = 1) -> None:
        if num_threads <= 0:
            raise ValueError(f"num_threads must be positive, not {num_threads}")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads - 1, "pool-check") if num_threads > 1 else None

    def rows(self, data: bytearray, offset: int, num: int, step: int, lo: int, hi: int) -> np.ndarray | None:
        """Whether bytes ``lo .. hi - 1`` of each of ``num`` rows of ``step`` bytes from ``data[offset:]`` are all
        zero: ``None`` when every row's are, else a bool per row. ``hi - lo`` should be at least a few words (the
        ranges ``ChunkLayout`` checks here are 64 KiB or more)."""
        flat = np.frombuffer(data, np.uint8)
        skew = -flat.ctypes.data % 8  # the first 8-byte aligned byte of data
        words = flat[skew : skew + (len(flat) - skew) // 8 * 8].view(np.uint64)
        per = max(1, SLICE_BYTES // 8)
        slices: list[tuple[int, int, int]] = []
        bad: set[int] = set()
        for j in range(num):
            start, end = offset + j * step + lo, offset + j * step + hi
            w0, w1 = -(-(start - skew) // 8), (end - skew) // 8
            if w1 <= w0:  # shorter than a word or two: the bytes themselves
                if flat[start:end].any():
                    bad.add(j)
                continue
            if flat[start : skew + 8 * w0].any() or flat[skew + 8 * w1 : end].any():
                bad.add(j)
            slices += [(j, w, min(w + per, w1)) for w in range(w0, w1, per)]
        pool = self._pool
        groups = min(self.num_threads, len(slices))
        if pool is not None and groups > 1:
            cuts = [len(slices) * g // groups for g in range(groups + 1)]
            futures: list[tuple[Future[list[int]] | None, list[tuple[int, int, int]]]] = []
            for a, b in zip(cuts[1:-1], cuts[2:], strict=True):
                try:
                    futures.append((pool.submit(_nonzero_slices, words, slices[a:b]), slices[a:b]))
                except RuntimeError:  # closed (the tier shutting down while a read still checks): here instead
                    futures.append((None, slices[a:b]))
            bad.update(_nonzero_slices(words, slices[: cuts[1]]))
            for future, part in futures:
                try:
                    bad.update(_nonzero_slices(words, part) if future is None else future.result())
                except CancelledError:  # closed with it queued
                    bad.update(_nonzero_slices(words, part))
        else:
            bad.update(_nonzero_slices(words, slices))
        if not bad:
            return None
        zero = np.ones(num, bool)
        zero[sorted(bad)] = False
        return zero

    def close(self) -> None:
        """Stop the pool's threads (a check running ends on its own; later ones run on the calling thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
