"""Benchmark: latency the session store adds to each routed request, Redis store against the in-memory store.

Run: ``python -m benchmarks.sessions [--redis-url redis://127.0.0.1:6379/0] [--num-requests 20000]``.
Without ``--redis-url`` it starts its own ``redis-server`` on a free 127.0.0.1 port (no persistence) and stops
it at the end.

What is timed: one ``claim_or_touch(session_key, proposed_worker_id)`` per request, the only store call on a
routed request's path (``move`` runs only when ownership changes). Sessions are revisited round-robin
(``--num-sessions`` conversations, one turn each per round), the first turn of each creating the session. The
three stores (memory; Redis with the local cache off; Redis with it on) run in interleaved blocks on one event
loop so that drift in machine load hits them alike. Printed: p50/p99 per store in microseconds, and for each Redis
variant the difference to memory (the added latency) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import numpy as np

from router.sessions.base import SessionStore
from router.sessions.config import SessionsConfig
from router.sessions.factory import build_session_store


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _own_redis_server() -> Iterator[str]:
    """Start a private redis-server on 127.0.0.1; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed; install it or pass --redis-url")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-redis-") as directory:
        process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", directory, "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10.0
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit("redis-server did not start")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(timeout=10.0)


async def _run_block(store: SessionStore, keys: Sequence[str], num_requests: int, offset: int,
                     samples_ns: list[int]) -> None:
    num_keys = len(keys)
    for i in range(offset, offset + num_requests):
        key = keys[i % num_keys]
        start_ns = time.perf_counter_ns()
        await store.claim_or_touch(key, "worker-0")
        samples_ns.append(time.perf_counter_ns() - start_ns)


async def run(redis_url: str, num_requests: int, num_sessions: int, num_blocks: int) -> dict[str, np.ndarray]:
    """Time ``claim_or_touch`` on each store; returns per-store latencies in seconds, shape ``[num_requests]``."""
    prefix = f"kvgate-bench:{time.time_ns()}:"
    configs = {
        "memory": SessionsConfig(store="memory"),
        "redis, cache off": SessionsConfig(store="redis", url=redis_url, key_prefix=prefix + "a:"),
        "redis, cache on": SessionsConfig(store="redis", url=redis_url, key_prefix=prefix + "b:",
                                          enable_local_cache=True),
    }
    stores = {name: build_session_store(config) for name, config in configs.items()}
    samples: dict[str, list[int]] = {name: [] for name in stores}
    keys = [f"conversation-{i:06d}" for i in range(num_sessions)]
    try:
        for store in stores.values():
            await store.start()
        for _ in range(200):  # warm-up: connections, script load, subscription
            for store in stores.values():
                await store.claim_or_touch("warm-up", "worker-0")
        per_block = max(1, num_requests // num_blocks)
        for block in range(num_blocks):
            for name, store in stores.items():
                await _run_block(store, keys, per_block, block * per_block, samples[name])
        for name, store in stores.items():
            if store.stats().is_degraded:
                raise SystemExit(f"{name}: Redis became unavailable during the run")
    finally:
        for store in stores.values():
            await store.aclose()
    return {name: np.asarray(ns, dtype=np.float64) / 1e9 for name, ns in samples.items()}


def report(latencies_s: dict[str, np.ndarray]) -> str:
    """Table of p50/p99 (µs) per store, and added latency (difference and ratio) against the memory store."""
    base = latencies_s["memory"]
    base_p50, base_p99 = np.percentile(base, 50), np.percentile(base, 99)
    lines = [f"{'store':<18} {'n':>7} {'p50 us':>9} {'p99 us':>9} {'+p50 us':>9} {'+p99 us':>9} "
             f"{'p50 ratio':>9} {'p99 ratio':>9}"]
    for name, values in latencies_s.items():
        p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
        lines.append(f"{name:<18} {len(values):>7} {p50 * 1e6:>9.1f} {p99 * 1e6:>9.1f} "
                     f"{(p50 - base_p50) * 1e6:>9.1f} {(p99 - base_p99) * 1e6:>9.1f} "
                     f"{p50 / base_p50:>9.1f} {p99 / base_p99:>9.1f}")
    added_p50_ms = (np.percentile(latencies_s["redis, cache off"], 50) - base_p50) * 1e3
    verdict = "met" if added_p50_ms <= 0.3 else "NOT met"
    lines.append(f"target: <= 0.3 ms p50 added with the cache off: {added_p50_ms:.3f} ms ({verdict})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sessions", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start a private one)")
    parser.add_argument("--num-requests", type=int, default=20_000, help="timed requests per store")
    parser.add_argument("--num-sessions", type=int, default=1_000, help="distinct session keys")
    parser.add_argument("--num-blocks", type=int, default=10, help="interleaved blocks per store")
    parser.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True,
                        help="run on uvloop when installed (as the gateway does)")
    args = parser.parse_args(argv)
    loop_factory = None
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            loop_factory = uvloop.new_event_loop
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(_own_redis_server())
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            latencies_s = runner.run(run(url, args.num_requests, args.num_sessions, args.num_blocks))
    loop_name = "uvloop" if loop_factory is not None else "asyncio"
    print(f"claim_or_touch latency per routed request, {loop_name}, {args.num_sessions} sessions, 127.0.0.1")
    print(report(latencies_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
