"""Gateway benchmarks: ``python -m benchmarks.gateway``.

(a) Cost per proxied request. One fast fake backend process (aiohttp + uvloop, ``--num-workers`` ports = that many
workers, 2 by default) answers ``/v1/completions`` with a fixed body (non-streaming, ~2 KB prompt in, small JSON
out) or a 4-event SSE stream. In front of it, each in its own process and measured in the same run with the same
load:

* ``direct``     the backend itself (baseline for added latency);
* ``bare``       a bare aiohttp + uvloop + msgspec pass-through proxy with no routing (baseline for CPU);
* ``kvgate``     ``kvgate serve`` with ``cache_aware`` (tokenize, hash, index match, policy, proxy);
* ``sglang``     SGLang's router (``cache_aware``) from a separate venv, if one is installed at
                 ``~/.cache/kvgate/sglr`` (skipped with a message otherwise).

The load generator runs in this process (aiohttp, ``--concurrency`` connections). CPU µs per request is the
proxy process's CPU time (user + system, read from its kernel CPU clock: ``_cpu_s``) over the measured requests;
latency p50/p99 are client side (each measurement after its own warm-up). ``--rounds`` interleaved rounds (the
target order rotated each round, so drift on a shared machine hits every target) give per target the median and the
best (lowest) CPU and its spread; figures are printed as ratios to the baselines of the same run. With at least
8 CPUs (or ``--pin``), every process gets cores of its own (``sched_setaffinity``: the load generator, the backend,
each proxy), so no proxy shares a core's caches with another process or migrates between cores; ``--no-pin`` turns
it off.

(b) Routing decision time for a 32,768-token chat: the request view (incremental tokenization + hashing) plus
index match and policy select, for the first turn and for an incremental next turn.

(c) ``--instructions``: user-space instructions per proxied request of ``bare`` and ``kvgate`` under valgrind's
callgrind (``bench_instructions``), the repeatable figure behind the CPU ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SGLR_PYTHON = Path.home() / ".cache" / "kvgate" / "sglr" / "bin" / "python"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) that process ``pid`` has used so far.

    Read from the kernel's per-process CPU clock, exact to the nanosecond: clock id ``(~pid << 3) | 2``
    (``CPUCLOCK_SCHED`` of a process, Linux ``include/linux/posix-timers.h``; what ``clock_getcpuclockid(3)``
    returns). Where that clock cannot be read, ``/proc/<pid>/stat``'s utime + stime, which count whole ticks
    (``SC_CLK_TCK``, 10 ms): sampled at each tick, so short runs of a process that sleeps and wakes often are
    mis-measured."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- processes ----------------------------------------------------------------------------------------------


async def _backend(ports: list[int]) -> None:
    usage = {"prompt_tokens": 2048, "completion_tokens": 4, "total_tokens": 2052,
             "prompt_tokens_details": {"cached_tokens": 0}}
    body = msgspec.json.encode({"id": "c", "object": "text_completion", "model": "m",
                                "choices": [{"index": 0, "text": "abcd", "finish_reason": "length"}],
                                "usage": usage})
    events = [b'data: {"id":"c","choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(3)]
    events.append(b"data: " + msgspec.json.encode({"id": "c", "choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b'"stream":true' not in raw.replace(b" ", b""):
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"{}", content_type="application/json")

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": tempfile.gettempdir(), "served_model_name": "m"})

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    for path in ("/v1/completions/render", "/v1/chat/completions/render"):  # vllm-router asks; vLLM-only
        app.router.add_post(path, not_found)
    app.router.add_get("/health", health)
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        app.router.add_get(path, info)
    app.router.add_get("/v1/models", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _bare_proxy(port: int, upstream: str) -> None:
    """Bare pass-through: parse the body with msgspec (as a router would), forward it with the client's headers,
    stream the answer back with the worker's headers (hop-by-hop headers dropped both ways, as any proxy must)."""
    from router.transport import HOP_BY_HOP_HEADERS

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    class _Body(msgspec.Struct):
        model: str
        stream: bool = False

    decoder = msgspec.json.Decoder(_Body)

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        decoder.decode(raw)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP_HEADERS]
        async with session.post(upstream + request.path, data=raw, headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP_HEADERS})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def _spawn(args: list[str], cores: set[int] | None = None, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    """Start ``args`` (output discarded), on ``cores`` only when given, with ``env`` over this process's
    environment."""
    full_env = {**os.environ, **env} if env else None
    if cores is None:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=full_env)
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=full_env,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))


