"""A thousand workers: ``python -m benchmarks fleet_scale``.

(a) **The Mooncake trace replayed as events** (Dynamo's ``INDEXER_BENCH.md`` method: the FAST'25
``conversation_trace``, unique workers times a duplication factor): records in trace order; for each, ``match()``
of its prefix (timed, a query), then the worker the match favours (the deepest holder; else a hash of the record
over the workers) stores the blocks it lacks as one ``BlockStored`` chained by engine hash (timed, ingest), and
each of the ``--duplication - 1`` copies of that worker stores the same (Dynamo's duplication). Each worker holds at
most ``--worker-capacity`` blocks and evicts least recently stored runs first with ``BlockRemoved`` (timed, ingest).
A trace block (``hash_ids``, 512 tokens) is ``--blocks-per-hash`` index blocks of 16 tokens. Reported: events/s and
blocks/s (stored + removed, per core: this thread's CPU time), queries/s, p50/p99 per operation, and bytes per
(block, worker) holding (``tracemalloc``: what ``router/`` code allocated and still holds at the end, in a separate
pass over the first ``--memory-records`` records), at ``--num-workers``
and at 64 workers, beside Dynamo's published figures.

(b) **Decision time against fleet size**: the gateway's state building (``Router.states`` over the scored
workers, ``router.routing.scored_workers``) plus ``cache_aware``'s ``select`` for a prompt whose prefix 2 workers
hold, at 8, 64, 256 and 1,000 workers (all candidates, and the bounded set the gateway scores); and with a real
index match whose first block every worker holds (match, scoring of the 64 deepest holders plus the sample, select).

Measured on the quiet 16-core host (Python 3.12, five benchmarks side by side, full trace), before / after the
index's levels-of-masks match, run-by-run store and inlined removal::

    1,000 workers x 1   ingest 0.36 / 0.82 M blocks/s per core   match p50 749 / 17 us, p99 1,043 / 48 us
                        51,007 queries/s per core (was 1,495)    266 B per holding (305 before; 283 at 64 workers)
    143 x 7 = 1,001     ingest 0.62 M blocks/s per core (13.2 M blocks, 20% removals), match p50 40 us, p99 397 us
    64 workers          ingest 0.24 / 0.32 M blocks/s, match p50 77 / 41 us, p99 396 / 397 us
    decision, shared    36 / 209 / 186 / 295 us at 8 / 64 / 256 / 1,000 workers (72 scored past 64)

After the walk of slots with gaps in runs of consecutive ids (the same host, ``--num-workers 1000`` and
``--num-workers 143 --duplication 7 --skip-decision`` side by side)::

    1,000 workers x 1   ingest 0.70 M blocks/s per core, match p50 19 us, p99 61 us, 266 B per holding
    143 x 7 = 1,001     ingest 0.94 M blocks/s per core, match p50 28 us, p99 145 us, 103 B per holding
    64 workers          ingest 0.40 M blocks/s, match p50 30 us, p99 216 us (283 B per holding)
    decision, shared    27 / 156 / 169 / 216 us at 8 / 64 / 256 / 1,000 workers
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from events.types import BlockRemoved, BlockStored, EngineBlockHash, EventBatch
from router.block_hash import BlockHash, hash_token_blocks
from router.index.config import IndexConfig
from router.index.index import PrefixIndex

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
"""The whole Mooncake conversation trace, beside the checkout (``../shared/traces``); ``--trace`` names another."""
BLOCK_SIZE = 16
_SCRAMBLE = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1
DYNAMO_PUBLISHED = ("Dynamo INDEXER_BENCH.md (Rust, 1,000 unique workers x duplication 7): steady 11.9 k ops/s, "
                    "CRTC p99 11.8 ms; peak 18 k ops/s (CRTC) / 30.4 k ops/s (branch-sharded, p99 3.2 ms); "
                    "indexer README: > 10 M events+requests/s, p99 < 10 us (micro-benchmark)")


def load_trace(path: Path, limit: int | None) -> list[list[int]]:
    records = []
    with path.open() as f:
        for line in f:
            records.append(json.loads(line)["hash_ids"])
            if limit is not None and len(records) >= limit:
                break
    return records


def _tokens(ids: list[int]) -> tuple[int, ...]:
    grid = (np.asarray(ids, dtype=np.int64)[:, None] * 7919 + np.arange(BLOCK_SIZE)[None, :] * 104_729) % 128_000
    return tuple(grid.astype(np.uint32).ravel().tolist())


def replay(records: list[list[int]], num_workers: int, duplication: int, blocks_per_hash: int,
           worker_capacity: int, *, trace_memory: bool = False) -> dict[str, float]:
    """Part (a) for one fleet size; returns the figures (``bytes_per_holding`` only with ``trace_memory``: the
    allocations made in ``router/`` code that are alive at the end, by ``tracemalloc``, which slows the rest)."""
    import tracemalloc

    if trace_memory:
        tracemalloc.start()
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE, max_blocks=1 << 26))
    rng = np.random.default_rng(0)
    # Index blocks of each record: trace block h -> blocks h * k .. h * k + k - 1 (shared prefixes stay shared).
    paths = [[h * blocks_per_hash + j for h in rec for j in range(blocks_per_hash)] for rec in records]
    hashes: dict[int, int] = {}
    held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_workers)]
    prepared = []
    for path in paths:  # block hashes and token ids up front (not timed: the gateway hashes once per request)
        chain = hash_token_blocks(_tokens(path), BLOCK_SIZE)
        for b, h in zip(path, chain, strict=True):
            hashes.setdefault(b, h)
        prepared.append(chain)
    match_s: list[float] = []
    ingest_s: list[float] = []
    num_events = num_blocks = 0
    seq = 0
    cpu_ingest = cpu_match = 0.0
    for path, chain in zip(paths, prepared, strict=True):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        result = index.match(chain)
        match_s.append(time.perf_counter() - t0)
        cpu_match += time.thread_time() - c0
        # The deepest holder when it holds most of the prompt (a cache-aware router's choice), else any worker.
        deepest = next(iter(result.workers), None)  # holders come deepest first
        if deepest is not None and result.workers[deepest].num_gpu_blocks * 2 > len(chain):
            worker = int(deepest[1:]) % num_workers
        else:
            worker = int(rng.integers(num_workers))
        mine = held[worker]
        first = 0
        while first < len(path) and path[first] in mine:
            mine.move_to_end(path[first])
            first += 1
        new = path[first:]
        events: list[Any] = []
        if new:
            for b in new:
                mine[b] = None
            events.append(BlockStored(
                block_hashes=tuple(EngineBlockHash((b * _SCRAMBLE + 1) & _U64) for b in new),
                parent_block_hash=EngineBlockHash((path[first - 1] * _SCRAMBLE + 1) & _U64) if first else None,
                token_ids=_tokens(new), block_size=BLOCK_SIZE))
        evicted = []
        while len(mine) > worker_capacity:
            evicted.append(mine.popitem(last=False)[0])
        if evicted:
            removed = tuple(EngineBlockHash((b * _SCRAMBLE + 1) & _U64) for b in evicted)
            events.append(BlockRemoved(block_hashes=removed))
        if not events:
            continue
        for d in range(duplication):
            seq += 1
            batch = EventBatch(f"w{worker + d * num_workers}", 0, seq, 0.0, tuple(events))
            c0 = time.thread_time()
            t0 = time.perf_counter()
            index.apply(batch)
            ingest_s.append(time.perf_counter() - t0)
            cpu_ingest += time.thread_time() - c0
            num_events += len(events)
            num_blocks += len(new) + len(evicted)
    holdings = sum(len(h) for h in held) * duplication
    num_bytes = 0
    if trace_memory:
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/router/*")])
        num_bytes = sum(stat.size for stat in snapshot.statistics("filename"))
        tracemalloc.stop()
    match_s.sort()
    ingest_s.sort()
    return {
        "workers": num_workers * duplication, "records": len(records), "events": num_events, "blocks": num_blocks,
        "events_per_s": num_events / cpu_ingest, "blocks_per_s": num_blocks / cpu_ingest,
        "queries_per_s": len(match_s) / cpu_match,
        "match_p50_us": statistics.median(match_s) * 1e6, "match_p99_us": match_s[int(len(match_s) * 0.99)] * 1e6,
        "ingest_p50_us": statistics.median(ingest_s) * 1e6,
        "ingest_p99_us": ingest_s[int(len(ingest_s) * 0.99)] * 1e6,
        "holdings": holdings, "bytes_per_holding": num_bytes / max(1, holdings),
    }


def decision_times(fleet_sizes: list[int], num_decisions: int) -> list[tuple[int, float, float, int, float, int]]:
    """Part (b): ``(workers, all-candidates us, bounded us, workers scored, shared-prefix us, workers scored)`` per
    fleet size; the last two with a real index match whose first block every worker holds."""
    from policies import build_policy, decode_policy_config
    from policies.base import RequestView, Snapshot
    from router.config import CircuitBreakerConfig, WorkerConfig
    from router.fleet import WorkerRuntime
    from router.index.result import MatchResult, WorkerMatch
    from router.request_view import PromptView
    from router.routing import Router, scored_workers

    policy = build_policy(decode_policy_config({"name": "cache_aware"}))
    view = PromptView(32_768, tuple(BlockHash(i) for i in range(2048)), BLOCK_SIZE)
    out = []
    for n in fleet_sizes:
        workers = tuple(WorkerRuntime(WorkerConfig(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", model="m"),
                                      BLOCK_SIZE, CircuitBreakerConfig()) for i in range(n))
        by_id = {w.worker_id: w for w in workers}
        match = MatchResult({"w1": WorkerMatch("w1", 0, 2048), f"w{n - 1}": WorkerMatch(f"w{n - 1}", 0, 1024)}, 2048)
        req = RequestView("r", "m", view.num_tokens, 256, BLOCK_SIZE)
        times = {}
        for bounded in (False, True):
            t0 = time.perf_counter()
            for k in range(num_decisions):
                scored = scored_workers(workers, by_id, match, k) if bounded else workers
                states, _ = Router.states(scored, view, 0.0, 0, match)
                policy.select(req, Snapshot(states, None, 0.0))
            times[bounded] = (time.perf_counter() - t0) / num_decisions * 1e6
        # The real index, every worker holding the prompt's first block (a shared system prompt), two deeper:
        # index.match + the bounded scoring + cache_aware, all of the decision's index and policy work.
        index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE))
        tokens = _tokens(list(range(128)))
        hashes = hash_token_blocks(tokens, BLOCK_SIZE)
        for i in range(n):
            depth = len(hashes) if i == 1 else len(hashes) // 2 if i == n - 1 else 1
            event = BlockStored(tuple(EngineBlockHash(j + 1) for j in range(depth)), None,
                                tokens[: depth * BLOCK_SIZE], BLOCK_SIZE)
            index.apply(EventBatch(f"w{i}", 0, 1, 0.0, (event,)))
        shared_view = PromptView(len(tokens), tuple(hashes), BLOCK_SIZE)
        t0 = time.perf_counter()
        for k in range(num_decisions):
            shared = index.match(shared_view.block_hashes)
            scored = scored_workers(workers, by_id, shared, k)
            states, _ = Router.states(scored, shared_view, 0.0, 0, shared)
            policy.select(req, Snapshot(states, None, 0.0))
        shared_us = (time.perf_counter() - t0) / num_decisions * 1e6
        num_scored = len(scored_workers(workers, by_id, index.match(shared_view.block_hashes), 0))
        out.append((n, times[False], times[True], len(scored_workers(workers, by_id, match, 0)), shared_us,
                    num_scored))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--records", type=int, default=None, help="first N records (default all)")
    parser.add_argument("--num-workers", type=int, default=1000)
    parser.add_argument("--duplication", type=int, default=1)
    parser.add_argument("--blocks-per-hash", type=int, default=8)
    parser.add_argument("--worker-capacity", type=int, default=8192, help="blocks a worker holds")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--memory-records", type=int, default=3000)
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--skip-decision", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_replay:
        if not args.trace.is_file():
            parser.error(f"no trace at {args.trace}: pass --trace <conversation_trace.jsonl>")
        records = load_trace(args.trace, args.records)
        print(f"Mooncake conversation trace: {len(records)} records, {args.blocks_per_hash} blocks of 16 tokens per "
              f"trace block, worker capacity {args.worker_capacity} blocks")
        print(f"{'workers':>8} {'events':>9} {'blocks':>10} {'events/s':>10} {'blocks/s':>10} {'queries/s':>10} "
              f"{'match p50':>10} {'p99 us':>8} {'ingest p50':>11} {'p99 us':>8} {'holdings':>10} {'B/holding':>9}")
        for n in (64, args.num_workers):
            f = replay(records, n, args.duplication, args.blocks_per_hash, args.worker_capacity)
            f["bytes_per_holding"] = replay(records[: args.memory_records], n, args.duplication, args.blocks_per_hash,
                                            args.worker_capacity, trace_memory=True)["bytes_per_holding"]
            print(f"{f['workers']:8d} {f['events']:9d} {f['blocks']:10d} {f['events_per_s']:10.0f} "
                  f"{f['blocks_per_s']:10.0f} {f['queries_per_s']:10.0f} {f['match_p50_us']:10.1f} "
                  f"{f['match_p99_us']:8.1f} {f['ingest_p50_us']:11.1f} {f['ingest_p99_us']:8.1f} "
                  f"{f['holdings']:10d} {f['bytes_per_holding']:9.0f}", flush=True)
        print(DYNAMO_PUBLISHED)
    if args.skip_decision:
        return
    print("\ndecision time (state building + cache_aware select), 2 prefix holders, 2,048-block prompt; shared: "
          "index.match + scoring + select, a 1,024-block prompt whose first block every worker holds")
    print(f"{'workers':>8} {'all us':>9} {'bounded us':>11} {'scored':>7} {'shared us':>10} {'scored':>7}")
    for n, full, bounded, scored, shared, num_shared in decision_times([8, 64, 256, 1000], args.decisions):
        print(f"{n:8d} {full:9.1f} {bounded:11.1f} {scored:7d} {shared:10.1f} {num_shared:7d}", flush=True)


if __name__ == "__main__":
    main()
