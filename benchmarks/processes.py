"""Every core: ``python -m benchmarks processes``: requests/s and CPU per request of ``kvgate serve --processes N``.

For each N in ``--processes`` (default 1, 2, 4, 8): ``--num-backends`` fake backend processes (one worker each,
``benchmarks.gateway``'s backend: a fixed answer), ``kvgate serve --processes N`` (``cache_aware``, block size 16,
byte-level tokens) over them, and ``--num-clients`` load-generator processes, each with ``--concurrency``
connections, sending 2 KB ``/v1/completions`` prompts (``--sessions`` distinct conversations, so the index and
the prefix caches work) for ``--duration-s`` seconds after a warm-up. Reported: requests/s (all clients), the
gateway processes' CPU per request (the children's kernel CPU clocks over the measured window) and cores used,
and the ratio of requests/s to N = 1. With at least 16 CPUs, backends, gateways and clients are pinned to
disjoint cores.

``--demo``: instead, the demo replay (``kvgate demo``'s sim fleet and the bundled Mooncake slice,
``--demo-requests`` requests, one policy ``--demo-policy``) through ``kvgate serve --processes N`` for each N:
the hit ratio (cached ÷ prompt tokens the workers report) and the cached-token mismatch ratio, with the hit ratio
as a ratio to N = 1. ``session_sticky`` with N > 1 needs the sessions in Redis (``--redis-url``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.gateway import _cpu_s, _free_ports, _spawn, _wait_port


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(t) for t in text)
    return out


async def _client(port: int, concurrency: int, duration_s: float, sessions: int, seed: int) -> int:
    url = f"http://127.0.0.1:{port}/v1/completions"
    bodies = [json.dumps({"model": "m", "prompt": f"session {seed}-{s} " + "x" * 2000, "max_tokens": 4}).encode()
              for s in range(sessions)]
    done = 0
    deadline = time.monotonic() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def one(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < deadline:
                async with http.post(url, data=bodies[i % sessions],
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}")
                done += 1
                i += concurrency

        await asyncio.gather(*(one(k) for k in range(concurrency)))
    return done


def _client_main(args: argparse.Namespace) -> None:
    import uvloop

    n = uvloop.run(_client(args.port, args.concurrency, args.duration_s, args.sessions, args.seed))
    print(n, flush=True)


def _plan(num_backends: int, num_gateways: int, num_clients: int) -> tuple[list[set[int]] | None, set[int] | None,
                                                                          list[set[int]] | None]:
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < num_backends + num_gateways + num_clients:
        return None, None, None
    backends = [{c} for c in usable[:num_backends]]
    gateways = set(usable[num_backends: num_backends + num_gateways])
    clients = [{c} for c in usable[num_backends + num_gateways: num_backends + num_gateways + num_clients]]
    return backends, gateways, clients


def run_point(n: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """``(requests/s, gateway CPU us per request, gateway cores)`` at ``n`` processes."""
    py = sys.executable
    backend_ports = _free_ports(args.num_backends)
    (port,) = _free_ports(1)
    backend_cores, gateway_cores, client_cores = _plan(args.num_backends, n, args.num_clients)
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-procs-"))
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, "models": [{"name": "m", "block_size": 16}],
           "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "m", "load_path": None,
                        "snapshot_path": None} for i, p in enumerate(backend_ports)],
           "policy": {"name": "cache_aware"}, "admin": {"disable_auth": True}, "health": {"interval_s": 60}}
    (tmp / "gateway.yaml").write_text(json.dumps(cfg))
    try:
        for i, p in enumerate(backend_ports):
            procs.append(_spawn([py, "-m", "benchmarks.gateway", "--role", "backend", "--ports", str(p)],
                                backend_cores[i] if backend_cores else None))
        gateway = _spawn([py, "-m", "router.cli", "serve", "--config", str(tmp / "gateway.yaml"), "--processes",
                          str(n), "--log-level", "WARNING"], gateway_cores)
        procs.append(gateway)

        async def ready() -> None:
            for p in backend_ports:
                await _wait_port(p)
            await _wait_port(port, "/health", 60)

        asyncio.run(ready())
        time.sleep(1.0)  # every child listening
        children = _children(gateway.pid) if n > 1 else [gateway.pid]

        def clients(duration_s: float) -> list[subprocess.Popen[bytes]]:
            return [subprocess.Popen(
                [py, "-m", "benchmarks.processes", "--role", "client", "--port", str(port), "--concurrency",
                 str(args.concurrency), "--duration-s", str(duration_s), "--sessions", str(args.sessions),
                 "--seed", str(k)], stdout=subprocess.PIPE,
                preexec_fn=(lambda c=client_cores[k]: os.sched_setaffinity(0, c)) if client_cores else None)
                for k in range(args.num_clients)]

        for c in clients(1.0):  # warm-up
            c.communicate()
        cpu0 = sum(_cpu_s(pid) for pid in children)
        t0 = time.monotonic()
        total = sum(int(c.communicate()[0].split()[-1]) for c in clients(args.duration_s))
        wall = time.monotonic() - t0
        cpu = sum(_cpu_s(pid) for pid in children) - cpu0
        return total / args.duration_s, cpu / max(1, total) * 1e6, cpu / max(wall, args.duration_s)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def run_demo_points(args: argparse.Namespace) -> None:
    """``--demo``: the demo replay's hit ratio at each N (module docstring)."""
    from rich.console import Console

    from loadgen.demo import DemoConfig, find_default_trace, run_demo

    trace = find_default_trace()
    if trace is None:
        raise SystemExit("the bundled trace loadgen/data/conversation_trace_head.jsonl is missing")
    out = Path(tempfile.mkdtemp(prefix="kvgate-procs-demo-"))
    console = Console(stderr=True)
    print(f"demo replay: {args.demo_requests} requests of the bundled slice, policy {args.demo_policy}, "
          f"{args.demo_workers} sim workers" + (f", sessions in Redis {args.redis_url}" if args.redis_url else ""))
    print(f"{'N':>3} {'hit ratio':>10} {'x N=1':>6} {'mismatch':>9} {'TTFT p50 s':>11}")
    base = None
    for n in args.processes:
        config = DemoConfig(trace=trace, out=str(out / f"n{n}"), num_workers=args.demo_workers,
                            max_requests=args.demo_requests, policies=(args.demo_policy,), gateway_processes=n,
                            redis_url=args.redis_url, show_progress=False, write_plots=False, is_quick=True)
        outcomes, _ = asyncio.run(run_demo(config, console))
        summary = outcomes[0].summary
        base = base or summary.hit_ratio
        mismatch = summary.cached_tokens_mismatch_ratio
        print(f"{n:3d} {summary.hit_ratio:10.3f} {summary.hit_ratio / base:6.3f} "
              f"{mismatch if mismatch is not None else float('nan'):9.3f} "
              f"{summary.ttft_p50_s if summary.ttft_p50_s is not None else float('nan'):11.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", choices=("bench", "client"), default="bench")
    parser.add_argument("--processes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--num-backends", type=int, default=4)
    parser.add_argument("--num-clients", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16, help="connections per client process")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo", action="store_true", help="the demo replay's hit ratio at each N instead")
    parser.add_argument("--demo-requests", type=int, default=120, help="--demo: requests of the bundled slice")
    parser.add_argument("--demo-workers", type=int, default=4, help="--demo: sim workers")
    parser.add_argument("--demo-policy", default="cache_aware", help="--demo: the policy (a demo label)")
    parser.add_argument("--redis-url", default=None, help="--demo: keep the gateway's sessions in this Redis")
    args = parser.parse_args(argv)
    if args.role == "client":
        _client_main(args)
        return
    if args.demo:
        run_demo_points(args)
        return
    print(f"{args.num_backends} backends, {args.num_clients} clients x {args.concurrency} connections, 2 KB prompts, "
          f"{args.duration_s} s per point, {os.cpu_count()} CPUs")
    print(f"{'N':>3} {'req/s':>9} {'CPU us/req':>11} {'cores':>6} {'x N=1':>6}")
    base = None
    for n in args.processes:
        rps, cpu_us, cores = run_point(n, args)
        base = base or rps
        print(f"{n:3d} {rps:9.0f} {cpu_us:11.1f} {cores:6.2f} {rps / base:6.2f}", flush=True)


if __name__ == "__main__":
    main()