def _core_plan(pin: bool | None) -> dict[str, set[int]] | None:
    """Cores per process when pinning (``None``: not pinned). ``pin=None`` pins when at least 8 CPUs are usable."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if pin is False or (pin is None and len(usable) < 8):
        return None
    if len(usable) < 6:
        raise SystemExit(f"--pin needs at least 6 usable CPUs, found {len(usable)}")
    return {"load": {usable[0]}, "backend": {usable[1], usable[2]}, "bare": {usable[3]}, "kvgate": {usable[4]},
            "sglang": {usable[5]}}


async def _wait_port(port: int, path: str = "/health", timeout_s: float = 30.0) -> None:
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with s.get(f"http://127.0.0.1:{port}{path}") as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {port} did not come up")
            await asyncio.sleep(0.1)


# -- load ---------------------------------------------------------------------------------------------------


async def _load(port: int, body: bytes, num_requests: int, concurrency: int) -> list[float]:
    latencies: list[float] = []
    url = f"http://127.0.0.1:{port}/v1/completions"
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        remaining = [num_requests]

        async def worker() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                t0 = time.perf_counter()
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def _measure(pid: int | None, port: int, body: bytes, n: int, c: int) -> dict[str, float]:
    await _load(port, body, max(50, n // 10), c)  # warm-up
    cpu0 = _cpu_s(pid) if pid else 0.0
    lat = await _load(port, body, n, c)
    cpu1 = _cpu_s(pid) if pid else 0.0
    lat.sort()
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
            "cpu_us": (cpu1 - cpu0) / n * 1e6 if pid else float("nan")}


def _report(kind: str, runs: dict[str, list[dict[str, float]]], n: int, c: int, rounds: int) -> None:
    """One table: per target the median over rounds of p50/p99 and CPU, the best (lowest) CPU and its spread
    (max - min); ratios to the bare proxy for the medians and for the bests."""
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def best(name: str) -> float:
        return min(r["cpu_us"] for r in runs[name])

    direct = med("direct", "p50_ms")
    base_med, base_best = med("bare", "cpu_us"), best("bare")
    print(f"\n{kind}, 2 KB prompt, {n} requests x {rounds} rounds, concurrency {c} (medians over rounds)")
    print(f"{'target':8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'CPU us/req':>11} {'best':>7} {'spread':>7} "
          f"{'/bare':>6} {'best/bare':>9}")
    for name in runs:
        if name == "direct":
            print(f"{name:8} {med(name, 'p50_ms'):8.3f} {med(name, 'p99_ms'):8.3f} {0.0:8.3f}")
            continue
        cpus = [r["cpu_us"] for r in runs[name]]
        print(f"{name:8} {med(name, 'p50_ms'):8.3f} {med(name, 'p99_ms'):8.3f} {med(name, 'p50_ms') - direct:8.3f} "
              f"{med(name, 'cpu_us'):11.1f} {best(name):7.1f} {max(cpus) - min(cpus):7.1f} "
              f"{med(name, 'cpu_us') / base_med:6.2f} {best(name) / base_best:9.2f}")


def _gateway_args(py: str, tmp: str, port: int, worker_ports: tuple[int, ...]) -> list[str]:
    """``kvgate serve`` with ``cache_aware`` over the backend's ports (its config written under ``tmp``)."""
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, "models": [{"name": "m", "block_size": 16}],
           "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{p}", "model": "m", "load_path": None,
                        "snapshot_path": None} for i, p in enumerate(worker_ports)],
           "policy": {"name": "cache_aware"}, "admin": {"disable_auth": True}, "health": {"interval_s": 60}}
    cfg_path = Path(tmp) / "gateway.yaml"
    cfg_path.write_text(json.dumps(cfg))
    return [py, "-m", "router.cli", "serve", "--config", str(cfg_path), "--log-level", "WARNING"]


