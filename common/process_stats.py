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
  Without tracing the report says so (``is_tracing: false``) and lists nothing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

MAX_REPORT_SITES = 1000
"""Most allocation sites one ``memory_report`` lists."""


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


def memory_report(limit: int = 25) -> dict[str, Any]:
    """The top ``limit`` allocation sites (file and line) of a ``tracemalloc`` snapshot, largest first.

    Args:
        limit: sites to list, clamped to ``0 .. MAX_REPORT_SITES``; 0 takes no snapshot (a snapshot of a large
            heap takes seconds) and reports the traced byte counts only.

    Returns:
        ``{"is_tracing", "traced_bytes", "peak_traced_bytes", "num_gc_objects", "sites": [{"file", "line",
        "size_bytes", "num_blocks"}, ...]}``; ``sites`` is empty and the byte counts 0 when tracing is off.
        Frames of ``tracemalloc`` and of this module's snapshot are filtered out.
    """
    limit = max(0, min(MAX_REPORT_SITES, limit))
    report: dict[str, Any] = {
        "is_tracing": tracemalloc.is_tracing(),
        "traced_bytes": 0,
        "peak_traced_bytes": 0,
        "num_gc_objects": len(gc.get_objects()),
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
    sites = []
    for stat in snapshot.statistics("lineno")[:limit]:
        frame = stat.traceback[0]
        sites.append({"file": frame.filename, "line": frame.lineno, "size_bytes": stat.size,
                      "num_blocks": stat.count})
    report["sites"] = sites
    return report
