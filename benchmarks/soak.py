"""Soak: memory, descriptors and tasks of the gateway and the sim workers over an hour of trace traffic.

Run ``python -m benchmarks soak`` (``--help`` for the knobs; ``--quick`` is the CI variant's size). Method:

1. A sim fleet as ``kvgate demo`` builds it (``loadgen.sizing.size_fleet`` on the bundled Mooncake slice,
   ``loadgen/data/conversation_trace_head.jsonl``: 1,000 requests over 330 s of trace) and one gateway
   (``session_sticky`` over ``cache_aware``, in-memory sessions whose idle timeout is the default 1,800 s scaled by
   ``--time-scale``), run as the README documents, under jemalloc (``common.allocator``) where
   ``libjemalloc.so.2`` is installed (``--allocator``: ``auto``, ``pymalloc``, ``malloc``, ``jemalloc``;
   ``--malloc-conf`` for jemalloc's options). Untraced by default: the RSS checks hold for an untraced process
   only (tracemalloc's traces and snapshots take memory of their own); ``--tracemalloc gateway`` (or ``all``)
   starts processes with ``PYTHONTRACEMALLOC=<--tracemalloc-frames>`` to see where memory goes.
2. Baseline: RSS, open descriptors, asyncio tasks and index entries of every process (``/metrics``, ``/load``),
   the gateway's C heap (glibc's ``mallinfo2``, or jemalloc's ``stats.*``), and when traced the traced Python
   bytes and top allocation sites (``/admin/debug/memory``, ``/debug/memory``).
3. Load: the slice repeated until ``--trace-hours`` of trace time, each repetition in a fresh prompt namespace
   (new blocks, new sessions), replayed open loop ``--time-scale`` times faster than the trace through
   ``loadgen.replay`` (at most ``--max-in-flight`` requests in flight; the replay ends at ``--max-duration-s``).
   Small worker caches make every request store and evict (``BlockStored`` / ``BlockRemoved``); beside it, every
   ``--churn-interval-s``, one of: the gateway clears a worker's index entries (``POST /admin/index/clear``, the
   worker then re-warms from its snapshot), or removes a worker and adds it back (``DELETE`` then ``POST
   /admin/workers``). Every ``--sample-interval-s`` each process is sampled.
4. Drain and clear: every worker's prefix cache is reset (``POST /reset_prefix_cache``: ``AllBlocksCleared``),
   the gateway's index must empty; then every worker is removed from the gateway; then a last sampling.

Checks (exit status 1 when one fails), on RSS as the kernel counts it: after warm-up (the first
``--warmup-fraction`` of the load), max/min of each process's RSS within ``--tolerance`` (10%); after the clears,
the gateway's index empty and each process's RSS within the tolerance of its baseline; descriptors and tasks
back to their baseline (+ ``--slack-fds`` / ``--slack-tasks``). Reported: the RSS curve (start, plateau, after
clears), bytes per indexed (block, worker) holding at the plateau (traced Python bytes and RSS, each over the
baseline) beside the index bench's figure measured here in-process (``benchmarks.index``'s memory fleet), the
top allocation sites at the plateau and after the clears, and ``soak.png`` (RSS and index entries over time)
with ``soak.json`` under ``--out``.

Measured before the memory work (a shared 2-core host, load average 10-15; ``--max-duration-s 720``, 3 workers x
16,384 blocks, the gateway traced): gateway RSS 150 MiB at the start, 364 -> 968 MiB over the load with no plateau,
973 MiB after the clears with the index empty; workers 99 -> 118-170 MiB, not back after their caches were reset.
Where it went (tracemalloc and glibc's ``mallinfo2`` through the debug memory endpoints, ``--tracemalloc-frames``
for whole stacks): each sim worker's replay buffer (10,000 steps of batches carrying every stored block's token ids:
+70 MiB in 150 s, unbounded in bytes); the gateway's prompt caches (bounded at 4 M block hashes and 64 M characters,
a few hundred MB at their caps; about 10 MiB of whole-prompt states in this trace); the index's tables at their peak
length after it emptied (about 12 MiB); tracemalloc's own traces and the snapshots of a traced heap; and freed chunks
kept by glibc's arenas (34 MiB of RSS returned by one ``malloc_trim`` after the clears).

Measured after it (same host at load 17-20, untraced, ``python -m benchmarks soak --max-duration-s 720``: 5,500
requests, 1,820 s of the hour's trace, 66 churn steps): gateway RSS 107 MiB at the start, plateau 215-270 MiB
(230-269 MiB over its second half, following the index's 30,000-100,000 holdings as the churn clears and re-warms
workers), 225 MiB after the clears with the index empty (C heap in use 25 -> 50 MiB, the rest Python's small-object
arenas, which stay mapped while any object in them lives): both gateway checks still fail (1.25, 2.09). Workers:
108 MiB -> 143-150 MiB -> 117-119 MiB (flat within 1.05, back within 1.09: pass), about 2,480 bytes of RSS per
cached GPU block (the replay buffer's 16 MiB is 1,024 of them). Gateway bytes per (block, worker) holding: 1,471 of
RSS over the baseline at 102,574 holdings, against the index bench's 112 (its published figure 143): the index is
not what holds the rest. Descriptors and tasks returned to their baselines on every process.

Found next (pymalloc's own books, ``sys._debugmallocstats``, beside ``mallinfo2`` and ``/proc/<pid>/smaps``, at
the baseline, the plateau and after the clears of ``--quick`` runs; the survivors by a tracemalloc diff taken 40 s
after the clears, once the traced gateway had finished its requests): the approximate-mode expiry queue kept every
cleared or removed slot's records until their TTL (120 s), each with its chain's block hashes and the slot, so a
removed slot's engine map and eviction journals (65,536 entries a journal) stayed too; ``session_sticky`` kept a
removed worker's resident sessions until their idle timeout, counted only at the next placement; the client header
memo kept up to 1,024 header blocks (a POST's block carries its ``Content-Length``: about one per request). With
those released (``--quick``): gateway 106.7 MiB at the start, plateau 166-178, 142-143 after the clears (1.33-1.34;
164, 1.54, before), Python's live small-object bytes 49.5 MB against 48.5 at the baseline and the C heap's in-use
bytes back at the baseline's 26.9 MB, yet 78 pymalloc arenas against 48: the 32- and 48-byte size classes (ints and
small tuples, the index's block hashes and keys at the peak) went from 98 and 194 pools to 535 and 563 at the peak,
and after the clears those pools hold 7,700 more blocks than at the baseline (values that live on after the load:
the traced diff names the decision ring's records and the policies' per-request values among them), one or two in
each pool, which keeps every arena they sit in mapped. Emptying the decision ring as well (tried, not kept: it is
the post-mortem of the last routes) took the 32-byte class to 600 blocks over the baseline and the live bytes to
48.7 MB, yet 79 arenas and 142.8 MiB stayed: pymalloc keeps the free pools of an arena still in use resident.
``PYTHONMALLOC=malloc`` (glibc for every object, trimmed) ends at 136.5 of 109.0 MiB (1.25): glibc's free chunks
between the same survivors are too small to give back. ``python -m benchmarks soak --max-duration-s
300`` (host at load 5-8: 7,451 requests, 2,470 s of the hour's trace, 43 churn steps, none failed): gateway 106.6 /
189.4-225.3 / 168.2 MiB (flat 1.19, back 1.58), its C heap in use 25.6 -> 53.6 -> 26.0 MiB; workers 107.0-107.2 /
142.3-147.9 / 117.2-117.9 MiB (1.035-1.038, 1.094-1.100: pass), about 2,540-2,600 bytes of RSS per cached GPU
block. Both gateway checks are still open: what is left is the allocator's fragmentation, not a holder.

The allocator, then (``--allocator``; ``--quick``, the same host at load 3-5, one run after another, 556 requests,
none failed; ratios are the two gateway checks, flat / back, of 1.10): CPython's pymalloc 106.6-106.9 / 160-184 /
142.4-144.1 MiB (1.092-1.097 / 1.333-1.348, 3 runs); ``PYTHONMALLOC=malloc`` over glibc, trimmed, 109.0-109.1 /
164-181 / 135.2-136.4 (1.089-1.095 / 1.240-1.252, 2 runs), its C heap in use 75.8 -> 124.9 -> 77.4 MB with 65.7 MB
free in the arenas after the clears; ``PYTHONMALLOC=malloc`` over a preloaded jemalloc 5.3 (Debian's libjemalloc2)
with ``background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0``: 109.7-110.2 / 161-177 / 123.7-124.0
(1.064-1.084 / 1.125-1.127, 2 runs; ``narenas:1`` besides: 1.085 / 1.124), jemalloc's own figures 76.2 MB allocated
and 76.9 active at the baseline, 78.6 allocated and 88.8 active after the clears: 10 MB of partly used slabs, of
which the thread caches hold part; the same with ``tcache:false`` (``common.allocator.JEMALLOC_CONF``, the default
here since then): 109.4-110.0 / 158-178 / 119.5-120.4 (1.040-1.085 / 1.093-1.096, 6 runs, with or without
``narenas:1``), 77.0 allocated and 85.3 active after the clears; with ``dirty_decay_ms:0`` as well, 1.108 / 1.099.
So under jemalloc without thread caches both gateway checks pass, by about 0.5-1 MiB of the 11 MiB the 10% allows
(two more runs: 1.079 / 1.098, 1.092 / 1.093; one of seven runs of the CI variant failed at 10%, whose gateway
bound is therefore 15%): what stays is slabs kept active by the survivors (allocated 75.8 -> 77.0 MB, active 76.4 ->
85.4 MB). ``python -m benchmarks.gateway --skip-decision --requests 2000`` (every process under each
allocator; kvgate's CPU per request, median of 3 rounds, non-streaming / streaming): pymalloc 442 / 640 µs, jemalloc
without thread caches (``narenas:1``) 492 / 588, with them 498 / 466, spreads of 30-150 µs: no difference above
this host's noise.

Found since (a 2-core host at load 2-4, untraced unless said, jemalloc's figures from ``/admin/debug/memory`` at each
phase, ``/proc/<pid>/smaps``, and tracemalloc snapshots of a traced gateway at the baseline, the plateau and after the
clears): the gateway's checks had slipped back as the request path grew (the hour: flat 1.136, back 1.196; ``--quick``:
110.9 / 149.6-172.1 / 130.0 MiB, 1.150 / 1.172; ``--max-duration-s 300``: 5,551 requests, 1,835 s of trace, 40 churn
steps, 111.2 / 186.6-205.3 / 134.3 MiB, 1.100 / 1.208, jemalloc allocated 76.1 -> 151.2 -> 79.0 MB and active 76.8 ->
159.3 -> 97.0). After the clears the allocated bytes were back within 1-3 MB of the baseline, so no holder was left:
what stayed was slabs kept active by the survivors of a peak that had grown. The largest part of that peak was the
honesty check's journals (``Slot.evicted``, ``Slot.confirmed``, the pool's): up to 65,536 entries each whatever decision
was still open to read them, about 6.8 MB a full one (its dict table and the stamps' ints; 13 MiB of the traced
``--quick`` plateau's 47 MiB over the baseline for two workers), halved in a sawtooth, and dropped then regrown whenever
the churn removed and re-added a worker. They now keep only the entries after the oldest decision still open
(``router.index.slots.Journal``: a ticket holds its stamp from its match until it goes, and a journal is rebuilt, a new
table, from the entries above that stamp once it reaches 4,096 entries). With that: ``--quick`` 109.9-110.0 /
154.1-168.7 / 119.7-119.9 MiB (1.068-1.082 / 1.088-1.090, 2 runs, both pass; allocated at the plateau 108.2-108.5 MB
against 124-125 before); ``--max-duration-s 300`` (2 runs: 6,477 and 7,013 requests, 2,145 and 2,320 s of trace, 43 and
45 churn steps, none failed): 110.1 / 162.2-181.1 and 166.1-180.9 / 126.2 and 127.0 MiB (flat 1.117 and 1.089, back
1.146 and 1.153: the flat check passes once of two, the back check fails), allocated 76.2 -> 116.8-120.6 -> 79.0-79.2
MB, active 76.8 -> 125.0-127.0 -> 90.5-91.3, RSS per (block, worker) holding at the plateau 757 bytes (1,130 before).
What is left there: 11.5-12 MB of slabs the survivors keep active after the clears (allocated +2.8-3.0 MB), and at the
plateau 14-19 MB of freed pages jemalloc has not purged yet (resident 141.4-144.4 MB against 125.0-127.0 active), which
rise and fall with the churn's bursts. With ``dirty_decay_ms:0`` besides (``--malloc-conf``; one 300 s run, 7,226
requests, 2,398 s of trace): 110.1 / 158.5-173.6 / 126.8 MiB (1.096 / 1.152), unpurged pages at the plateau 7 MB
(resident 133.8 against 126.7 active), the slabs after the clears as before (allocated 79.3, active 91.1 MB): a flatter
plateau on one run, not yet made the default.

Then the survivors themselves (a 2-core host at load 2-5; ``--tracemalloc gateway``, whose baseline and after-clears
reports list 1,000 sites each and the report prints the sites that grew most between them; ``collect=true`` on the
debug endpoint, a full garbage collection first; jemalloc's per size class regions and slabs, ``jemalloc_bins``):
a traced gateway that is not overloaded (``--quick --time-scale 10 --max-in-flight 6 --max-duration-s 200``, 556
requests, none failed) holds 1.1 MB (20,316 blocks) of Python values more than at its baseline after the clears,
almost all the decision ring's records (``num_recent_decisions`` 1,024 in ``loadgen.fleet``: some 40 ints, floats
and short tuples a record) and nothing of the index, the sessions or the prompt caches; a traced run that overloads
the gateway (failed requests, a tokenizer backlog) shows its requests still in flight instead. Reference cycles
hold 156-218 objects. So the 11.5-12 MB were jemalloc's slabs in the 32-, 48- and 64-byte classes kept active by
those records' values (after a 300 s run: 2-3 MB of idle slab bytes in each). The ring now keeps a record as one
msgpack buffer (``router.decisions.DecisionRing``) and jemalloc's slabs up to 160 bytes are one page
(``common.allocator.JEMALLOC_CONF``). ``python -m benchmarks soak --max-duration-s 300``, before (10,891 requests
in 247 s, 40 churn steps): 110.4 / 176.9-192.5 / 129.2 MiB (flat 1.088, back 1.170), allocated 76.3 -> 79.4 MB and
active 77.0 -> 93.2 after the clears; after (2 runs, the host busier: 10,834 and 8,889 requests in 305 s, 48 and 45
churn steps): 111.0 / 166.1-196.3 and 165.5-187.9 / 123.0 and 122.4 MiB (flat 1.182 and 1.135, back 1.108 and
1.103), allocated 79.7 and active 85.3-85.7 MB after the clears (6 MB of idle slabs, from 14). The back check is
0.3-0.8% short of 10%; the flat check now fails: the plateau sits lower (median 177.8-183.2 MiB against 185.7) with
deeper dips (24-27 MB of freed pages not yet purged at the plateau, against 18), on runs at a different pace.
``--quick`` after: 110.6 / 155.6-168.1 / 117.2 MiB (1.080 / 1.060).

What the plateau follows (a 2-core host shared with other work, load 3-9; ``--max-duration-s 300``; runs named together
were started together, so they shared the host's load; each gateway's ``/admin/debug/memory?limit=0`` and ``/metrics``
read every 5 s besides). The slab setting: with it 6,274 requests, 112.8 / 177.3-206.3 / 126.0 MiB (flat 1.163, back
1.117), without it 6,361 requests, 112.0 / 176.0-205.7 / 130.2 (1.169, 1.162): no change to the plateau, 4 MiB less
after the clears (idle 48-byte slab bytes 0.7 MiB against 3.2), so it stays. ``dirty_decay_ms:10000`` (jemalloc's
default; 12 s before the after-clears samples) 113.1 / 188.0-216.5 / 137.4 (1.152, 1.215) against 113.3 / 176.6-199.6 /
125.2 (1.131, 1.105) at 1 s: the 1 s decay stays. RSS less jemalloc's allocated bytes stays at 48-57 MiB over the
plateau (37 at the baseline; unpurged pages, resident less active, 10-20 MB of it): the swing is live bytes (allocated
127-178 MiB), not the allocator's retention. The live bytes follow two gauges, by a least-squares fit over each run's
readings: the index's approximate blocks (``kvgate_index_approx_blocks``, the pending entries of routed prompts and a
cleared worker's entries until it is warm again: 1,000-137,000, more than the three workers' 49,152 GPU blocks; about
115-280 bytes each) and the live sessions (``kvgate_sessions_live``, 140-900, as many as the replay's pace keeps inside
the scaled idle timeout; 6-30 KB each, a share not yet attributed to a structure). Both empty with the clears and
neither is a cache still filling when the warm-up ends: they rise and fall with the churn and the host's pace. Of
357,963 approximate blocks inserted by one reading during a run, 140,968 were confirmed by ``BlockStored`` and 26,848
expired; the rest went with the churn's clears and removals or the workers' evictions. Tried through the model and index
sections and not kept (flat; 1.144 and 1.131 for unchanged runs started with the first two): the pending TTL scaled by
the time scale (0.33 s) 1.202, the approximate TTL scaled (4 s) 1.162, at most 49,152 or 16,384 approximate blocks 1.141
and 1.156; at 16,384 the live bytes flatten (allocated 115-135 MiB) and RSS still rises with the sessions (165 -> 192
MiB). The hour on a quieter host (load 0.2-3, ``python -m benchmarks soak``: 10,891 requests in 300 s, 3,598 s of trace,
46 churn steps, none failed): gateway 112.8 / 193.7-245.1 (30 s windows rising from 183-200 to 224-243 with the pace:
1,510 live sessions, 204,000 approximate blocks) / 128.4 MiB (flat 1.265, back 1.138), 537 bytes of RSS per (block,
worker) holding at 233,779 holdings (index bench: 113), descriptors 42 -> 22, tasks 11 -> 9; workers 109.4 / 143.7-149.5
/ 119.1-119.3 MiB (1.027-1.040, 1.089-1.091), 2,327-2,530 bytes per cached GPU block. Two hours of trace
(``--trace-hours 2 --max-duration-s 660``, load 0.5-2.5: 21,743 requests in 517 s, 83 churn steps, none failed): 113.4 /
218.8-279.3 / 147.7 MiB (1.276, 1.303), up to 281,000 approximate blocks; after the clears jemalloc's resident bytes
were back at 97.5 MB as after the hour, yet RSS less them was 50 MiB against 29 at the baseline and 31 after the hour:
20 MiB outside jemalloc's own figures, not explained yet. Both gateway checks stay open. Also: ``kvgate serve`` imports
every subcommand's module (``router.cli.build_parser``), matplotlib among them: the peak RSS of ``import router.serve``
is 70 MiB, 105 MiB after ``build_parser()``, so about 35 MiB of the gateway's baseline is code it never runs (lazy
subcommands would lower both the baseline and, for the same excess, raise both ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from benchmarks._probe import (
    ProcessSample,
    get_json,
    sample_gateway,
    sample_worker,
    scrape,
    total,
    wait_for,
)
from benchmarks._soak_report import SURVIVOR_SITES, SoakConfig, SoakResult, report
from common.allocator import ALLOCATORS, allocator_env, find_jemalloc
from loadgen.demo_config import DemoConfig, find_default_trace, gateway_policy, worker_profile
from loadgen.fleet import Fleet, ManagedProcess, WorkerSpec
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, Replayer
from loadgen.sessions import derive_sessions
from loadgen.traces import TraceRequest, read_mooncake

logger = logging.getLogger(__name__)

MEMORY_TIMEOUT_S = 300.0
"""Limit of one ``/debug/memory`` answer: a tracemalloc snapshot of a large heap on a busy host takes minutes."""



def resolve_allocator(allocator: str) -> str:
    """``allocator`` with ``"auto"`` resolved (``SoakConfig.allocator``)."""
    if allocator == "auto":
        return "jemalloc" if find_jemalloc() is not None else "pymalloc"
    return allocator


def hour_of_trace(slice_requests: Sequence[TraceRequest], trace_hours: float) -> list[TraceRequest]:
    """The slice repeated until ``trace_hours`` of trace time, repetition ``k`` shifted by ``k`` slice lengths and
    in namespace ``soak-<k>`` (its own prompts and blocks), its sessions ``<k>-<session>``."""
    span_s = max(1.0, slice_requests[-1].arrival_s - slice_requests[0].arrival_s + 1.0)
    end_s = trace_hours * 3600.0
    out: list[TraceRequest] = []
    for k in range(math.ceil(end_s / span_s)):
        for r in slice_requests:
            arrival_s = r.arrival_s + k * span_s
            if arrival_s >= end_s:
                break
            out.append(msgspec.structs.replace(
                r, arrival_s=arrival_s, namespace=f"soak-{k}", session_id=f"{k}-{r.session_id}" if r.session_id else ""
            ))
    return out


def index_bench_bytes_per_holding(num_blocks: int = 20_000, num_workers: int = 16, seed: int = 1) -> float:
    """``benchmarks.index``'s memory figure, measured here: traced bytes of a ``PrefixIndex`` fed its fleet's
    stores, per (block, worker) holding."""
    from benchmarks.index import BLOCK_SIZE, build_fleet, iter_batches
    from events.types import BlockStored
    from router.index.config import IndexConfig
    from router.index.index import PrefixIndex

    conversations, _ = build_fleet(num_blocks, num_workers, seed)
    batches = list(iter_batches(conversations))
    holdings = sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored))
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE, max_blocks=2 * num_blocks))
    for batch in batches:
        index.apply(batch)
    used = tracemalloc.get_traced_memory()[0] - base
    del index
    if not was_tracing:
        tracemalloc.stop()
    return used / max(1, holdings)


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f} s] {text}", flush=True)


class Soak:
    """One soak run over a started fleet (``run`` drives it)."""

    def __init__(self, config: SoakConfig, fleet: Fleet, worker_entries: list[dict[str, Any]]) -> None:
        self.config = config
        self.fleet = fleet
        self.worker_entries = worker_entries
        self.samples: dict[str, list[ProcessSample]] = {}
        self.phase = "baseline"
        self.t0 = time.monotonic()
        self.rng = random.Random(config.seed)
        self.churn_counts: dict[str, int] = {}

    @property
    def gateway(self) -> ManagedProcess:
        assert self.fleet.gateway is not None
        return self.fleet.gateway

    async def sample(self, session: aiohttp.ClientSession) -> None:
        t_s = time.monotonic() - self.t0
        try:
            self.samples.setdefault("gateway", []).append(
                await sample_gateway(session, self.gateway.url, t_s, self.phase))
            for w in self.fleet.workers:
                self.samples.setdefault(w.name, []).append(await sample_worker(session, w.url, t_s, self.phase))
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("sample failed: %s", exc)

    async def sampler(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample(session)
            try:
                await asyncio.wait_for(stop.wait(), self.config.sample_interval_s)
            except TimeoutError:
                pass

    async def churn(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        admin = self.gateway.url + "/admin"
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.config.churn_interval_s)
                return
            except TimeoutError:
                pass
            entry = self.rng.choice(self.worker_entries)
            action = self.rng.choice(("clear", "remove_add"))
            try:
                if action == "clear":
                    async with session.post(admin + "/index/clear", json={"worker_id": entry["id"]}) as resp:
                        resp.raise_for_status()
                else:
                    async with session.delete(f"{admin}/workers/{entry['id']}") as resp:
                        resp.raise_for_status()
                    await asyncio.sleep(0.5)
                    async with session.post(admin + "/workers", json=entry) as resp:
                        resp.raise_for_status()
                self.churn_counts[action] = self.churn_counts.get(action, 0) + 1
            except aiohttp.ClientError as exc:
                logger.warning("churn %s of %s failed: %s", action, entry["id"], exc)
                self.churn_counts[action + "_failed"] = self.churn_counts.get(action + "_failed", 0) + 1

    async def memory(
        self, session: aiohttp.ClientSession, label: str, limit: int = 12, *, collect: bool = False
    ) -> dict[str, Any]:
        """Top ``limit`` allocation sites (0: none, no snapshot) and traced bytes of every process (after a full
        garbage collection there with ``collect``)."""
        out: dict[str, Any] = {}
        if self.config.tracemalloc == "none":
            limit = 0  # the C heap's figures only (``malloc``)
        try:
            query = f"limit={limit}" + ("&group_by=traceback" if self.config.tracemalloc_frames > 1 else "")
            query += "&collect=true" if collect else ""
            out["gateway"] = await get_json(session, f"{self.gateway.url}/admin/debug/memory?{query}",
                                            MEMORY_TIMEOUT_S)
            for w in self.fleet.workers if self.config.tracemalloc == "all" else ():
                out[w.name] = await get_json(session, f"{w.url}/debug/memory?{query}", MEMORY_TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("memory report (%s) failed: %s", label, exc)
        return out

    async def gateway_idle(self, session: aiohttp.ClientSession) -> bool:
        m = await scrape(session, self.gateway.url)
        return total(m, "kvgate_inflight_requests") == 0 and total(m, "kvgate_admission_inflight") == 0

    async def index_empty(self, session: aiohttp.ClientSession) -> bool:
        m = await scrape(session, self.gateway.url)
        return total(m, "kvgate_index_blocks") == 0 and total(m, "kvgate_index_entries") == 0


def _plateau(samples: list[ProcessSample], warmup_fraction: float) -> None:
    """Relabel the load samples after the warm-up fraction as ``"plateau"`` (in place)."""
    load = [s for s in samples if s.phase == "load"]
    if not load:
        return
    start, end = load[0].t_s, load[-1].t_s
    cut = start + warmup_fraction * (end - start)
    for s in load:
        if s.t_s >= cut:
            s.phase = "plateau"


def evaluate(
    config: SoakConfig, samples: dict[str, list[ProcessSample]], index_empty: bool
) -> list[tuple[str, bool, str]]:
    """The module docstring's checks, as ``(name, passed, detail)``."""
    checks: list[tuple[str, bool, str]] = [("gateway index empty after the clears", index_empty, "")]
    tol = config.tolerance
    for name, series in samples.items():
        base = [s for s in series if s.phase == "baseline"]
        plateau = [s.rss_bytes for s in series if s.phase == "plateau"]
        after = [s for s in series if s.phase == "cleared"]
        if not base or not plateau or not after:
            checks.append((f"{name}: samples in every phase", False, f"{len(base)}/{len(plateau)}/{len(after)}"))
            continue
        flat = max(plateau) / min(plateau)
        checks.append((f"{name}: RSS flat after warm-up (max/min <= {1 + tol:.2f})", flat <= 1 + tol, f"{flat:.3f}"))
        back = after[-1].rss_bytes / base[-1].rss_bytes
        checks.append((f"{name}: RSS after clears within {tol:.0%} of baseline", abs(back - 1) <= tol, f"{back:.3f}"))
        fds = after[-1].num_fds - base[-1].num_fds
        checks.append((f"{name}: descriptors back to baseline (+{config.slack_fds})", fds <= config.slack_fds,
                       f"{base[-1].num_fds:.0f} -> {after[-1].num_fds:.0f}"))
        tasks = after[-1].num_tasks - base[-1].num_tasks
        checks.append((f"{name}: asyncio tasks back to baseline (+{config.slack_tasks})", tasks <= config.slack_tasks,
                       f"{base[-1].num_tasks:.0f} -> {after[-1].num_tasks:.0f}"))
    return checks