def _free_ports(k: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def bench_proxy(
    num_requests: int, concurrency: int, rounds: int = 3, *, num_workers: int = 2, pin: bool | None = None,
) -> None:
    """Benchmark (a); prints one table per request kind (``rounds`` interleaved measurements per target)."""
    py = sys.executable
    cores = _core_plan(pin)
    worker_ports = tuple(_free_ports(num_workers))
    b1 = worker_ports[0]
    bare, gate, sgl = _free_ports(3)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    tmp = tempfile.mkdtemp(prefix="kvgate-bench-")
    print(f"\n{num_workers} workers; " + (
        "not pinned" if cores is None else "pinned: " + ", ".join(f"{k} {sorted(v)}" for k, v in cores.items())))
    own_cores = os.sched_getaffinity(0) if cores is not None else set()

    def on(plan: dict[str, set[int]] | None, name: str) -> set[int] | None:
        return plan[name] if plan is not None else None

    try:
        if cores is not None:
            os.sched_setaffinity(0, cores["load"])
        procs["backend"] = _spawn([py, "-m", "benchmarks.gateway", "--role", "backend", "--ports",
                                   ",".join(map(str, worker_ports))], on(cores, "backend"))
        await _wait_port(b1)
        procs["bare"] = _spawn([py, "-m", "benchmarks.gateway", "--role", "bare", "--ports", str(bare),
                                "--upstream", f"http://127.0.0.1:{b1}"], on(cores, "bare"))
        procs["kvgate"] = _spawn(_gateway_args(py, tmp, gate, worker_ports), on(cores, "kvgate"))
        if SGLR_PYTHON.exists():
            procs["sglang"] = _spawn([str(SGLR_PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                      "--port", str(sgl), "--worker-urls",
                                      *(f"http://127.0.0.1:{p}" for p in worker_ports),
                                      "--policy", "cache_aware", "--prometheus-host",
                                      "127.0.0.1", "--prometheus-port", str(_free_ports(1)[0]),
                                      "--log-level", "warn"], on(cores, "sglang"))
        else:
            print(f"sglang-router: skipped (no venv at {SGLR_PYTHON.parent.parent}; "
                  "python3 -m venv it and pip install sglang-router)")
        await _wait_port(gate)
        await _wait_port(bare, "/v1/completions")
        targets = {"direct": (procs["backend"].pid, b1), "bare": (procs["bare"].pid, bare),
                   "kvgate": (procs["kvgate"].pid, gate)}
        if "sglang" in procs:
            try:
                await _wait_port(sgl, "/health", 60)
                targets["sglang"] = (procs["sglang"].pid, sgl)
            except RuntimeError:
                print("sglang-router: did not come up; skipped")
        prompt = "x" * 2000
        for kind, stream in (("non-streaming", False), ("streaming", True)):
            body = msgspec.json.encode({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream})
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            names = list(targets)
            for r in range(rounds):  # interleaved rounds, the order rotated each round: drift hits every target
                for name in names[r % len(names):] + names[: r % len(names)]:
                    pid, port = targets[name]
                    runs[name].append(await _measure(pid if name != "direct" else None, port, body, num_requests,
                                                     concurrency))
            _report(kind, runs, num_requests, concurrency, rounds)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=10)
        if cores is not None:
            os.sched_setaffinity(0, own_cores)


async def bench_instructions(num_requests: int, concurrency: int, num_workers: int = 2) -> None:
    """Benchmark (c): user-space instructions per proxied request, bare proxy and kvgate, each run alone under
    valgrind's callgrind with counting switched on (``callgrind_control``) only around ``num_requests`` requests
    after a warm-up. Deterministic to about 1 % run to run, so it resolves changes the CPU-time table cannot on a
    shared host; it does not see kernel time or cache misses."""
    py = sys.executable
    tmp = tempfile.mkdtemp(prefix="kvgate-bench-")
    print(f"\nuser-space instructions per request (callgrind), 2 KB prompt, {num_requests} requests, "
          f"concurrency {concurrency}, {num_workers} workers")
    print(f"{'kind':14} {'bare':>9} {'kvgate':>9} {'/bare':>6}")
    for kind, stream in (("non-streaming", False), ("streaming", True)):
        body = msgspec.json.encode({"model": "m", "prompt": "x" * 2000, "max_tokens": 4, "stream": stream})
        counts: dict[str, float] = {}
        for name in ("bare", "kvgate"):
            port, *worker_ports = _free_ports(1 + num_workers)
            b1 = worker_ports[0]
            out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
            backend = _spawn([py, "-m", "benchmarks.gateway", "--role", "backend", "--ports",
                              ",".join(map(str, worker_ports))])
            args = ([py, "-m", "benchmarks.gateway", "--role", "bare", "--ports", str(port), "--upstream",
                     f"http://127.0.0.1:{b1}"] if name == "bare"
                    else _gateway_args(py, str(out), port, tuple(worker_ports)))
            target = _spawn(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                             f"--callgrind-out-file={out}/callgrind.out", *args])
            try:
                await _wait_port(b1)
                await _wait_port(port, "/v1/completions" if name == "bare" else "/health", 300)
                await _load(port, body, 300, concurrency)
                for command in (["-i", "on"], None, ["-i", "off"], ["-d"]):
                    if command is None:
                        await _load(port, body, num_requests, concurrency)
                    else:
                        subprocess.run(["callgrind_control", *command, str(target.pid)], check=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            finally:
                for proc in (target, backend):
                    proc.terminate()
                    proc.wait(timeout=60)
            total = 0
            for dump in out.glob("callgrind.out*"):
                for line in dump.read_text(errors="replace").splitlines():
                    if line.startswith("totals:"):
                        total += int(line.split()[1])
            counts[name] = total / num_requests
        print(f"{kind:14} {counts['bare'] / 1e3:8.1f}K {counts['kvgate'] / 1e3:8.1f}K "
              f"{counts['kvgate'] / counts['bare']:6.3f}")


def bench_decision(num_tokens: int = 32_768) -> None:
    """Benchmark (b): decision time for a long chat, first turn and incremental next turn."""
    from policies import build_policy, decode_policy_config
    from policies.base import RequestView, Snapshot, WorkerState
    from router.config import ModelConfig
    from router.index import IndexConfig, PrefixIndex
    from router.request_view import ModelTokenizer, parse_request

    model = ModelTokenizer(ModelConfig(name="m", block_size=16))
    index = PrefixIndex(IndexConfig(block_size=16))
    policy = build_policy(decode_policy_config({"name": "cache_aware"}))
    messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
    i = 0
    while sum(len(m["content"]) for m in messages) < num_tokens - 600:
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "y" * 990})
        i += 1

    def decide(msgs: list[dict[str, str]]) -> tuple[float, int]:
        body = msgspec.json.encode({"model": "m", "messages": msgs})
        t0 = time.perf_counter()
        parsed = parse_request("chat", body)
        view = model.view(parsed)
        match = index.match(view.block_hashes)
        states = tuple(WorkerState(f"w{k}", num_gpu_cached_tokens=(m.num_gpu_blocks * 16 if (
            m := match.workers.get(f"w{k}")) else 0)) for k in range(8))
        policy.select(RequestView("r", "m", view.num_tokens, 256, 16), Snapshot(states))
        return time.perf_counter() - t0, view.num_tokens

    first_s, n = decide(messages)
    follow: list[float] = []
    for turn in range(20):
        messages = messages + [{"role": "assistant", "content": "ok " * 30},
                               {"role": "user", "content": f"next {turn} " * 30}]
        follow.append(decide(messages)[0])
    print(f"\ndecision time, {n}-token chat: first turn {first_s * 1e3:.2f} ms, "
          f"incremental next turn p50 {statistics.median(follow) * 1e3:.3f} ms "
          f"(max {max(follow) * 1e3:.3f} ms, target <= 1 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", choices=("bench", "backend", "bare"), default="bench")
    parser.add_argument("--ports", default="")
    parser.add_argument("--upstream", default="")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds per target")
    parser.add_argument("--num-workers", type=int, default=2, help="backend ports = workers behind each router")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                        help="a core per process (default: on with at least 8 CPUs)")
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--skip-decision", action="store_true")
    parser.add_argument("--instructions", action="store_true",
                        help="only (c): instructions per request under valgrind callgrind (needs valgrind)")
    args = parser.parse_args()
    for name in ("requests", "concurrency", "rounds", "num_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind on PATH (apt-get install valgrind)")
    import uvloop

    if args.role == "backend":
        uvloop.run(_backend([int(p) for p in args.ports.split(",")]))
    elif args.role == "bare":
        uvloop.run(_bare_proxy(int(args.ports), args.upstream))
    elif args.instructions:
        uvloop.run(bench_instructions(min(args.requests, 1000), args.concurrency, args.num_workers))
    else:
        if not args.skip_decision:
            bench_decision()
        if not args.skip_proxy:
            uvloop.run(bench_proxy(args.requests, args.concurrency, args.rounds, num_workers=args.num_workers,
                                   pin=args.pin))


if __name__ == "__main__":
    main()
