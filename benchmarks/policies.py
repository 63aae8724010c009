"""Decision time per policy over a 64-worker snapshot, as a ratio to baselines measured in the same run.

Run: ``python -m benchmarks.policies [--num-workers 64] [--num-decisions 20000] [--num-rounds 5]``.

Baselines, measured in the same process right before the policies:

- ``min()``: a bare ``min()`` over ``num_workers`` floats (the floor of any "pick the best" decision);
- ``loop``: one Python attribute read per worker (the floor of any policy that looks at every worker).

Each figure is the best of ``num_rounds`` rounds (least disturbed by other processes on the machine) of the mean
time per ``select()`` over ``num_decisions`` decisions, in microseconds. Snapshots are built up front (seeded) and
cycled, so snapshot construction is not measured; the gateway pays for it separately.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence

from policies.base import Decision, RequestView, Snapshot, WorkerState
from policies.config import PolicyConfig, decode_policy_config
from policies.registry import build_policy
from policies.sticky import SessionStickyPolicy

__all__ = ["main", "make_snapshots"]

POLICIES: tuple[dict[str, object], ...] = (
    {"name": "round_robin"},
    {"name": "random"},
    {"name": "least_loaded"},
    {"name": "power_of_two"},
    {"name": "consistent_hash"},
    {"name": "cache_aware"},
    {"name": "cache_aware", "temperature": 0.1, "max_running_requests": 48, "max_kv_usage": 0.95},
    {"name": "session_sticky", "inner": {"name": "cache_aware"}},
)


def make_snapshots(num_workers: int, num_snapshots: int, seed: int) -> list[tuple[RequestView, Snapshot]]:
    """Seeded requests and fleets: prompts of 1K-32K tokens, per-worker cached prefixes on GPU/CPU/pool, loads.

    Every 8th worker is unhealthy or draining; the session owner is a random worker.
    """
    rng = random.Random(seed)
    out: list[tuple[RequestView, Snapshot]] = []
    for i in range(num_snapshots):
        num_prompt_tokens = rng.randrange(1024, 32_768)
        workers = []
        for w in range(num_workers):
            gpu = rng.choice((0, 0, 0, rng.randrange(num_prompt_tokens)))
            cpu = rng.choice((0, 0, rng.randrange(num_prompt_tokens - gpu + 1)))
            workers.append(
                WorkerState(
                    worker_id=f"worker-{w}",
                    is_healthy=w % 16 != 7,
                    is_draining=w % 16 == 15,
                    num_gpu_cached_tokens=gpu,
                    num_cpu_cached_tokens=cpu,
                    num_pool_cached_tokens=rng.choice((0, 0, 0, 1024)),
                    num_running_requests=rng.randrange(64),
                    num_waiting_requests=rng.randrange(4),
                    num_pending_prefill_tokens=rng.randrange(16_384),
                    kv_usage=rng.random(),
                )
            )
        view = RequestView(
            request_id=f"bench-{i}",
            model="llama-3-8b",
            num_prompt_tokens=num_prompt_tokens,
            num_max_output_tokens=256,
            block_size=16,
            session_key=f"sid:{rng.randrange(1000)}",
        )
        owner = f"worker-{rng.randrange(num_workers)}"
        out.append((view, Snapshot(workers=tuple(workers), session_owner=owner, now_s=float(i))))
    return out


def _best_us(run: Callable[[], None], num_decisions: int, num_rounds: int) -> float:
    """Best-of-rounds mean microseconds per decision of ``run`` (which performs ``num_decisions``)."""
    best_ns = float("inf")
    for _ in range(num_rounds):
        start = time.perf_counter_ns()
        run()
        best_ns = min(best_ns, (time.perf_counter_ns() - start) / num_decisions)
    return best_ns / 1000.0


def _label(obj: dict[str, object]) -> str:
    name = str(obj["name"])
    extra = [f"{k}={v}" for k, v in obj.items() if k != "name" and k != "inner"]
    if "inner" in obj and isinstance(obj["inner"], dict):
        name += f"({obj['inner']['name']})"
    return name + (f" [{', '.join(extra)}]" if extra else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Print decision time per policy beside the same-run baselines; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policies", description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=64)
    parser.add_argument("--num-decisions", type=int, default=20_000)
    parser.add_argument("--num-rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    num_decisions: int = args.num_decisions
    cases = make_snapshots(args.num_workers, 256, args.seed)
    schedule = [cases[i % len(cases)] for i in range(num_decisions)]
    floats = [[rng_f for rng_f in (random.Random(i).random() for _ in range(args.num_workers))] for i in range(256)]
    float_schedule = [floats[i % len(floats)] for i in range(num_decisions)]

    def bare_min() -> None:
        for values in float_schedule:
            min(values)

    def bare_loop() -> None:
        for _, snapshot in schedule:
            for worker in snapshot.workers:
                worker.num_running_requests  # noqa: B018 - the read is what is measured

    min_us = _best_us(bare_min, num_decisions, args.num_rounds)
    loop_us = _best_us(bare_loop, num_decisions, args.num_rounds)
    print(f"{args.num_workers} workers, {num_decisions} decisions x {args.num_rounds} rounds (best round)")
    print(f"{'policy':<72} {'us/decision':>12} {'x min()':>9} {'x loop':>8}")
    print(f"{'baseline: min() over floats':<72} {min_us:>12.2f} {1.0:>9.1f} {min_us / loop_us:>8.2f}")
    print(f"{'baseline: one attribute read per worker':<72} {loop_us:>12.2f} {loop_us / min_us:>9.1f} {1.0:>8.2f}")
    for obj in POLICIES:
        config: PolicyConfig = decode_policy_config(obj)
        policy = build_policy(config)
        select: Callable[[RequestView, Snapshot], Decision] = policy.select
        select(*schedule[0])  # warm caches (hash ring)

        def run(select: Callable[[RequestView, Snapshot], Decision] = select) -> None:
            for view, snapshot in schedule:
                select(view, snapshot)

        us = _best_us(run, num_decisions, args.num_rounds)
        print(f"{_label(obj):<72} {us:>12.2f} {us / min_us:>9.1f} {us / loop_us:>8.2f}")
        if isinstance(policy, SessionStickyPolicy):
            inner_decisions = [(policy.select_inner(v, s), s) for v, s in schedule[:256]]
            resolve_schedule = [inner_decisions[i % 256] for i in range(num_decisions)]

            def run_resolve(
                p: SessionStickyPolicy = policy, resolve_schedule: list[tuple[Decision, Snapshot]] = resolve_schedule
            ) -> None:
                for inner, snapshot in resolve_schedule:
                    p.resolve(snapshot.session_owner, inner, snapshot)

            us = _best_us(run_resolve, num_decisions, args.num_rounds)
            print(f"{'  session_sticky resolve() alone':<72} {us:>12.2f} {us / min_us:>9.1f} {us / loop_us:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