def _bytes_per_cached_block(samples: list[ProcessSample]) -> dict[str, float]:
    """A sim worker's RSS over its baseline per cached GPU block, at its plateau's fullest sample."""
    base = [s for s in samples if s.phase == "baseline"]
    plateau = [s for s in samples if s.phase == "plateau" and s.num_entries]
    if not base or not plateau:
        return {}
    peak = max(plateau, key=lambda s: s.num_entries)
    return {"cached_blocks_at_plateau": peak.num_entries,
            "rss_bytes_per_cached_block": (peak.rss_bytes - base[-1].rss_bytes) / peak.num_entries}


def _bytes_per_holding(samples: list[ProcessSample], memory: dict[str, Any]) -> dict[str, float]:
    base = [s for s in samples if s.phase == "baseline"]
    plateau = [s for s in samples if s.phase == "plateau"]
    if not base or not plateau:
        return {}
    peak = max(plateau, key=lambda s: s.num_entries)
    out = {"holdings_at_plateau": peak.num_entries}
    if peak.num_entries:
        out["rss_bytes_per_holding"] = (peak.rss_bytes - base[-1].rss_bytes) / peak.num_entries
    traced = memory.get("plateau", {}).get("gateway", {}).get("traced_bytes")
    traced0 = memory.get("baseline", {}).get("gateway", {}).get("traced_bytes")
    holdings = memory.get("plateau_holdings")
    if traced and traced0 is not None and holdings:
        out["traced_bytes_per_holding"] = (traced - traced0) / holdings
    return out


