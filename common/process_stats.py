"""What a long-running process holds: resident memory, open descriptors, asyncio tasks, traced allocations.

Both the gateway and the reference worker expose these, so a soak or chaos run can watch them from outside:

* ``register_process_collectors(registry)`` adds, to a per-app ``CollectorRegistry``, ``prometheus_client``'s
  standard ``process_*`` series (``process_resident_memory_bytes``, ``process_open_fds``, ``process_max_fds``,
  CPU seconds; read from ``/proc/self`` at scrape time, Linux only) and ``kvgate_process_asyncio_tasks`` (the tasks
  of the event loop the scrape runs on, ``asyncio.all_tasks()``; 0 outside a loop).
* ``memory_report(limit)`` is the body of the debug memory endpoints (``GET /admin/debug/memory`` on the
  gateway, ``GET /debug/memory`` on the worker): the top allocation sites of a ``tracemalloc`` snapshot, by
  bytes still allocated. Tracing costs CPU and memory, so it is never switched on here: start the process with
  ``PYTHONTRACEMALLOC=<frames>`` (or ``python -X tracemalloc=<frames>``) to get it from the first allocation.
  Without tracing the report says so (``is_tracing: false``) and lists nothing. The report also gives the C heap
  as glibc's allocator sees it (``malloc_stats``: bytes in use and bytes free but kept), whatever the tracing, and
  ``?trim=1`` returns the free pages to the kernel first (``malloc_trim``). Both are glibc's: under a preloaded
  jemalloc (``ALLOCATOR``) the heap figures are ``None`` and the trim a no-op.
* ``malloc_trim()`` hands glibc's free heap pages back to the kernel (``malloc_trim(0)``, glibc 2.8+): after a large
  release (a worker removed, an index cleared) the freed small blocks sit in the allocator's arenas, counted in RSS,
  until then. A no-op returning ``False`` on another C library.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import tracemalloc
from collections.abc import Iterator, Mapping
from typing import Any, cast

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

MAX_REPORT_SITES = 1000
"""Most allocation sites one ``memory_report`` lists."""


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+, ``malloc.h``): every field a ``size_t``."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load_libc() -> ctypes.CDLL | None:
    """glibc, when it is also the process's ``malloc``; ``None`` off Linux, on another C library, or when another
    allocator replaces glibc's (``LD_PRELOAD=libjemalloc.so.2``): ``malloc_trim`` and ``mallinfo2`` then still
    resolve to glibc's, which see only glibc's own, unused, arena (``ALLOCATOR``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
        process = ctypes.CDLL(None)  # the global scope: a preloaded allocator's malloc comes first
        libc_malloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        process_malloc = ctypes.cast(process.malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return libc if libc_malloc == process_malloc else None


def _allocator_name() -> str:
    if _LIBC is not None:
        return "glibc"
    try:
        ctypes.CDLL(None).mallctl  # noqa: B018 - jemalloc's control interface
    except (OSError, AttributeError):
        return "other"
    return "jemalloc"


_LIBC = _load_libc()

ALLOCATOR = _allocator_name()
"""The C allocator behind this process's ``malloc``: ``"glibc"`` (``malloc_stats`` and ``malloc_trim`` act),
``"jemalloc"`` (preloaded: it returns freed pages by its own decay, ``MALLOC_CONF``; both are no-ops) or
``"other"``."""


def malloc_stats() -> dict[str, int] | None:
    """glibc's view of the C heap (``mallinfo2``), every arena summed, or ``None`` without glibc 2.33+ or when glibc
    is not the process's ``malloc`` (``ALLOCATOR``).

    Returns:
        ``{"arena_bytes"`` (bytes the main and thread arenas took from the kernel), ``"mmap_bytes"`` (large blocks
        mapped on their own), ``"in_use_bytes"`` (allocated and not freed), ``"free_bytes"`` (freed but kept in
        the arenas: counted in RSS where the pages were touched), ``"releasable_bytes"`` (free at the top of the
        main arena)``}``.
    """
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"arena_bytes": info.arena, "mmap_bytes": info.hblkhd, "in_use_bytes": info.uordblks,
            "free_bytes": info.fordblks, "releasable_bytes": info.keepcost}


JEMALLOC_STATS = ("allocated", "active", "resident", "mapped", "retained")
"""jemalloc's ``stats.*`` figures ``jemalloc_stats`` reads (``man jemalloc``): bytes allocated by the application,
in active pages, resident (data and metadata), mapped, and retained (unmapped from RSS, kept as address space)."""


def _mallctl_refreshed() -> Any:
    """jemalloc's ``mallctl`` with its statistics refreshed (an ``epoch`` write, ``man jemalloc``); ``None`` when
    the refresh fails (a build without statistics)."""
    mallctl = ctypes.CDLL(None).mallctl
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                        ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    epoch = ctypes.c_uint64(1)
    if mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch)) != 0:
        return None
    return mallctl


