"""Shared pool tier benchmarks (``python -m benchmarks.pool``); each figure beside a baseline from the same run.

1. Store and restore throughput through the worker's pool tier (``workers.kv.pool_tier.PoolTier`` over
   ``MooncakePoolStore``: ``prepare_store`` + ``complete_store``, which checks existence, puts and announces;
   ``fetch``, which gets and checks every value) against the raw Mooncake client's ``put_batch`` / ``get_batch``
   on the same values (under other keys, so both really write), against one ``mooncake_master`` on 127.0.0.1
   started here. Runs interleaved, best of ``--repeats``; ratio worker ÷ raw (target ≥ 0.9). The worker's store
   includes making the values (the sim engine's stand-in for the GPU -> host copy: token ids padded to
   ``--value-bytes``) and its existence check (store rule 2); its restore includes checking every value.
2. TTFT of a 100K-token history restored from the pool against recomputing it, under the sim timing model
   (``workers.engines.sim``, default H200 profile): the scheduler and sim engine run the turn on a worker whose GPU
   is cold, once with the history in the pool (stored by another worker) and once without; TTFT is the sum of the
   simulated step times up to the first output token.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.block_pool import BlockMeta
from workers.kv.hashing import extend_block_hashes, namespace_root
from workers.kv.manager import KVCacheManager
from workers.kv.pool_tier import MooncakePoolStore, PoolTier, SimPool, block_value
from workers.scheduler import Request, Scheduler


def start_master() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(  # noqa: S603 - a fixed binary, no shell
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_port=0", "--default_kv_lease_ttl=500"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("mooncake_master did not start")


def one_round(tier: PoolTier, store: MooncakePoolStore, rep: int, args: argparse.Namespace) -> dict[str, float]:
    """GB/s of each of the four operations on one batch of new blocks; the order alternates with ``rep``."""
    bs = args.block_size
    tokens = [rep * 10_000_000 + i for i in range(args.num_blocks * bs)]
    hashes = extend_block_hashes([], namespace_root(), tokens, bs)
    metas = [
        BlockMeta(h, hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]), i)
        for i, h in enumerate(hashes)
    ]
    values = [block_value(m.token_ids, args.value_bytes) for m in metas]
    raw_keys = [f"raw/{rep}/{i}" for i in range(len(metas))]
    nbytes = sum(map(len, values))
    timed: dict[str, float] = {}
    for phase in ("store", "restore"):
        names = ["worker", "raw"] if rep % 2 == 0 else ["raw", "worker"]
        for who in names:
            t = time.perf_counter()
            if (phase, who) == ("store", "worker"):
                assert len(tier.prepare_store(rep, hashes, metas)) == len(metas)
                tier.complete_store(rep)
            elif phase == "store":
                store._store.put_batch(raw_keys, values)
            elif who == "worker":
                assert tier.fetch(metas) == len(metas)
            else:
                assert store._store.get_batch(raw_keys) == values
            timed[f"{who}_{phase}"] = nbytes / (time.perf_counter() - t) / 1e9
    return timed


def throughput(args: argparse.Namespace) -> None:
    proc, address = start_master()
    try:
        store = MooncakePoolStore(address, global_segment_size=1 << 30, local_buffer_size=256 << 20)
        tier = PoolTier(store, args.block_size, lambda event: None, value_bytes_per_block=args.value_bytes)
        best: dict[str, float] = {}
        for rep in range(args.repeats):
            for name, gbps in one_round(tier, store, rep, args).items():
                best[name] = max(best.get(name, 0.0), gbps)
        print(f"pool throughput, {args.num_blocks} blocks × {args.value_bytes} B per batch, best of {args.repeats}:")
        for phase, raw in (("store", "put_batch"), ("restore", "get_batch")):
            w, r = best[f"worker_{phase}"], best[f"raw_{phase}"]
            print(f"  {phase:7}: worker {w:.3f} GB/s, raw {raw} {r:.3f} GB/s, ratio {w / r:.3f}")
        store.close()
    finally:
        proc.terminate()
        proc.wait(10)


def ttft(num_tokens: int) -> tuple[float, float, int]:
    """Simulated TTFT of a ``num_tokens`` history plus one token: (restored from the pool, recomputed, blocks)."""
    bs = 16
    pool = SimPool(num_tokens // bs + 64)
    prompt = list(range(num_tokens))
    config = KVCacheConfig(num_gpu_blocks=num_tokens // bs + 256, block_size=bs)

    def run(kv: KVCacheManager, tokens: list[int]) -> tuple[float, Request]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192), kv, None)
        engine = SimEngine(TimingProfile(), bs, [7], None)
        req = Request("r", tokens, 1, SamplingParams(), ignore_eos=True)
        sched.add_request(req)
        elapsed = 0.0
        while req.num_output_tokens == 0:
            result = engine.execute(sched.schedule())
            elapsed += result.duration_s
            sched.update(result)
        while sched.has_work() or engine.has_pending_copies():  # the stores land
            sched.update(engine.execute(sched.schedule()))
        return elapsed, req

    writer = KVCacheManager(config, pool_store=pool.attach())
    run(writer, prompt)
    restored_s, req = run(KVCacheManager(config, pool_store=pool.attach()), prompt + [1])
    recomputed_s, _ = run(KVCacheManager(config), prompt + [1])
    assert req.num_cached_tokens_by_medium[2] == num_tokens
    return restored_s, recomputed_s, num_tokens // bs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=256, help="blocks per batch")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--value-bytes", type=int, default=256 << 10, help="bytes per block value")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--history-tokens", type=int, default=100_000)
    parser.add_argument("--skip-mooncake", action="store_true", help="only the TTFT figure")
    args = parser.parse_args()
    if not args.skip_mooncake:
        throughput(args)
    restored, recomputed, blocks = ttft(args.history_tokens)
    print(f"TTFT of a {args.history_tokens}-token history + 1 token (sim timing model, {blocks} blocks): "
          f"restored from the pool {restored:.3f} s, recomputed {recomputed:.3f} s, "
          f"ratio {recomputed / restored:.1f}×")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