async def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak (module docstring); stops every process it started before returning or raising."""
    demo = DemoConfig(trace=config.trace, num_workers=config.num_workers, max_requests=1000,
                      time_scale=config.time_scale)
    slice_requests = derive_sessions(read_mooncake(config.trace, max_requests=1000))
    max_prompt_blocks = max(math.ceil(r.num_prompt_tokens / demo.block_size) for r in slice_requests)
    num_gpu_blocks = max(config.num_gpu_blocks, 2 * max_prompt_blocks)
    requests = hour_of_trace(slice_requests, config.trace_hours)
    allocator = resolve_allocator(config.allocator)
    gateway_env = allocator_env(allocator, config.malloc_conf)  # raises before any process starts
    out_dir = Path(config.out)
    if config.tracemalloc == "all":
        os.environ["PYTHONTRACEMALLOC"] = str(config.tracemalloc_frames)
    fleet = Fleet(out_dir / "logs", startup_timeout_s=120.0)
    try:
        profile = worker_profile(demo)
        profile_path = out_dir / "logs" / "worker-profile.yaml"
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
        specs = [WorkerSpec(f"worker-{i}", num_gpu_blocks, 0, demo.block_size,
                            1.0 / config.time_scale) for i in range(config.num_workers)]
        fleet.start_workers(specs, ["--profile", str(profile_path)])
        await fleet.wait_ready()
        policy = gateway_policy("session_sticky+cache_aware", demo)
        sessions = {"store": "memory", "idle_timeout_s": 1800.0 / config.time_scale,
                    "reap_interval_s": max(0.5, 5.0 / config.time_scale)}
        if config.tracemalloc == "gateway":
            os.environ["PYTHONTRACEMALLOC"] = str(config.tracemalloc_frames)
        fleet.start_gateway(policy, demo.block_size, {"sessions": sessions},
                            env=gateway_env or None)
        if config.tracemalloc == "gateway":
            os.environ.pop("PYTHONTRACEMALLOC", None)
        await fleet.wait_ready()
        assert fleet.gateway is not None
        entries = fleet.gateway_config(policy, 0, demo.block_size)["workers"]
        soak = Soak(config, fleet, entries)
        print(f"fleet: {config.num_workers} sim workers x {num_gpu_blocks} GPU blocks, the gateway under {allocator}; "
              f"{len(requests)} requests over {requests[-1].arrival_s:.0f} s of trace at time scale "
              f"{config.time_scale:g}", flush=True)
        memory: dict[str, Any] = {}
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(2.0)
            for _ in range(3):
                await soak.sample(session)
                await asyncio.sleep(0.5)
            memory["baseline"] = await soak.memory(session, "baseline", limit=SURVIVOR_SITES)
            _say(soak.t0, "baseline taken; load starts")
            soak.phase = "load"
            stop = asyncio.Event()
            background = [asyncio.create_task(soak.sampler(session, stop)),
                          asyncio.create_task(soak.churn(session, stop))]
            replay = ReplayConfig(url=fleet.gateway.url, time_scale=config.time_scale,
                                  max_output_tokens=config.max_output_tokens, max_in_flight=config.max_in_flight,
                                  request_timeout_s=120.0, max_duration_s=config.max_duration_s,
                                  session_prefix="soak-")
            try:
                result = await Replayer(requests, replay, PromptBuilder()).run()
            finally:
                stop.set()
                await asyncio.gather(*background, return_exceptions=True)
            _plateau(soak.samples["gateway"], config.warmup_fraction)
            for w in fleet.workers:
                _plateau(soak.samples.get(w.name, []), config.warmup_fraction)
            _say(soak.t0, f"load done: {len(result.records)} requests sent")
            memory["plateau"] = await soak.memory(session, "plateau", limit=25)
            m = await scrape(session, fleet.gateway.url)
            memory["plateau_holdings"] = total(m, "kvgate_index_blocks")
            # Drain, then clear every worker (AllBlocksCleared), then remove every worker.
            soak.phase = "draining"
            await wait_for(lambda: soak.gateway_idle(session), 60.0)
            # Re-add any worker a churn step left removed, so that its clear reaches the index.
            listed = await get_json(session, fleet.gateway.url + "/admin/workers")
            present = {w["id"] for w in listed["workers"]}
            for entry in entries:
                if entry["id"] not in present:
                    async with session.post(fleet.gateway.url + "/admin/workers", json=entry) as resp:
                        resp.raise_for_status()
            await asyncio.sleep(1.0)
            await fleet.reset_caches()
            _say(soak.t0, "every worker's cache reset")
            is_empty = await wait_for(lambda: soak.index_empty(session), 30.0)
            for entry in entries:
                async with session.delete(f"{fleet.gateway.url}/admin/workers/{entry['id']}") as resp:
                    resp.raise_for_status()
            await asyncio.sleep(3.0)
            soak.phase = "cleared"
            for _ in range(3):
                await soak.sample(session)
                await asyncio.sleep(1.0)
            memory["cleared"] = await soak.memory(session, "cleared", limit=SURVIVOR_SITES)
            # What reference cycles still held (freed by a full collection), apart from the checks' figures.
            memory["collected"] = await soak.memory(session, "collected", limit=0, collect=True)
            await asyncio.sleep(2.0)
            soak.phase = "collected"
            await soak.sample(session)
            _say(soak.t0, "after-clear samples taken")
    finally:
        fleet.stop()
        os.environ.pop("PYTHONTRACEMALLOC", None)
    records = result.records
    num_failed = sum(1 for r in records if not r.is_ok)
    last_sent = max((requests[r.index].arrival_s for r in records), default=0.0)
    checks = evaluate(config, soak.samples, is_empty)
    per = _bytes_per_holding(soak.samples["gateway"], memory)
    per["index_bench_bytes_per_holding"] = index_bench_bytes_per_holding()
    per_worker = {name: _bytes_per_cached_block(series) for name, series in soak.samples.items() if name != "gateway"}
    print(f"churn: {soak.churn_counts}", flush=True)
    error_kinds: dict[str, int] = {}
    for r in records:
        if r.error_kind is not None:
            error_kinds[r.error_kind] = error_kinds.get(r.error_kind, 0) + 1
    return SoakResult(samples=soak.samples, checks=checks, num_requests=len(records), num_failed=num_failed,
                      error_kinds=error_kinds,
                      trace_s_covered=last_sent, bytes_per_holding=per, top_sites=memory,
                      worker_bytes_per_block=per_worker, allocator=allocator)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.soak [flags]``: 0 when every check passes, 1 otherwise, 2 for bad flags."""
    d = SoakConfig(trace="")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="Mooncake conversation trace (default: the bundled slice)")
    parser.add_argument("--out", default=d.out)
    parser.add_argument("--quick", action="store_true", help="the CI variant's size (about a minute)")
    for name in ("trace_hours", "time_scale", "max_duration_s", "sample_interval_s", "churn_interval_s",
                 "warmup_fraction", "tolerance"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    for name in ("num_workers", "num_gpu_blocks", "max_output_tokens", "max_in_flight", "slack_fds", "slack_tasks",
                 "seed", "tracemalloc_frames"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    parser.add_argument("--tracemalloc", choices=("none", "gateway", "all"), default=None,
                        help=f"processes traced by tracemalloc (default {d.tracemalloc}; --quick: none)")
    parser.add_argument("--allocator", choices=("auto", *ALLOCATORS), default=None,
                        help=f"the gateway's allocator (default {d.allocator})")
    parser.add_argument("--malloc-conf", default=None,
                        help=f"jemalloc's options with --allocator jemalloc (default {d.malloc_conf})")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    trace = args.trace or find_default_trace()
    if trace is None:
        parser.error("the bundled trace is missing; pass --trace")
    values: dict[str, Any] = {"trace": trace, "out": args.out, "write_plot": not args.no_plot}
    if args.quick:
        values.update(tracemalloc="none", trace_hours=0.05, time_scale=30.0, max_duration_s=45.0, churn_interval_s=2.0,
                      sample_interval_s=1.0, num_workers=2, num_gpu_blocks=8192)
    for key in SoakConfig.__struct_fields__:
        value = getattr(args, key, None)
        if value is not None and key not in ("trace", "out"):
            values[key] = value
    config = SoakConfig(**values)
    if config.trace_hours <= 0 or config.time_scale <= 0 or config.num_workers < 1 or config.max_duration_s <= 0:
        parser.error("--trace-hours, --time-scale, --num-workers and --max-duration-s must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = asyncio.run(run_soak(config))
    report(config, result)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
