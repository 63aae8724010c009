"""Hybrid-model benchmarks (``python -m benchmarks.hybrid``): recurrent-state checkpoints, each figure beside a
baseline from the same run. The real scheduler, KV manager and sim engine run in-process; times are simulated
(the timing model of ``workers.engines.sim``, an H200 profile) unless said otherwise.

Model: full attention + a sliding window of ``--window`` tokens + a recurrent state of ``--state-mib`` MiB per
sequence (``workers.kv.hybrid``). A checkpoint copies the state in device memory (``2 * state_bytes /
kv_read_bytes_per_s`` plus ``copy_latency_s``); not modelled: the memory the checkpoint pool takes from KV blocks.

1. Zero-reuse throughput (every prompt unique, ``--prompt-tokens`` in, ``--output-tokens`` out, ``--requests``
   requests, ``--concurrency`` at a time): prompt + output tokens per simulated second with checkpoints at the
   default policy (every 4,096 tokens, prompt end, generation end) and at every block (the finest interval a
   content-addressed checkpoint can have: one per ``block_size`` tokens, i.e. one every 16 decode steps of a
   sequence), each over checkpoints off. Also the host CPU of the scheduler and manager per run (thread time),
   over off: what the bookkeeping costs this process.
2. Resumed agentic sessions: the coding-session trace (``tests/fixtures/traces/kv_cache_tester_trace_0003.json``,
   its sessions replayed closed-loop, ``--turns`` turns each, think times skipped); each turn's prompt is the
   previous turn's prompt, its generated tokens and the trace's new tokens, so a returning turn can resume after
   its own output. TTFT (submission to first token, simulated) with checkpoints against without (then every turn
   replays the recurrent state from the first token: a hybrid model without checkpoints reuses nothing).

Run: ``PYTHONPATH=. python -m benchmarks.hybrid`` (about a minute on a loaded 2-core host).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from loadgen.traces import read_agentic_sessions
from workers.config import CacheGroupConfig, CheckpointConfig, KVCacheConfig, SchedulerConfig, TimingProfile
from workers.engines.base import SamplingParams
from workers.engines.sim import SimEngine
from workers.kv.manager import KVCacheManager
from workers.scheduler import Request, Scheduler

BLOCK_SIZE = 16
TRACE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traces" / "kv_cache_tester_trace_0003.json"
OFF = CheckpointConfig(interval_tokens=0, at_prompt_end=False, at_generation_end=False)
DEFAULT = CheckpointConfig()
EVERY_BLOCK = CheckpointConfig(interval_tokens=BLOCK_SIZE)


def make(checkpoints: CheckpointConfig, args: argparse.Namespace, num_gpu_blocks: int) -> tuple[Scheduler, SimEngine]:
    groups = (
        CacheGroupConfig(),
        CacheGroupConfig(kind="sliding_window", sliding_window_tokens=args.window),
        CacheGroupConfig(kind="recurrent", state_bytes=args.state_mib << 20),
    )
    kv = KVCacheManager(
        KVCacheConfig(num_gpu_blocks=num_gpu_blocks, block_size=BLOCK_SIZE, groups=groups, checkpoints=checkpoints)
    )
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=8192, max_model_len=1 << 19), kv, None
    )
    return sched, SimEngine(TimingProfile(), BLOCK_SIZE, list(range(1000, 1100)), None)


def zero_reuse(checkpoints: CheckpointConfig, args: argparse.Namespace) -> tuple[float, float, int]:
    """Figure 1, one run: (tokens per simulated second, host CPU seconds, checkpoints committed)."""
    per_seq = -(-(args.prompt_tokens + args.output_tokens) // BLOCK_SIZE)
    sched, engine = make(checkpoints, args, per_seq * args.concurrency + 64)
    waiting = [
        Request(
            f"r{i}",
            [(i * 1_000_003 + j * 7) % 50_000 + 1 for j in range(args.prompt_tokens)],
            args.output_tokens,
            SamplingParams(seed=i),
            ignore_eos=True,
        )
        for i in range(args.requests)
    ]
    waiting.reverse()
    cpu0 = time.thread_time()
    while waiting or sched.has_work():
        while waiting and sched.num_running + sched.num_waiting < args.concurrency:
            sched.add_request(waiting.pop())
        sched.update(engine.execute(sched.schedule()))
    cpu_s = time.thread_time() - cpu0
    tokens = args.requests * (args.prompt_tokens + args.output_tokens)
    return tokens / engine.clock_s, cpu_s, sched.kv.groups.recurrent[0].num_commits


def sessions_ttft(checkpoints: CheckpointConfig, args: argparse.Namespace) -> tuple[list[float], int, int]:
    """Figure 2, one run: (TTFT per turn in seconds, cached prompt tokens, prompt tokens)."""
    trace = read_agentic_sessions([TRACE], max_requests_per_session=args.turns)
    turns: dict[str, list[tuple[int, int]]] = {}
    for r in trace:
        turns.setdefault(r.session_id, []).append((r.num_prompt_tokens, min(r.num_output_tokens, args.max_output)))
    sched, engine = make(checkpoints, args, 1 << 16)
    history: dict[str, list[int]] = {sid: [] for sid in turns}
    next_turn = dict.fromkeys(turns, 0)
    live: dict[str, tuple[str, float, Request]] = {}
    ttfts: list[float] = []
    num_cached = num_prompt = 0
    salt = 0

    def submit(sid: str) -> None:
        nonlocal salt
        num_prompt_tokens, num_output = turns[sid][next_turn[sid]]
        num_new = max(1, num_prompt_tokens - len(history[sid]))
        salt += 1
        prompt = [*history[sid], *((salt * 7919 + j) % 50_000 + 1 for j in range(num_new))]
        rid = f"{sid}#{next_turn[sid]}"
        next_turn[sid] += 1
        req = Request(rid, prompt, num_output, SamplingParams(seed=salt), ignore_eos=True)
        sched.add_request(req)
        live[rid] = (sid, engine.clock_s, req)

    for sid in turns:
        submit(sid)
    seen: set[str] = set()
    while sched.has_work():
        for out in sched.update(engine.execute(sched.schedule())):
            sid, t0, req = live[out.request_id]
            if out.request_id not in seen:
                seen.add(out.request_id)
                ttfts.append(engine.clock_s - t0)
            if out.finish_reason is not None:
                del live[out.request_id]
                history[sid] = req.all_token_ids
                num_cached += req.num_cached_tokens or 0
                num_prompt += req.num_prompt_tokens
                if next_turn[sid] < len(turns[sid]):
                    submit(sid)
    return ttfts, num_cached, num_prompt


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window", type=int, default=4096, help="sliding window in tokens")
    parser.add_argument("--state-mib", type=int, default=64, help="recurrent state per sequence, MiB")
    parser.add_argument("--turns", type=int, default=40, help="turns per session of the trace")
    parser.add_argument("--max-output", type=int, default=512, help="cap on a turn's output tokens")
    args = parser.parse_args(argv)

    print(f"1. zero-reuse throughput: {args.requests} requests of {args.prompt_tokens} in / {args.output_tokens} "
          f"out, {args.concurrency} at a time, state {args.state_mib} MiB")
    runs = {name: zero_reuse(cfg, args) for name, cfg in (("off", OFF), ("default", DEFAULT),
                                                            ("every block", EVERY_BLOCK))}
    base_tps, base_cpu, _ = runs["off"]
    for name, (tps, cpu_s, commits) in runs.items():
        print(f"   checkpoints {name:<12} {tps:12.0f} tok/s simulated  x{tps / base_tps:.4f} of off   "
              f"host CPU {cpu_s:6.2f} s  x{cpu_s / base_cpu:.3f}   checkpoints committed {commits}")

    print(f"2. resumed agentic sessions ({TRACE.name}, {args.turns} turns per session, outputs capped at "
          f"{args.max_output})")
    results = {name: sessions_ttft(cfg, args) for name, cfg in (("with checkpoints", DEFAULT), ("without", OFF))}
    base = results["without"][0]
    for name, (ttfts, cached, prompt) in results.items():
        print(f"   {name:<17} TTFT mean {statistics.fmean(ttfts):7.3f} s  p50 {_pct(ttfts, 0.5):7.3f} s  "
              f"p90 {_pct(ttfts, 0.9):7.3f} s   mean x{statistics.fmean(ttfts) / statistics.fmean(base):.3f} of "
              f"without   cached {cached / prompt:6.1%} of {prompt} prompt tokens over {len(ttfts)} turns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
