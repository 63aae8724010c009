"""One huge prompt among small requests: ``python -m benchmarks huge_prompt``.

A 15 MB prompt (``--prompt-mb``; text lines of this repository, tokenized with the Llama-3-shaped BPE of
``benchmarks._bpe``: about 3.5M tokens, 219K blocks of 16) must not stall the gateway's event loop: the gateway
tokenizes and hashes long prompts in its tokenizer threads (``router.request_view.ModelTokenizer.view_async``),
and what stays on the loop (the JSON decode of the body, the cache lookups, the routing decision with its index
match and pending insert, the proxying of 15 MB) must stay short.

Method, in one run: the gateway app (``router.app.build_app``, ``cache_aware``, the real HTTP server on loopback)
runs in this process; a fake backend (``benchmarks.gateway``'s, another process) answers every request at once.
Small requests (a ~2 KB completion, ``--concurrency`` at a time, closed loop) are sent

* **baseline**: for ``--baseline-s`` seconds with nothing else;
* **huge**: while one huge prompt is sent and routed, until its answer is back (each ``--kind``:
  ``completions``, a text prompt, and ``chat``, one user message).

For each phase: the small requests' p50 / p99 latency and count, and the event loop's lag (a probe task sleeping
1 ms and recording how late it wakes: max and p99; for the worst stall, the loop thread's and the process's CPU
time within it and when it came, in seconds since the phase began), printed with the ratio huge / baseline. The
load generator shares the loop with the gateway (the same in both phases). Then the on-loop steps of the huge
prompt, each timed alone on a fresh tokenizer and index (``parse``: ``parse_request``; ``plan``: the cache lookups
before tokenizing; ``commit``: the cache writes after; ``match + insert``: the index match and the pending insert of
the first ``models[].max_routed_blocks`` blocks, beside the insert of every block it replaced), beside its off-loop
tokenize + hash time, so what dominates is visible.

Measured (a shared 2-core host at load average 5-8, so the small requests' p99 moved 5-40 ms between runs of the
same code): with the body decoded and the prompt planned on the loop, the worst stall during the huge request
came as it arrived (0.1 s) with 43 ms (completions) and 65 ms (chat) of the loop thread's own CPU in it; with a body
over ``router.api.OFF_LOOP_BODY_BYTES`` decoded in a thread and a prompt over ``OFF_LOOP_PLAN_CHARS``
planned in a tokenizer thread, the worst stalls carry 2-3 ms of the loop's CPU (the rest is the host and the
tokenizer threads). Measured apart in one process (a 1 ms sleeper's longest wait while one 15 MB body is parsed and
planned, median of 5 alternating rounds): completions 415 -> 204 ms, chat 461 -> 237 ms. What is left is the
decode itself: msgspec holds the GIL through one C call, so a thread cannot interleave it with other requests (JSON
cannot be decoded in bounded pieces); only another process could.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from benchmarks.gateway import _free_ports, _spawn, _wait_port

CACHE_DIR = Path.home() / ".cache" / "kvgate"


class LoopProbe:
    """Records how late a task that sleeps ``period_s`` in a loop wakes (the loop's lag), in seconds, and how much
    of each wait the loop's thread spent on the CPU (``time.thread_time``): a stall with little of it is the host
    (other processes, the tokenizer threads holding the GIL), not the loop's own work."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self.worst = (0.0, 0.0, 0.0, 0.0)
        """(lag, the loop thread's CPU seconds during it, the process's, seconds since ``start``) of the worst
        stall: the process's CPU near the lag with little of the loop's is another thread holding the GIL; both
        near 0, the host did not run the process."""
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        started = time.perf_counter()
        while True:
            t0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
            await asyncio.sleep(self.period_s)
            lag = time.perf_counter() - t0 - self.period_s
            self.lags.append(lag)
            if lag > self.worst[0]:
                self.worst = (lag, time.thread_time() - cpu0, time.process_time() - proc0, t0 - started)

    def start(self) -> None:
        self.lags = []
        self.worst = (0.0, 0.0, 0.0, 0.0)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> list[float]:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return sorted(self.lags)


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))] if sorted_values else 0.0


