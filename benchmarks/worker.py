"""Worker benchmarks (``python -m benchmarks.worker``); each figure is printed beside a baseline from the same run.

1. Scheduler + KV manager CPU per step with N concurrent decoding streams (default 200), against the simulated
   step time (the baseline): µs per running sequence per step, and the ratio CPU / simulated (target < 10 %).
   Measured in-process on ``schedule()`` + ``update()`` as thread CPU time (the sim engine's own bookkeeping
   reported apart).
2. Total worker CPU per step including HTTP and SSE writes: the real aiohttp server in this process (time scale
   0), N streaming clients in a child process; server process CPU time (``getrusage``) per engine step.
3. CPU tier on vs off on zero-reuse traffic (every prompt unique): simulated throughput (output+prompt tokens
   per simulated second) and host CPU throughput (requests per CPU second of this thread, so other processes on
   a shared machine count less), runs interleaved: ratio of the best runs, and the spread of per-pair ratios;
   the difference as host µs per offloaded block, beside the modelled time of that block (prompt + output time
   per simulated block).
4. The same comparison end to end, as a user sees it: the real worker (aiohttp server, sim engine paced at time
   scale 1, so a step lasts as long as on the modelled H200) in this process, zero-reuse completions from
   ``--wall-concurrency`` clients in a child process; wall-clock tokens per second (prompt + output) with the CPU
   tier on over off, runs interleaved, and each run's wall throughput over the simulated one (pacing holds when
   it is 1.0: host work fits inside the modelled step).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
import time

from workers.config import KVCacheConfig, SchedulerConfig, TimingProfile, build_config
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _make(num_gpu: int, num_cpu: int, max_seqs: int, budget: int = 8192) -> tuple[Scheduler, SimEngine]:
    kv = KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, block_size=16))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, None)
    return sched, SimEngine(TimingProfile(), 16, list(range(1000, 1100)), None)


def bench_step_cpu(num_streams: int, prompt_len: int, num_steps: int) -> dict[str, float]:
    """Figure 1."""
    sched, engine = _make(65536, 0, num_streams)
    for i in range(num_streams):
        prompt = [(i * 7919 + j) % 30000 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, 10**6, SamplingParams(seed=i), ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        sched.update(engine.execute(sched.schedule()))
    sched_s = engine_s = sim_s = 0.0
    for _ in range(num_steps):
        t0 = time.thread_time()
        step = sched.schedule()
        t1 = time.thread_time()
        result = engine.execute(step)
        t2 = time.thread_time()
        sched.update(result)
        sched.kv.take_events()
        t3 = time.thread_time()
        sched_s += (t1 - t0) + (t3 - t2)
        engine_s += t2 - t1
        sim_s += result.duration_s
    return {
        "sched_kv_us_per_seq_step": sched_s / num_steps / num_streams * 1e6,
        "sched_kv_us_per_step": sched_s / num_steps * 1e6,
        "sim_engine_us_per_step": engine_s / num_steps * 1e6,
        "simulated_step_us": sim_s / num_steps * 1e6,
        "cpu_over_simulated": sched_s / sim_s,
    }


CLIENT = r"""
import asyncio, sys, aiohttp
async def one(s, url, i, n):
    body = {"prompt": [((i * 31 + j) % 200) for j in range(int(sys.argv[4]))], "max_tokens": n, "ignore_eos": True,
            "stream": True}
    async with s.post(url, json=body) as r:
        async for _ in r.content:
            pass
async def main():
    url, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, url, i, n) for i in range(k)))
asyncio.run(main())
"""


async def _bench_http(num_streams: int, prompt_len: int, num_tokens: int) -> dict[str, float]:
    from aiohttp import web

    from workers.server import build_app, build_worker

    cfg = build_config(
        {
            "time-scale": 0.0,
            "kv-cache": {"num-gpu-blocks": 65536, "block-size": 16},
            "scheduler": {"max-num-seqs": num_streams, "max-model-len": 1 << 20},
        }
    )
    worker = build_worker(cfg)
    runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}/v1/completions"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, url, str(num_streams), str(num_tokens), str(prompt_len)
    )
    core = worker.core
    # measure once all streams run, over the middle of the decode phase
    while core.scheduler.num_running < num_streams and proc.returncode is None:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    steps0, cpu0, sim0 = core.num_steps, _cpu_s(), core.engine.clock_s if isinstance(core.engine, SimEngine) else 0.0
    await asyncio.sleep(2.0)
    steps1, cpu1 = core.num_steps, _cpu_s()
    sim1 = core.engine.clock_s if isinstance(core.engine, SimEngine) else 0.0
    running = core.scheduler.num_running
    await proc.wait()
    await runner.cleanup()
    steps = max(1, steps1 - steps0)
    return {
        "total_cpu_us_per_step": (cpu1 - cpu0) / steps * 1e6,
        "total_cpu_us_per_seq_step": (cpu1 - cpu0) / steps / max(1, running) * 1e6,
        "simulated_step_us": (sim1 - sim0) / steps * 1e6,
        "running_streams": float(running),
    }


WALL_CLIENT = r"""
import asyncio, sys, time, aiohttp
async def main():
    url, num_requests, prompt_len, max_tokens, concurrency, salt = sys.argv[1], *map(int, sys.argv[2:])
    queue = list(range(num_requests))
    async def client(s):
        while queue:
            i = queue.pop()
            prompt = [(salt * 7 + i * 13 + j * (i + 1)) % 256 for j in range(prompt_len)]
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            async with s.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
        print(time.monotonic() - t0)
