"""Gateway CPU per disaggregated request (two legs) against the aggregated path, in one run:
``python -m benchmarks.pd``.

Method. Two reference sim workers (``kvgate worker --time-scale 0``: no pacing, so the gateway is the bottleneck
being measured, not the simulated GPU) run as processes twice over: as two ``both`` workers for model ``agg``
(served aggregated: one upstream request per client request), and as one ``prefill`` and one ``decode`` worker for
model ``pd`` (``models[].pd``: the gateway sends the prefill leg, reads its ``kv_transfer_params``, then relays the
decode leg; the decode worker pulls the KV from the prefill worker itself). One ``kvgate serve`` process fronts both
models. The load generator (this process, aiohttp, ``--concurrency`` connections) sends the same non-streamed
completion (``--prompt-tokens`` byte tokens, ``max_tokens`` 4) to each model in turn, ``--rounds`` interleaved
rounds after a warm-up; the figure is the gateway process's CPU time (user + system, kernel clock:
``benchmarks.gateway._cpu_s``) per request, printed for both paths with the ratio PD / aggregated, plus client-side
p50 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.gateway import _cpu_s, _free_ports, _wait_port


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _load(port: int, model: str, prompt: str, n: int, c: int) -> list[float]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    latencies: list[float] = []
    remaining = [n]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c)) as s:

        async def one() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                t0 = time.perf_counter()
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{model}: status {r.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(c)))
    return latencies


async def run(num_requests: int, concurrency: int, rounds: int, prompt_tokens: int) -> None:
    py = sys.executable
    ports = _free_ports(5)
    gw_port, a0, a1, p0, d0 = ports
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for port, model, role in ((a0, "agg", "both"), (a1, "agg", "both"), (p0, "pd", "prefill"),
                                      (d0, "pd", "decode")):
                procs.append(_spawn([py, "-m", "router.cli", "worker", "--port", str(port), "--model", model,
                                     "--role", role, "--time-scale", "0", "--worker-id", f"{role}-{port}",
                                     "--log-level", "WARNING"]))
            cfg = {
                "listen": {"host": "127.0.0.1", "port": gw_port},
                "models": [{"name": "agg", "block_size": 16}, {"name": "pd", "block_size": 16,
                                                               "pd": {"protocol": "vllm"}}],
                "workers": [
                    {"id": "a0", "url": f"http://127.0.0.1:{a0}", "model": "agg", "snapshot_path": None},
                    {"id": "a1", "url": f"http://127.0.0.1:{a1}", "model": "agg", "snapshot_path": None},
                    {"id": "p0", "url": f"http://127.0.0.1:{p0}", "model": "pd", "role": "prefill",
                     "snapshot_path": None},
                    {"id": "d0", "url": f"http://127.0.0.1:{d0}", "model": "pd", "role": "decode",
                     "snapshot_path": None},
                ],
                "policy": {"name": "cache_aware"}, "admin": {"disable_auth": True}, "health": {"interval_s": 60},
            }
            cfg_path = Path(tmp) / "gateway.yaml"
            cfg_path.write_text(json.dumps(cfg))
            for port in (a0, a1, p0, d0):  # four processes importing at once: slow on a busy 2-core host
                await _wait_port(port, timeout_s=180.0)
            gw = _spawn([py, "-m", "router.cli", "serve", "--config", str(cfg_path), "--log-level", "WARNING"])
            procs.append(gw)
            await _wait_port(gw_port, "/ready", timeout_s=180.0)
            prompt = "".join(chr(ord("a") + i % 26) for i in range(prompt_tokens))
            results: dict[str, list[tuple[float, float]]] = {"agg": [], "pd": []}
            for model in results:
                await _load(gw_port, model, prompt, max(50, num_requests // 10), concurrency)  # warm-up
            for r in range(rounds):
                for model in (("agg", "pd") if r % 2 == 0 else ("pd", "agg")):
                    cpu0 = _cpu_s(gw.pid)
                    lat = await _load(gw_port, model, prompt, num_requests, concurrency)
                    cpu_us = (_cpu_s(gw.pid) - cpu0) / num_requests * 1e6
                    results[model].append((cpu_us, statistics.median(lat) * 1e3))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    agg = statistics.median(c for c, _ in results["agg"])
    pd = statistics.median(c for c, _ in results["pd"])
    print(f"gateway CPU per request, {prompt_tokens}-token prompt, {num_requests} requests x {rounds} rounds, "
          f"concurrency {concurrency} (medians over rounds)")
    print(f"{'path':12} {'CPU us/req':>11} {'min':>8} {'max':>8} {'p50 ms':>8}")
    for name, label in (("agg", "aggregated"), ("pd", "PD (2 legs)")):
        cpus = [c for c, _ in results[name]]
        print(f"{label:12} {statistics.median(cpus):11.1f} {min(cpus):8.1f} {max(cpus):8.1f} "
              f"{statistics.median(p for _, p in results[name]):8.2f}")
    print(f"ratio PD / aggregated: {pd / agg:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    asyncio.run(run(args.requests, args.concurrency, args.rounds, args.prompt_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