def make_text(num_chars: int, seed: int = 0) -> str:
    """``num_chars`` characters of this repository's non-empty lines, in a random order."""
    from benchmarks._bpe import repository_corpus

    lines = [ln for text in repository_corpus(Path(__file__).resolve().parent.parent) for ln in text.splitlines()
             if ln.strip()]
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < num_chars:
        line = rng.choice(lines)
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)[:num_chars]


def huge_body(kind: str, text: str) -> bytes:
    if kind == "chat":
        return msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    return msgspec.json.encode({"model": "m", "prompt": text, "max_tokens": 1})


async def small_load(session: aiohttp.ClientSession, url: str, body: bytes, concurrency: int,
                     until: Callable[[], bool]) -> list[float]:
    """Closed-loop small requests, ``concurrency`` at a time, until ``until()``; their latencies (s)."""
    latencies: list[float] = []
    headers = {"Content-Type": "application/json"}

    async def one_client() -> None:
        while not until():
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"small request answered {r.status}")
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return sorted(latencies)


async def phase(url: str, probe: LoopProbe, concurrency: int, small: bytes,
                job: Callable[[aiohttp.ClientSession], Awaitable[Any]] | None, baseline_s: float) -> dict[str, Any]:
    """One measured phase: small load for ``baseline_s`` (``job`` None), or while ``job`` runs."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        done = asyncio.Event()
        extra: dict[str, Any] = {}
        probe.start()
        t0 = time.perf_counter()
        if job is None:
            asyncio.get_running_loop().call_later(baseline_s, done.set)
        else:
            async def run_job() -> None:
                try:
                    extra["job"] = await job(session)
                finally:
                    extra["job_s"] = time.perf_counter() - t0
                    done.set()

            job_task = asyncio.get_running_loop().create_task(run_job())
        latencies = await small_load(session, url, small, concurrency, done.is_set)
        lags = await probe.stop()
        if job is not None:
            await job_task
        return {"latencies": latencies, "lags": lags, "worst": probe.worst, "duration_s": time.perf_counter() - t0,
                **extra}


def _row(name: str, got: dict[str, Any], base: dict[str, Any] | None) -> str:
    lat, lags = got["latencies"], got["lags"]
    p50, p99, lag_max, lag_p99 = _pct(lat, 0.5), _pct(lat, 0.99), lags[-1] if lags else 0.0, _pct(lags, 0.99)
    worst_lag, worst_cpu, worst_process_cpu, worst_at = got["worst"]
    text = (f"{name:<22} {len(lat):6d} {p50 * 1e3:9.2f} {p99 * 1e3:9.2f} {lag_max * 1e3:11.1f} {lag_p99 * 1e3:10.2f}"
            f" {worst_cpu * 1e3:12.1f} {worst_process_cpu * 1e3:12.1f} {worst_at:8.1f}")
    if base is not None:
        b = base["latencies"], base["lags"]
        text += (f"   x{p50 / _pct(b[0], 0.5):.2f} p50, x{p99 / _pct(b[0], 0.99):.2f} p99, "
                 f"x{lag_max / max(b[1][-1], 1e-6):.1f} lag max")
    return text


def breakdown(kind: str, body: bytes, tokenizer_path: Path) -> dict[str, float]:
    """The huge request's steps timed alone (seconds): on the loop (parse, plan, commit, route) and off it."""
    from router.config import ModelConfig
    from router.index import IndexConfig, PrefixIndex
    from router.request_view import ModelTokenizer, PromptView, parse_request

    model = ModelTokenizer(ModelConfig(name="m", block_size=16, tokenizer_path=str(tokenizer_path)))
    index = PrefixIndex(IndexConfig(block_size=16))
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    parsed = parse_request(kind, body)  # type: ignore[arg-type]
    out["parse (loop)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = model.plan(parsed)
    out["plan (loop)"] = time.perf_counter() - t0
    assert not isinstance(plan, PromptView)
    t0 = time.perf_counter()
    view, commit = plan.build(model.encode_many(plan.texts))
    out["tokenize + hash (thread)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if commit is not None:
        commit()
    out["commit (loop)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.match(view.block_hashes)
    index.insert_approximate("w0", view.block_hashes[:model.config.max_routed_blocks], time.monotonic())
    out["match + insert (loop)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.insert_approximate("w1", view.block_hashes, time.monotonic())
    out["(insert of every block, uncapped)"] = time.perf_counter() - t0
    out["num_blocks"] = float(len(view.block_hashes))
    return out


async def bench(args: argparse.Namespace) -> None:
    from benchmarks._bpe import llama3_shaped_tokenizer
    from router.app import build_app
    from router.config import parse_config
    from router.http_server import GatewayAppRunner

    tokenizer_path = llama3_shaped_tokenizer(CACHE_DIR / "models")
    text = make_text(int(args.prompt_mb * 1e6))
    backend_port, = _free_ports(1)
    backend = _spawn([sys.executable, "-m", "benchmarks.gateway", "--role", "backend", "--ports", str(backend_port)])
    try:
        await _wait_port(backend_port)
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0, "max_body_bytes": 64 * 1024 * 1024},
            "models": [{"name": "m", "block_size": 16, "tokenizer_path": str(tokenizer_path)}],
            "workers": [{"id": "w0", "url": f"http://127.0.0.1:{backend_port}", "model": "m", "load_path": None,
                         "snapshot_path": None}],
            "policy": {"name": "cache_aware"}, "admin": {"disable_auth": True}, "health": {"interval_s": 3600}})
        runner = GatewayAppRunner(build_app(config), handler_cancellation=True, access_log=None)
        await runner.setup()
        gc.freeze()  # as ``router.serve`` does once the app is built: full collections skip what lives for good
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        small = msgspec.json.encode({"model": "m", "prompt": make_text(2000, seed=1), "max_tokens": 1})
        probe = LoopProbe()
        await phase(url, probe, args.concurrency, small, None, 1.0)  # warm-up (tokenizer threads, connections)
        print(f"{args.prompt_mb:g} MB prompt among small requests ({args.concurrency} at a time); "
              f"gateway and load generator on one loop; host: {os.cpu_count()} CPUs")
        print(f"{'phase':<22} {'small':>6} {'p50 ms':>9} {'p99 ms':>9} {'lag max ms':>11} {'lag p99 ms':>10}"
              f" {'its loop CPU':>12} {'process CPU':>12} {'at s':>8}")
        base = await phase(url, probe, args.concurrency, small, None, args.baseline_s)
        print(_row("baseline", base, None), flush=True)
        for kind in args.kind:
            body = huge_body(kind, text)
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

            async def send_huge(session: aiohttp.ClientSession, body: bytes = body, path: str = path) -> int:
                async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    return r.status

            got = await phase(url, probe, args.concurrency, small, send_huge, 0.0)
            print(_row(f"huge {kind}", got, base) + f"   (huge answered {got['job']} in {got['job_s']:.1f} s)",
                  flush=True)
        await runner.cleanup()
    finally:
        backend.terminate()
        backend.wait()
    print("\non-loop steps of the huge prompt, timed alone (fresh tokenizer and index):")
    for kind in args.kind:
        steps = breakdown(kind, huge_body(kind, text), tokenizer_path)
        blocks = int(steps.pop("num_blocks"))
        print(f"  {kind} ({blocks} blocks): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steps.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompt-mb", type=float, default=15.0, help="size of the huge prompt, MB of text")
    parser.add_argument("--kind", type=lambda s: s.split(","), default=["completions", "chat"],
                        help="comma-separated: completions, chat")
    parser.add_argument("--concurrency", type=int, default=4, help="small requests in flight")
    parser.add_argument("--baseline-s", type=float, default=10.0, help="length of the baseline phase")
    args = parser.parse_args(argv)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