asyncio.run(main())
"""


async def _wall_run(
    num_cpu: int, num_requests: int, prompt_len: int, max_tokens: int, concurrency: int, salt: int
) -> tuple[float, float]:
    """One end-to-end run: ``(wall tokens/s, wall throughput / simulated throughput)``."""
    from aiohttp import web

    from workers.server import build_app, build_worker

    cfg = build_config(
        {
            "time-scale": 1.0,
            "kv-cache": {"num-gpu-blocks": 4096, "num-cpu-blocks": num_cpu, "block-size": 16},
            "scheduler": {"max-num-seqs": 64, "max-num-batched-tokens": 8192},
        }
    )
    worker = build_worker(cfg)
    runner = web.AppRunner(build_app(worker), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
    engine = worker.core.engine
    sim0 = engine.clock_s if isinstance(engine, SimEngine) else 0.0
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WALL_CLIENT,
        url,
        *map(str, (num_requests, prompt_len, max_tokens, concurrency, salt)),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    sim_s = (engine.clock_s if isinstance(engine, SimEngine) else 0.0) - sim0
    await runner.cleanup()
    if proc.returncode != 0:
        raise RuntimeError("wall-clock client failed")
    wall_s = float(out.decode().split()[-1])
    tokens = num_requests * (prompt_len + max_tokens)
    return tokens / wall_s, sim_s / wall_s


async def bench_wall(
    num_requests: int, prompt_len: int, max_tokens: int, concurrency: int, repeats: int
) -> dict[str, float]:
    """Figure 4: best of ``repeats`` interleaved end-to-end runs each, CPU tier off (baseline) and on."""
    off = on = 0.0
    pacing: list[float] = []
    pairs: list[float] = []
    for r in range(repeats):
        t_off, p_off = await _wall_run(0, num_requests, prompt_len, max_tokens, concurrency, 2 * r)
        t_on, p_on = await _wall_run(8192, num_requests, prompt_len, max_tokens, concurrency, 2 * r + 1)
        off, on = max(off, t_off), max(on, t_on)
        pacing += [p_off, p_on]
        pairs.append(t_on / t_off)
    pairs.sort()
    return {
        "off_tokens_per_s": off,
        "on_tokens_per_s": on,
        "ratio_on_off": on / off,
        "pair_min": pairs[0],
        "pair_max": pairs[-1],
        "pacing_min": min(pacing),
        "pacing_max": max(pacing),
    }


def _zero_reuse_run(
    num_cpu: int, num_requests: int, prompt_len: int, max_tokens: int, salt: int
) -> tuple[float, float]:
    sched, engine = _make(4096, num_cpu, 64)
    for i in range(num_requests):
        prompt = [(salt * 1_000_003 + i * 65537 + j) % 2**31 for j in range(prompt_len)]
        sched.add_request(Request(f"q{i}", prompt, max_tokens, SamplingParams(seed=i), ignore_eos=True))
    t0 = time.thread_time()
    while sched.has_work() or engine.has_pending_copies():
        sched.update(engine.execute(sched.schedule()))
        sched.kv.take_events()
    wall = time.thread_time() - t0
    tokens = num_requests * (prompt_len + max_tokens)
    return tokens / engine.clock_s, num_requests / wall


def bench_cpu_tier(num_requests: int, prompt_len: int, max_tokens: int, repeats: int) -> dict[str, float]:
    """Figure 3: best of ``repeats`` interleaved runs each."""
    on_sim = off_sim = on_host = off_host = 0.0
    pairs: list[float] = []
    for r in range(repeats):
        s, h_off = _zero_reuse_run(0, num_requests, prompt_len, max_tokens, 2 * r)
        off_sim, off_host = max(off_sim, s), max(off_host, h_off)
        s, h_on = _zero_reuse_run(16384, num_requests, prompt_len, max_tokens, 2 * r + 1)
        on_sim, on_host = max(on_sim, s), max(on_host, h_on)
        pairs.append(h_on / h_off)
    pairs.sort()
    return {
        "host_ratio_pair_min": pairs[0],
        "host_ratio_pair_median": pairs[len(pairs) // 2],
        "host_ratio_pair_max": pairs[-1],
        "off_sim_tokens_per_s": off_sim,
        "on_sim_tokens_per_s": on_sim,
        "sim_ratio_on_off": on_sim / off_sim,
        "off_host_requests_per_s": off_host,
        "on_host_requests_per_s": on_host,
        "host_ratio_on_off": on_host / off_host,
        "offload_host_us_per_block": (1 / on_host - 1 / off_host) / (prompt_len // 16) * 1e6,
        "simulated_us_per_block": (prompt_len + max_tokens) / on_sim / (prompt_len // 16) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker", description=__doc__)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--wall-requests", type=int, default=96)
    parser.add_argument("--wall-concurrency", type=int, default=32)
    parser.add_argument("--wall-repeats", type=int, default=2)
    parser.add_argument("--skip-wall", action="store_true")
    args = parser.parse_args(argv)
    for name in ("streams", "prompt_len", "steps", "repeats", "wall_requests", "wall_concurrency", "wall_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    f1 = bench_step_cpu(args.streams, args.prompt_len, args.steps)
    print(f"[1] {args.streams} decoding streams, prompt {args.prompt_len} tokens, {args.steps} steps")
    print(
        f"    scheduler+KV CPU      {f1['sched_kv_us_per_seq_step']:.2f} us/seq/step "
        f"({f1['sched_kv_us_per_step']:.0f} us/step)"
    )
    print(f"    sim engine CPU        {f1['sim_engine_us_per_step']:.0f} us/step")
    print(f"    simulated step time   {f1['simulated_step_us']:.0f} us/step (baseline)")
    print(f"    ratio CPU/simulated   {f1['cpu_over_simulated']:.3f} (target < 0.10)")
    if not args.skip_http:
        f2 = asyncio.run(_bench_http(args.streams, 64, 2000))
        print(f"[2] real server, {f2['running_streams']:.0f} SSE streams, time scale 0")
        print(
            f"    total worker CPU      {f2['total_cpu_us_per_step']:.0f} us/step "
            f"({f2['total_cpu_us_per_seq_step']:.2f} us/seq/step)"
        )
        print(
            f"    simulated step time   {f2['simulated_step_us']:.0f} us/step (baseline), "
            f"ratio {f2['total_cpu_us_per_step'] / max(1e-9, f2['simulated_step_us']):.3f}"
        )
    f3 = bench_cpu_tier(200, 2048, 16, args.repeats)
    print("[3] zero-reuse traffic, 200 requests x (2048 prompt + 16 output) tokens, CPU tier off (baseline) vs on")
    print(
        f"    simulated throughput  off {f3['off_sim_tokens_per_s']:.0f} tok/s, on {f3['on_sim_tokens_per_s']:.0f} "
        f"tok/s, ratio {f3['sim_ratio_on_off']:.4f}"
    )
    print(
        f"    host throughput       off {f3['off_host_requests_per_s']:.0f} req/s, on "
        f"{f3['on_host_requests_per_s']:.0f} req/s, ratio {f3['host_ratio_on_off']:.4f} (best runs); per pair "
        f"min {f3['host_ratio_pair_min']:.3f} median {f3['host_ratio_pair_median']:.3f} "
        f"max {f3['host_ratio_pair_max']:.3f}"
    )
    print(
        f"    offload host cost     {f3['offload_host_us_per_block']:.2f} us per offloaded block, "
        f"{f3['offload_host_us_per_block'] / f3['simulated_us_per_block']:.4f} of its modelled time "
        f"({f3['simulated_us_per_block']:.1f} us)"
    )
    if not args.skip_wall:
        f4 = asyncio.run(bench_wall(args.wall_requests, 2048, 16, args.wall_concurrency, args.wall_repeats))
        print(
            f"[4] end to end, real server at time scale 1, {args.wall_requests} zero-reuse requests x (2048 + 16) "
            f"tokens, {args.wall_concurrency} clients, CPU tier off (baseline) vs on"
        )
        print(
            f"    wall throughput       off {f4['off_tokens_per_s']:.0f} tok/s, on {f4['on_tokens_per_s']:.0f} tok/s, "
            f"ratio {f4['ratio_on_off']:.4f} (target within 3%); per pair min {f4['pair_min']:.3f} "
            f"max {f4['pair_max']:.3f}"
        )
        print(f"    wall / simulated      {f4['pacing_min']:.3f} .. {f4['pacing_max']:.3f} (1.0: pacing holds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
