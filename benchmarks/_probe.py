"""Watching gateway and worker processes from outside, for the soak and chaos runs.

Everything is read over HTTP on 127.0.0.1, as an operator would: ``/metrics`` (the ``process_*`` series and
``kvgate_process_asyncio_tasks`` of ``common.process_stats``, the gateway's index and in-flight gauges), the
worker's ``/load`` and ``/kv/snapshot``, the gateway's admin REST (``/admin/...``). Nothing here imports the
gateway's internals.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from events.counters import EventCounters
from events.decode import EventDecoder
from events.types import AllBlocksCleared, BlockStored

HTTP_TIMEOUT_S = 60.0
"""Limit of one probe request (a tracemalloc snapshot of a large heap takes seconds on a busy host)."""


class ProcessSample(msgspec.Struct):
    """One reading of one process.

    Attributes:
        t_s: seconds since the run started.
        rss_bytes: ``process_resident_memory_bytes``.
        num_fds: ``process_open_fds``.
        num_tasks: ``kvgate_process_asyncio_tasks``.
        num_entries: the gateway: (block, worker, medium) holdings in its index (sum of ``kvgate_index_blocks``);
            a worker: its cached GPU blocks (``/load``'s ``num_gpu_cached_blocks``).
        phase: the run's phase when it was taken (``"baseline"``, ``"load"``, ``"cleared"``...).
    """

    t_s: float
    rss_bytes: float
    num_fds: float
    num_tasks: float
    num_entries: float
    phase: str


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> ``{sample name: [(labels, value), ...]}``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """Sum of every sample named ``name`` (0 when absent)."""
    return sum(value for _, value in metrics.get(name, ()))


async def get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    """GET ``url`` as JSON.

    Raises:
        aiohttp.ClientError: not reachable or not 2xx.
        TimeoutError: no answer within ``timeout_s``.
    """
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return await resp.json()


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``base_url``'s ``/metrics``, parsed."""
    async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        return parse_metrics(await resp.text())


async def sample_gateway(session: aiohttp.ClientSession, url: str, t_s: float, phase: str) -> ProcessSample:
    """One ``ProcessSample`` of the gateway at ``url``."""
    m = await scrape(session, url)
    return ProcessSample(t_s, total(m, "process_resident_memory_bytes"), total(m, "process_open_fds"),
                         total(m, "kvgate_process_asyncio_tasks"), total(m, "kvgate_index_blocks"), phase)


async def sample_worker(session: aiohttp.ClientSession, url: str, t_s: float, phase: str) -> ProcessSample:
    """One ``ProcessSample`` of the worker at ``url``."""
    m = await scrape(session, url)
    load = await get_json(session, url + "/load")
    return ProcessSample(t_s, total(m, "process_resident_memory_bytes"), total(m, "process_open_fds"),
                         total(m, "kvgate_process_asyncio_tasks"), float(load["num_gpu_cached_blocks"]), phase)


async def worker_truth(session: aiohttp.ClientSession, url: str, worker_id: str) -> dict[str, int]:
    """How many blocks a worker holds, per medium (``"GPU"``, ``"CPU"``), from its ``/kv/snapshot``."""
    async with session.get(url + "/kv/snapshot", timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        body = await resp.read()
    batch = EventDecoder(EventCounters()).decode(body, worker_id=worker_id, seq=0)
    held: dict[str, set[object]] = {}
    for event in batch.events if batch is not None else ():
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            held.setdefault(str(event.medium), set()).update(event.block_hashes)
    return {medium: len(hashes) for medium, hashes in held.items() if hashes}


def gateway_holdings(metrics: Mapping[str, list[tuple[dict[str, str], float]]]) -> dict[str, dict[str, int]]:
    """``kvgate_index_blocks{worker,medium}`` as ``{worker: {medium: blocks}}`` (zero counts left out)."""
    out: dict[str, dict[str, int]] = {}
    for labels, value in metrics.get("kvgate_index_blocks", ()):
        if value:
            out.setdefault(labels.get("worker", ""), {})[labels.get("medium", "")] = int(value)
    return out


async def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.25) -> bool:
    """Await ``predicate()`` (an async callable returning bool) until true or ``timeout_s``; returns the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)


def rss_curve(samples: Sequence[ProcessSample]) -> str:
    """``start / min-max of the load plateau / after clears`` in MiB, for the report."""
    def mib(x: float) -> str:
        return f"{x / 2**20:.1f}"
    base = [s.rss_bytes for s in samples if s.phase == "baseline"]
    plateau = [s.rss_bytes for s in samples if s.phase == "plateau"]
    after = [s.rss_bytes for s in samples if s.phase == "cleared"]
    parts = [f"start {mib(base[-1])}" if base else "start -"]
    parts.append(f"plateau {mib(min(plateau))}-{mib(max(plateau))}" if plateau else "plateau -")
    parts.append(f"after clears {mib(after[-1])}" if after else "after clears -")
    return " / ".join(parts) + " MiB"


def _tcp_remote_ports(pid: int) -> dict[str, int]:
    """Socket inode -> remote TCP port, from the process's view of ``/proc/net/tcp`` and ``tcp6``."""
    out: dict[str, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as table:
                next(table)
                for line in table:
                    fields = line.split()
                    out[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
        except OSError:
            continue
    return out


def describe_fds(pid: int, names: Mapping[int, str]) -> dict[str, int]:
    """A process's open descriptors by kind (Linux ``/proc``): TCP sockets by their peer (``names`` maps a port to
    a process name; 0 is a listening socket), other sockets, pipes, files; empty when it cannot be read."""
    ports = _tcp_remote_ports(pid)
    counts: dict[str, int] = {}
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return counts
    for entry in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if target.startswith("socket:["):
            port = ports.get(target[8:-1])
            kind = "socket (not TCP)" if port is None else f"tcp to {names.get(port, port)}"
        else:
            kind = target.split(":", 1)[0] if ":" in target else "file"
        counts[kind] = counts.get(kind, 0) + 1
    return counts
