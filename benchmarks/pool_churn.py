"""The shared pool under churn against a real ``mooncake_master`` (``python -m benchmarks pool_churn``).

Rounds of requests from ``--sessions`` sessions in flight at once, all opening with the same blocks and each
with its own history (a new conversation every 10 turns), sent to one of ``--workers`` reference-worker KV
managers at random, so a session's history comes back from the pool wherever it goes. Every worker is a Mooncake
client, one of them holding the pool's only segment (``--segment-bytes``), smaller than the live working set, so
the master evicts all the time. Blocks carry ``--value-bytes`` each (chunks of ``workers.kv.pool_chunk``), and every
restored block is checked byte for byte (the worker's ``verify: all_bytes``). A gateway index is fed the
workers' events; a ``router.pool_watch.PoolWatcher`` sweeps the master every ``--sweep-every`` requests and, with
``--check-budget-s``, checks each decision's pool run first, as the gateway's router does. With ``--restart-at``
the master is killed after that many requests of the second round and started again (same ports, empty)
``--down-requests`` requests later: requests go on meanwhile (the pool reads as empty), the workers' clients come
back, and the watcher drops what the old master held.

Per round it prints: requests, pool blocks restored, decisions that priced a pool hit and, of those, the share
whose worker found part of the priced run gone (the watcher's figure, target at most 5%), fetch mismatches
(target 0), and the master's evicted keys.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from events.counters import EventCounters
from events.decode import EventDecoder
from events.encode import BatchEncoder
from events.types import BlockStored, EngineBlockHash, EventBatch, Medium
from loadgen.mooncake_master import MooncakeMaster
from router.block_hash import hash_token_blocks
from router.index import PrefixIndex
from router.index.config import IndexConfig
from router.pool_watch import PoolWatcher, pool_key_blocks
from router.pool_watch_config import PoolWatchConfig
from workers.config import KVCacheConfig, PoolConfig
from workers.kv.manager import KVCacheManager, SequenceKV
from workers.kv.pool_store import MooncakePoolStore

MODEL = "m"


@dataclass(frozen=True)
class ChurnConfig:
    """One churn run (module docstring)."""

    num_rounds: int = 2
    requests_per_round: int = 2000
    num_sessions: int = 16
    num_workers: int = 4
    block_size: int = 16
    num_shared_blocks: int = 4
    value_bytes: int = 128 << 10
    segment_bytes: int = 16 << 20
    """The pool: the one segment worker 0 contributes (Mooncake's smallest is 16 MiB); the others are pure
    clients."""
    sweep_every: int = 16
    check_budget_s: float = 0.05
    restart_at: int | None = 1000
    """Requests into round 2 when the master is killed (``None``: never)."""
    down_requests: int = 64
    lease_ttl_ms: int = 1000
    seed: int = 18


@dataclass
class RoundReport:
    """What one round saw."""

    num_requests: int = 0
    num_pool_blocks_restored: int = 0
    num_pool_priced: int = 0
    num_pool_stale: int = 0
    num_fetch_mismatches: int = 0
    num_evicted_keys: int = 0
    num_restored_after_restart: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def stale_ratio(self) -> float:
        """Share of the decisions that priced a pool hit whose worker found part of it gone."""
        return self.num_pool_stale / self.num_pool_priced if self.num_pool_priced else 0.0


class Fleet:
    """The workers (Mooncake clients), the gateway index fed by their events, and the watcher."""

    def __init__(self, config: ChurnConfig, master: MooncakeMaster) -> None:
        self.config = config
        self.master = master
        ids = [f"w{i}" for i in range(config.num_workers)]
        self.ids = ids
        self.stores = [
            MooncakePoolStore(master.address, global_segment_size=config.segment_bytes if i == 0 else 0,
                              local_buffer_size=8 << 20)
            for i in range(len(ids))
        ]  # fmt: skip
        kv_config = KVCacheConfig(num_gpu_blocks=256, block_size=config.block_size, pool=PoolConfig(
            backend="mooncake", value_bytes_per_block=config.value_bytes, verify="all_bytes"))  # fmt: skip
        self.workers = [KVCacheManager(kv_config, pool_store=store) for store in self.stores]
        self.index = PrefixIndex(IndexConfig(block_size=config.block_size), pool_members={Medium.MOONCAKE: ids})
        ttl_s = config.lease_ttl_ms / 1000
        self.watcher = PoolWatcher(PoolWatchConfig(
            admin_url=master.admin_url, lease_ttl_s=ttl_s, entry_ttl_s=ttl_s, interval_s=ttl_s / 2,
            request_timeout_s=1.0, decision_check_budget_s=config.check_budget_s), {MODEL: self.index})  # fmt: skip
        self._decoder, self._encoder = EventDecoder(EventCounters()), BatchEncoder("vllm")
        self._seqs = [0] * len(ids)

    def drain(self) -> None:
        """Every worker's events to the index."""
        for i, kv in enumerate(self.workers):
            events = kv.take_events()
            if events:
                batch = self._decoder.decode(self._encoder.encode(events, time.time(), 0), worker_id=self.ids[i],
                                             seq=self._seqs[i])  # fmt: skip
                if batch is None:
                    raise RuntimeError("a worker's events did not decode")
                self.index.apply(batch)
                self._seqs[i] += 1

    def pool_holdings_not_in_master(self) -> int:
        """Pool holdings of the index whose key the master does not list (0 right after a sweep, but for stores
        since)."""
        present = {b for k in self.master.keys() for b in pool_key_blocks(k) or ()}
        return sum((g, eh) not in present for _, _, g, eh, _ in self.index.pool_holdings(Medium.MOONCAKE))

    def close(self) -> None:
        for store in self.stores:
            store.close()


def prompt(config: ChurnConfig, session: int, turn: int) -> list[int]:
    """The shared blocks, then ``turn % 10 + 1`` blocks of the session's own history, then one token."""
    bs = config.block_size
    start = 10_000_000 * (turn // 10) + 100_000 * (session + 1)
    return [*range(config.num_shared_blocks * bs), *range(start, start + (turn % 10 + 1) * bs), 7]


async def wait_for_stores(fleet: Fleet, capacity_bytes: float, timeout_s: float = 30.0) -> None:
    """Until every worker's store answers the restarted master again (its port probe passes and a call succeeds)
    and the master holds ``capacity_bytes`` of mounted segments again (``master_total_capacity_bytes``: each client
    remounts its segment on its own ping thread, and until then puts fail for want of space), so the rest of the
    round runs against a live tier however fast this host replays it; at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if fleet.master.metric("master_total_capacity_bytes") < capacity_bytes:
                await asyncio.sleep(0.2)
                continue
        except (OSError, KeyError):  # the restarted master's admin port is not up yet
            await asyncio.sleep(0.2)
            continue
        failed = [s.num_failed_calls for s in fleet.stores]
        usable = all(s.is_usable() for s in fleet.stores)
        if usable:
            for store in fleet.stores:
                store.exists(["kvgate/probe"])
            if [s.num_failed_calls for s in fleet.stores] == failed and all(s.is_usable() for s in fleet.stores):
                return
        await asyncio.sleep(0.2)


async def run_round(fleet: Fleet, rng: random.Random, first_turn: int, restart_at: int | None) -> RoundReport:
    """One round (module docstring); raises on any failure of a worker (a crash)."""
    config = fleet.config
    bs = config.block_size
    report = RoundReport()
    evicted_before = fleet.master.metric("master_evicted_key_count")
    fetched_before = sum(kv.pool.num_blocks_fetched for kv in fleet.workers if kv.pool is not None)
    mismatches_before = sum(kv.pool.num_fetch_mismatches for kv in fleet.workers if kv.pool is not None)
    restarted_at: int | None = None
    capacity_bytes = 0.0
    t0 = time.perf_counter()
    turn = first_turn
    while report.num_requests < config.requests_per_round:
        in_flight: list[tuple[KVCacheManager, SequenceKV, list[int]]] = []
        for session in range(config.num_sessions):
            if restart_at is not None and report.num_requests == restart_at:
                evicted_before -= fleet.master.metric("master_evicted_key_count")  # what the old master evicted
                capacity_bytes = fleet.master.metric("master_total_capacity_bytes")
                fleet.master.kill()
            if restart_at is not None and report.num_requests == restart_at + config.down_requests:
                fleet.master.start()
                await wait_for_stores(fleet, capacity_bytes)
                restarted_at = report.num_requests
            if report.num_requests % config.sweep_every == 0:
                await fleet.watcher.sweep()
            tokens = prompt(config, session, turn)
            w = rng.randrange(config.num_workers)
            kv, worker_id = fleet.workers[w], fleet.ids[w]
            hashes = hash_token_blocks(tokens, bs)
            match = fleet.index.match(hashes).get(worker_id)
            if match is not None and match.num_pool_blocks and config.check_budget_s > 0:
                start = match.num_gpu_blocks + match.num_cpu_blocks
                if await fleet.watcher.check(MODEL, hashes[start : start + match.num_pool_blocks]):
                    match = fleet.index.match(hashes).get(worker_id)
            seq = SequenceKV(f"r{turn}-{session}")
            hit = kv.find_prefix(seq, tokens, len(tokens))
            if not kv.admit(seq, hit, len(tokens)):
                raise RuntimeError(f"request {seq.request_id} was not admitted")
            restored = seq.num_cached_blocks - len(hit.gpu_block_ids)
            report.num_pool_blocks_restored += restored
            if restarted_at is not None:
                report.num_restored_after_restart += restored
            if match is not None and match.num_pool_blocks:
                report.num_pool_priced += 1
                report.num_pool_stale += seq.num_cached_blocks < match.num_blocks
            in_flight.append((kv, seq, tokens))
            report.num_requests += 1
        for kv in fleet.workers:
            for job in kv.take_pool_copies()[1]:
                kv.complete_restore(job.job_id)
        for kv, seq, tokens in in_flight:
            kv.cache_computed(seq, tokens, len(tokens), len(tokens))
        for kv in fleet.workers:
            for job in kv.take_pool_copies()[0]:
                kv.complete_store(job.job_id)
        for kv, seq, _ in in_flight:
            kv.free(seq)
        fleet.drain()
        turn += 1
    report.seconds = time.perf_counter() - t0
    report.num_evicted_keys = int(fleet.master.metric("master_evicted_key_count") - evicted_before)  # both masters
    report.num_fetch_mismatches = (
        sum(kv.pool.num_fetch_mismatches for kv in fleet.workers if kv.pool is not None) - mismatches_before
    )
    fetched = sum(kv.pool.num_blocks_fetched for kv in fleet.workers if kv.pool is not None) - fetched_before
    report.extra["num_blocks_fetched"] = fetched
    return report


async def run_churn(config: ChurnConfig, master: MooncakeMaster) -> tuple[list[RoundReport], Fleet]:
    """Every round on one fleet over ``master`` (started); the fleet is returned open (``Fleet.close``)."""
    fleet = Fleet(config, master)
    await fleet.watcher.open()
    rng = random.Random(config.seed)
    reports: list[RoundReport] = []
    try:
        for r in range(config.num_rounds):
            restart_at = config.restart_at if r == 1 else None
            reports.append(await run_round(fleet, rng, 1000 * r, restart_at))
        await fleet.watcher.sweep()
    finally:
        await fleet.watcher.close()
    return reports, fleet


async def watcher_costs(num_keys: int, num_check_blocks: int = 64) -> tuple[float, float, float]:
    """The pool watcher's two costs at ``num_keys`` pool objects, all credited by an index (one worker, chains of
    64 blocks): ``(sweep seconds, of which comparing and dropping, decision check seconds)``, medians of 5."""
    master = MooncakeMaster(lease_ttl_ms=5000)
    master.start()
    store = MooncakePoolStore(master.address, global_segment_size=256 << 20, local_buffer_size=16 << 20)
    try:
        bs = 4
        index = PrefixIndex(IndexConfig(block_size=bs), pool_members={Medium.MOONCAKE: ["w0"]})
        keys: list[str] = []
        for chain in range(0, num_keys, 64):
            n = min(64, num_keys - chain)
            hashes = [EngineBlockHash(chain * 64 + i + 1) for i in range(n)]
            tokens = tuple(t for i in range(n) for t in range(chain * 1000 + i * bs, chain * 1000 + i * bs + bs))
            index.apply(EventBatch("w0", 0, chain, 0.0, (BlockStored(
                block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tokens, block_size=bs,
                medium=Medium.MOONCAKE),)))  # fmt: skip
            keys.extend(f"kvgate/v1/{'0' * 48}{h:016x}" for h in hashes)
        for start in range(0, len(keys), 512):
            assert all(store.put(keys[start : start + 512], [b"x"] * len(keys[start : start + 512])))
        watcher = PoolWatcher(PoolWatchConfig(admin_url=master.admin_url, decision_check_budget_s=1.0),
                              {MODEL: index})  # fmt: skip
        await watcher.open()
        try:
            sweeps, checks = [], []
            for _ in range(5):
                t = time.perf_counter()
                assert await watcher.sweep() and watcher.num_entries_dropped == 0
                sweeps.append(time.perf_counter() - t)
            listing = []
            for _ in range(5):
                t = time.perf_counter()
                await watcher._get("/get_all_keys")
                await watcher._get("/metrics")
                listing.append(time.perf_counter() - t)
            run = [h for h in hash_token_blocks(list(range(64 * bs)), bs)][:num_check_blocks]
            for _ in range(5):
                t = time.perf_counter()
                assert await watcher.check(MODEL, run) == 0
                checks.append(time.perf_counter() - t)
        finally:
            await watcher.close()
        sweep_s = sorted(sweeps)[2]
        return sweep_s, max(0.0, sweep_s - sorted(listing)[2]), sorted(checks)[2]
    finally:
        store.close()
        master.stop()


def master_for(config: ChurnConfig) -> MooncakeMaster:
    """A master that evicts early (high watermark 0.8, a tenth at a time) with the run's lease."""
    return MooncakeMaster(lease_ttl_ms=config.lease_ttl_ms,
                          extra_args=("--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.1"))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--value-bytes", type=int, default=128 << 10)
    parser.add_argument("--segment-bytes", type=int, default=16 << 20)
    parser.add_argument("--sweep-every", type=int, default=16, help="requests between sweeps (16: every step)")
    parser.add_argument("--check-budget-s", type=float, default=0.05, help="0: sweeps only")
    parser.add_argument("--restart-at", type=int, default=5000, help="-1: no restart")
    parser.add_argument("--down-requests", type=int, default=64)
    parser.add_argument("--cost-keys", type=int, default=20_000, help="pool objects for the watcher's costs (0: skip)")
    args = parser.parse_args()
    if args.cost_keys:
        sweep_s, compare_s, check_s = asyncio.run(watcher_costs(args.cost_keys))
        print(
            f"pool watcher at {args.cost_keys} pool objects, all in the index: sweep {sweep_s * 1e3:.1f} ms "
            f"(listing + counters {1e3 * (sweep_s - compare_s):.1f} ms, comparing {compare_s * 1e3:.1f} ms), "
            f"decision check of 64 blocks {check_s * 1e3:.2f} ms (medians of 5)"
        )
    config = ChurnConfig(
        num_rounds=args.rounds, requests_per_round=args.requests, num_sessions=args.sessions,
        num_workers=args.workers, value_bytes=args.value_bytes, segment_bytes=args.segment_bytes,
        sweep_every=args.sweep_every, check_budget_s=args.check_budget_s,
        restart_at=None if args.restart_at < 0 else args.restart_at, down_requests=args.down_requests,
    )  # fmt: skip
    master = master_for(config)
    master.start()
    try:
        reports, fleet = asyncio.run(run_churn(config, master))
        try:
            w = fleet.watcher
            print(
                f"pool churn: {config.num_workers} workers on a {config.segment_bytes >> 20} MiB pool, "
                f"{config.num_sessions} sessions, {config.value_bytes >> 10} KiB blocks, sweep every "
                f"{config.sweep_every} requests, decision checks {config.check_budget_s * 1e3:.0f} ms budget"
            )
            for i, r in enumerate(reports):
                restart = f" ({r.num_restored_after_restart} after the restart)" if config.restart_at and i else ""
                print(
                    f"  round {i + 1}: {r.num_requests} requests in {r.seconds:.1f} s, "
                    f"{r.num_pool_blocks_restored} pool blocks restored{restart}, {r.num_pool_priced} decisions "
                    f"priced a pool hit, {r.num_pool_stale} found part of it gone ({100 * r.stale_ratio:.2f}%), "
                    f"{r.num_fetch_mismatches} fetch mismatches, {r.num_evicted_keys} keys evicted by the master"
                )
            print(
                f"  watcher: {w.num_sweeps} sweeps (last {w.last_sweep_s * 1e3:.1f} ms), {w.num_failed_sweeps} "
                f"failed, {w.num_entries_dropped} entries dropped by sweeps, {w.num_checks} decision checks "
                f"(last {w.last_check_s * 1e3:.2f} ms, {w.num_checks_unanswered} over budget), "
                f"{w.num_check_drops} blocks dropped by checks, {w.num_master_restarts} master restarts seen"
            )
        finally:
            fleet.close()
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