def jemalloc_stats() -> dict[str, int] | None:
    """jemalloc's view of the C heap (``mallctl("stats.<name>")`` after an ``epoch`` refresh), ``<name>_bytes`` for
    each of ``JEMALLOC_STATS``; ``None`` unless ``ALLOCATOR`` is ``"jemalloc"`` (a build without statistics
    answers an error, also ``None``)."""
    if ALLOCATOR != "jemalloc":
        return None
    mallctl = _mallctl_refreshed()
    if mallctl is None:
        return None
    out: dict[str, int] = {}
    for name in JEMALLOC_STATS:
        value = ctypes.c_size_t(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        if mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return None
        out[f"{name}_bytes"] = value.value
    return out


JEMALLOC_MAX_BINS = 64
"""Size classes ``memory_report`` lists (jemalloc 5 has 36 small ones with 4 KiB pages: every one)."""

_ARENAS_ALL = 4096
"""jemalloc's ``MALLCTL_ARENAS_ALL``: the arena index whose ``stats.arenas.<i>.*`` merge every arena."""


def _mallctl_read(mallctl: Any, name: str, ctype: Any) -> int | None:
    value = ctype(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return int(value.value)


def jemalloc_bins(limit: int = 8) -> list[dict[str, int]] | None:
    """jemalloc's small size classes (``man jemalloc``: ``arenas.bin.<j>.*``, ``stats.arenas.<i>.bins.<j>.*``,
    every arena merged) with the most bytes in slabs but not allocated: where freed regions are kept because a
    live region shares their slab (its pages stay active). ``None`` unless ``ALLOCATOR`` is ``"jemalloc"`` or
    when a figure cannot be read (a build without statistics).

    Returns:
        At most ``limit`` items, most idle bytes first: ``{"region_bytes"`` (the class's size), ``"num_regions"``
        (allocated now), ``"num_slabs"`` (slabs now), ``"slab_bytes"`` (``num_slabs`` times a slab's size),
        ``"idle_bytes"`` (``slab_bytes`` less the allocated regions' bytes)``}``.
    """
    if ALLOCATOR != "jemalloc":
        return None
    mallctl = _mallctl_refreshed()
    num_bins = None if mallctl is None else _mallctl_read(mallctl, "arenas.nbins", ctypes.c_uint)
    if mallctl is None or num_bins is None:
        return None
    out = []
    for j in range(num_bins):
        figures = [_mallctl_read(mallctl, name, ctypes.c_size_t) for name in (
            f"arenas.bin.{j}.size", f"arenas.bin.{j}.slab_size", f"stats.arenas.{_ARENAS_ALL}.bins.{j}.curregs",
            f"stats.arenas.{_ARENAS_ALL}.bins.{j}.curslabs")]
        if any(f is None for f in figures):
            return None
        region, slab, num_regions, num_slabs = cast(list[int], figures)
        out.append({"region_bytes": region, "num_regions": num_regions, "num_slabs": num_slabs,
                    "slab_bytes": num_slabs * slab, "idle_bytes": num_slabs * slab - num_regions * region})
    out.sort(key=lambda b: -b["idle_bytes"])
    return out[:max(0, limit)]


def malloc_trim() -> bool:
    """Return glibc's free heap pages to the kernel (``malloc_trim(0)``: every arena, not only the top of the main
    one); ``True`` when some memory was released, ``False`` when none was or glibc is not the process's
    ``malloc`` (``ALLOCATOR``: a preloaded jemalloc's heap is not glibc's to trim). Takes
    about a millisecond per 100 MiB of arena on an idle heap (it walks the free lists), so call it after large
    releases, not per request."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


class AsyncioTasksCollector(Collector):
    """``kvgate_process_asyncio_tasks``: tasks not yet done on the running event loop, at scrape time."""

    def collect(self) -> Iterator[Metric]:
        try:
            num_tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside an event loop (a test calling render() directly)
            num_tasks = 0
        family = GaugeMetricFamily("kvgate_process_asyncio_tasks", "Asyncio tasks not yet done on the event loop.")
        family.add_metric([], float(num_tasks))
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


def register_process_collectors(registry: CollectorRegistry) -> None:
    """Add the ``process_*`` series and ``kvgate_process_asyncio_tasks`` to ``registry`` (module docstring)."""
    ProcessCollector(registry=registry)
    registry.register(AsyncioTasksCollector())


def memory_report(
    limit: int = 25, *, group_by: str = "lineno", trim: bool = False, collect: bool = False
) -> dict[str, Any]:
    """The top ``limit`` allocation sites of a ``tracemalloc`` snapshot, largest first, and the C heap's state.

    Args:
        limit: sites to list, clamped to ``0 .. MAX_REPORT_SITES``; 0 takes no snapshot (a snapshot of a large
            heap takes seconds) and reports the byte counts only.
        group_by: ``"lineno"`` (a site is the line that allocated) or ``"traceback"`` (the whole traced stack: the
            process must trace more than one frame, ``PYTHONTRACEMALLOC=N``).
        trim: ``malloc_trim`` before reading the heap (``malloc`` then shows what trimming could not return).
        collect: a full garbage collection (``gc.collect()``) first, its unreachable objects in
            ``num_collected``: what reference cycles held until the collector's next oldest-generation pass (an idle
            process allocates too little to reach one), told apart from what is still referenced.

    Returns:
        ``{"is_tracing", "traced_bytes", "peak_traced_bytes", "num_gc_objects", "num_collected" (``None``
        without ``collect``), "allocator": ALLOCATOR,
        "malloc": malloc_stats() | None, "jemalloc": jemalloc_stats() | None, "jemalloc_bins": jemalloc_bins() | None,
        "trimmed": bool, "sites": [{"file", "line", "size_bytes", "num_blocks", "stack": [...]}, ...]}``; ``sites``
        is empty and the traced byte counts 0 when tracing is off; ``stack`` (``"file:line"`` items, innermost
        first) only with ``group_by="traceback"``. Frames of ``tracemalloc`` and of this module's snapshot are
        filtered out.

    Raises:
        ValueError: ``group_by`` is not one of ``GROUP_BYS``.
    """
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be 'lineno' or 'traceback', got {group_by[:40]!r}")
    limit = max(0, min(MAX_REPORT_SITES, limit))
    num_collected = gc.collect() if collect else None
    trimmed = malloc_trim() if trim else False
    report: dict[str, Any] = {
        "is_tracing": tracemalloc.is_tracing(),
        "traced_bytes": 0,
        "peak_traced_bytes": 0,
        "num_gc_objects": len(gc.get_objects()),
        "num_collected": num_collected,
        "allocator": ALLOCATOR,
        "malloc": malloc_stats(),
        "jemalloc": jemalloc_stats(),
        "jemalloc_bins": jemalloc_bins(JEMALLOC_MAX_BINS),
        "trimmed": trimmed,
        "sites": [],
    }
    if not tracemalloc.is_tracing():
        return report
    traced_bytes, peak_bytes = tracemalloc.get_traced_memory()
    report.update(traced_bytes=traced_bytes, peak_traced_bytes=peak_bytes)
    if limit == 0:
        return report
    snapshot = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"))
    )
    by_stack = group_by == "traceback"
    sites = []
    for stat in snapshot.statistics("traceback" if by_stack else "lineno")[:limit]:
        frame = stat.traceback[-1]  # the innermost frame (a ``Traceback`` runs oldest to most recent)
        site: dict[str, Any] = {"file": frame.filename, "line": frame.lineno, "size_bytes": stat.size,
                                "num_blocks": stat.count}
        if by_stack:
            site["stack"] = [f"{f.filename}:{f.lineno}" for f in reversed(stat.traceback)]
        sites.append(site)
    del snapshot
    report["sites"] = sites
    return report


class MemoryQueryError(ValueError):
    """A debug memory endpoint's query parameter that is not one it accepts.

    Attributes:
        param: the parameter's name (``"limit"``, ``"group_by"``, ``"trim"`` or ``"collect"``).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


GROUP_BYS = ("lineno", "traceback")
"""``group_by`` values ``memory_report`` accepts."""

TRIM_VALUES = {"true": True, "1": True, "false": False, "0": False}
"""``trim`` and ``collect`` values the debug memory endpoints accept (case-insensitive)."""


def parse_memory_query(query: Mapping[str, str], default_limit: int = 25) -> tuple[int, str, bool, bool]:
    """``(limit, group_by, trim, collect)`` of a debug memory endpoint's query (``GET /admin/debug/memory`` on the
    gateway, ``GET /debug/memory`` on the worker): ``limit`` a decimal integer (``default_limit`` when absent),
    ``group_by`` one of ``GROUP_BYS`` (``lineno`` when absent), ``trim`` and ``collect`` each one of
    ``TRIM_VALUES`` (false when absent).

    Raises:
        MemoryQueryError: a parameter present with any other value (its ``param`` names it).
    """
    raw_limit = query.get("limit")
    limit = default_limit
    if raw_limit is not None:
        try:
            limit = int(raw_limit)
        except ValueError:
            raise MemoryQueryError(f"limit must be an integer, got {raw_limit[:40]!r}", "limit") from None
    group_by = query.get("group_by", "lineno")
    if group_by not in GROUP_BYS:
        raise MemoryQueryError(f"group_by must be 'lineno' or 'traceback', got {group_by[:40]!r}", "group_by")
    raw_trim = query.get("trim", "false")
    trim = TRIM_VALUES.get(raw_trim.lower())
    if trim is None:
        raise MemoryQueryError(f"trim must be true or false, got {raw_trim[:40]!r}", "trim")
    raw_collect = query.get("collect", "false")
    collect = TRIM_VALUES.get(raw_collect.lower())
    if collect is None:
        raise MemoryQueryError(f"collect must be true or false, got {raw_collect[:40]!r}", "collect")
    return limit, group_by, trim, collect


def memory_report_for_query(query: Mapping[str, str], default_limit: int = 25) -> dict[str, Any]:
    """``memory_report`` for a debug endpoint's query (``parse_memory_query``).

    Raises:
        MemoryQueryError: a bad ``limit``, ``group_by``, ``trim`` or ``collect``.
    """
    limit, group_by, trim, collect = parse_memory_query(query, default_limit)
    return memory_report(limit, group_by=group_by, trim=trim, collect=collect)


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (``/proc/self/statm``), or ``None`` off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Returns glibc's free heap pages to the kernel after releases: every ``interval_s`` when the arenas' free
    bytes grew by at least ``min_free_bytes`` since the last trim, or at once after ``request()`` (a worker removed,
    an index cleared).

    CPython hands a large object's block back to ``malloc`` when it is freed, but glibc keeps freed chunks inside
    its arenas (one per thread that allocated: the event loop, the tokenizer threads, ZMQ's I/O thread) with their
    pages resident, so a process's RSS stays at its peak after its caches and tables shrink. ``malloc_trim`` runs
    in a thread (ctypes releases the GIL), so the event loop never waits for it. A trimmed chunk stays free in
    ``malloc``'s books (``mallinfo2`` counts it), hence the growth rule. Under another allocator (``ALLOCATOR``:
    a preloaded jemalloc returns pages by its own decay) every check is a no-op returning ``False``.

    Attributes:
        num_trims: trims that released memory.
        num_released_bytes: resident bytes those trims gave back (RSS before minus after, summed; other threads
            allocate meanwhile, so it is an estimate).
    """

    def __init__(self, interval_s: float, min_free_bytes: int) -> None:
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.num_trims = 0
        self.num_released_bytes = 0
        self._floor_free_bytes = 0
        self._wake: asyncio.Event | None = None

    def request(self) -> None:
        """Trim at the next chance (after a large release); a no-op when the loop is not running."""
        if self._wake is not None:
            self._wake.set()

    async def trim_once(self, *, force: bool = False) -> bool:
        """One check, and a trim when ``force`` or the arenas' free bytes grew by ``min_free_bytes`` since the last
        trim (the lowest figure seen since); ``True`` when it released memory."""
        stats = malloc_stats()
        if stats is None:
            return False
        free = stats["free_bytes"]
        self._floor_free_bytes = min(self._floor_free_bytes, free)
        if not force and free - self._floor_free_bytes < self.min_free_bytes:
            return False
        rss_before = resident_bytes()
        released = await asyncio.to_thread(malloc_trim)
        rss_after = resident_bytes()
        after = malloc_stats()
        self._floor_free_bytes = after["free_bytes"] if after is not None else free
        if released:
            self.num_trims += 1
            if rss_before is not None and rss_after is not None:
                self.num_released_bytes += max(0, rss_before - rss_after)
        return released

    async def run(self) -> None:
        """Check every ``interval_s`` (at once after ``request``) until cancelled; a failure is logged."""
        self._wake = asyncio.Event()
        try:
            while True:
                try:
                    # not ``asyncio.wait_for``: on Python 3.11 it swallows a cancel that arrives in the same loop
                    # turn as the wake (a clear's ``request`` then the gateway's shutdown), and shutdown then
                    # waited on this loop for good
                    async with asyncio.timeout(self.interval_s):
                        await self._wake.wait()
                    forced = True
                except TimeoutError:
                    forced = False
                self._wake.clear()
                try:
                    await self.trim_once(force=forced)
                except Exception:
                    logger.exception("heap trim failed")
        finally:
            self._wake = None
