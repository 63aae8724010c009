"""Chaos: a trace replay at load on a sim fleet with two gateway replicas sharing Redis, while things break.

Run ``python -m benchmarks chaos`` (``--help`` for the knobs; ``tests/robustness/test_chaos.py`` runs a short one).

Fleet: ``--num-workers`` sim workers (``enable-fault-injection``, ``workers.faults``) with GPU caches large enough
that nothing is evicted (so a cached-token prediction above the worker's report can only come from a wrong index),
a ``redis-server`` on 127.0.0.1 started here, and two ``kvgate serve`` replicas (``session_sticky`` over
``cache_aware``, sessions in that Redis). A client replays the bundled Mooncake slice open loop at
``--time-scale`` (repeated, each repetition in a fresh prompt namespace, until the schedule is over), alternating
replicas; a request refused at connect, or cut before its first byte, is sent again
to the other replica (as a client behind a load balancer would), until its deadline (``--deadline-s``).

Faults, one after another, each held ``--hold-s`` under load (``SCHEDULE``): ``kill -9`` a worker and restart
it at the same address; stop Redis and start it again; restart one gateway replica (SIGTERM, then the same command
line; its graceful stop, which ``loadgen.fleet.GATEWAY_STOP_GRACE_S`` outlasts, finishes the streams in flight or
ends them with an error event: ``router.drain``); drop a worker's KV event sends with its replay endpoint refusing
(events lost, the gap not closable by replay: the gateways must resync from the snapshot); make a worker slow (a
delay per request); make a worker fail every request after its headers. Once the replay is over and the gateways
have recovered, a calm pass sends the first ``--calm-requests`` requests of the slice again (their prompts are
cached by then), ``CALM_CONCURRENCY`` at a time, with no fault.

Checks (``Outcome.checks``): every request completed or got a clean OpenAI-style error (an HTTP error with an
``{"error": {...}}`` body, or an SSE ``data: {"error": ...}`` chunk) before its deadline, none hung; at the end
every gateway's in-flight, pending and admission gauges are 0 (``/metrics``); each gateway's index holds, per
worker and tier, exactly the blocks the worker's ``/kv/snapshot`` holds; every session (``/admin/sessions``) is
owned by a live worker; the never-restarted replica's descriptors and asyncio tasks are back within a slack of
their baseline; in the calm pass, every request completes and its predicted cached tokens
(``x-kvgate-predicted-cached-tokens``) equal what the worker reported (``usage.prompt_tokens_details.cached_tokens``).
Nothing is evicted and every prompt of the calm pass is already cached, so a difference there is a wrong index,
not a forecast miss. During the replay, predictions below the report are forecast misses (another request stored
a shared prefix after the decision); predictions above it come from the faults themselves (a restarted worker
before its restart is detected) and are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from benchmarks._chaos_client import RequestOutcome, send_with_failover
from benchmarks._probe import (
    describe_fds,
    gateway_holdings,
    get_json,
    sample_gateway,
    scrape,
    total,
    wait_for,
    worker_truth,
)
from benchmarks._redis_process import RedisProcess, RestartableRedis
from loadgen.demo_config import DemoConfig, find_default_trace, gateway_policy, worker_profile
from loadgen.fleet import Fleet, ManagedProcess, WorkerSpec
from loadgen.ports import PortPicker
from loadgen.prompts import PromptBuilder
from loadgen.sessions import derive_sessions
from loadgen.traces import TraceRequest, read_mooncake

logger = logging.getLogger(__name__)

SCHEDULE: tuple[str, ...] = (
    "kill_worker", "restart_worker", "stop_redis", "start_redis", "restart_gateway", "drop_events",
    "restore_events", "slow_worker", "fail_after_headers", "clear_faults",
)
"""The faults in order; each is held ``hold_s`` under load before the next (a restart first waits until the
process answers)."""

MAX_REPETITIONS = 8
"""Most repetitions of the slice one run sends (the workers' caches hold them all: nothing is evicted)."""

CALM_CONCURRENCY = 4
"""Requests in flight in the calm pass."""

GAUGES_AT_ZERO = ("kvgate_inflight_requests", "kvgate_pending_prefill_tokens", "kvgate_admission_inflight",
                  "kvgate_admission_waiting", "kvgate_admission_queue_depth")
"""Gateway gauges that must read 0 once the load is over."""


class ChaosConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Settings of one chaos run (module docstring; the flags of the same names)."""

    trace: str
    out: str = "out/chaos"
    max_requests: int = 600
    time_scale: float = 1.0
    num_workers: int = 3
    max_output_tokens: int = 8
    deadline_s: float = 30.0
    hold_s: float = 4.0
    faults: tuple[str, ...] = SCHEDULE
    """The faults to inject, in ``SCHEDULE`` order (a subset of it)."""
    calm_requests: int = 40
    recovery_timeout_s: float = 30.0
    slow_delay_s: float = 1.0
    slack_fds: int = 8
    slack_tasks: int = 8



class Chaos:
    """One chaos run over a started fleet."""

    def __init__(self, config: ChaosConfig, fleet: Fleet, redis: RestartableRedis) -> None:
        self.config = config
        self.fleet = fleet
        self.redis = redis
        self.log: list[tuple[float, str]] = []
        self.t0 = time.monotonic()

    def note(self, text: str) -> None:
        self.log.append((time.monotonic() - self.t0, text))
        print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", flush=True)

    async def faults(self, session: aiohttp.ClientSession, worker: ManagedProcess, **faults: Any) -> None:
        async with session.post(worker.url + "/debug/faults", json=faults) as resp:
            resp.raise_for_status()

    async def act(self, session: aiohttp.ClientSession, action: str) -> None:
        workers = self.fleet.workers
        victim, lossy, slow, failing = (workers[i % len(workers)] for i in range(4))
        if action == "kill_worker":
            self.fleet.kill(victim)
        elif action == "restart_worker":
            self.fleet.restart(victim, graceful=False)
            await self.fleet.wait_ready()
        elif action == "stop_redis":
            self.redis.stop()
        elif action == "start_redis":
            self.redis.start()
        elif action == "restart_gateway":
            self.fleet.restart(self.fleet.replicas[0])
            await self.fleet.wait_ready()
        elif action == "drop_events":
            await self.faults(session, lossy, drop_events=True, refuse_replay=True)
        elif action == "restore_events":
            await self.faults(session, lossy)
        elif action == "slow_worker":
            await self.faults(session, slow, delay_s=self.config.slow_delay_s)
        elif action == "fail_after_headers":
            await self.faults(session, slow)
            await self.faults(session, failing, fail_after_headers=True)
        elif action == "clear_faults":
            for w in workers:
                await self.faults(session, w)
        self.note(action)

    async def schedule(self, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(self.config.hold_s)
        for action in SCHEDULE:
            if action in self.config.faults:
                await self.act(session, action)
            await asyncio.sleep(self.config.hold_s)


class Outcome(msgspec.Struct):
    """The run's counts and checks."""

    counts: dict[str, int]
    checks: list[tuple[str, bool, str]]
    mismatches: dict[str, int]
    outcomes: list[RequestOutcome]
    log: list[tuple[float, str]]

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


async def _index_matches(session: aiohttp.ClientSession, fleet: Fleet) -> tuple[bool, str]:
    gateways = [g for g in (fleet.gateway, *fleet.replicas) if g is not None]
    truth = {w.name: await worker_truth(session, w.url, w.name) for w in fleet.workers}
    details = []
    ok = True
    for g in gateways:
        held = gateway_holdings(await scrape(session, g.url))
        if held != truth:
            ok = False
            details.append(f"{g.name}: {held} != {truth}")
    return ok, "; ".join(details) or f"{truth}"


async def run_chaos(config: ChaosConfig, redis: RestartableRedis | None = None) -> Outcome:
    """Run the chaos replay (module docstring); stops everything it started.

    Args:
        config: the run's settings.
        redis: a started Redis to use (and stop and start); one is started here when ``None``.
    """
    requests: list[TraceRequest] = derive_sessions(read_mooncake(config.trace, max_requests=config.max_requests))
    demo = DemoConfig(trace=config.trace, num_workers=config.num_workers, time_scale=config.time_scale)
    out_dir = Path(config.out)
    own_redis = redis is None
    if redis is None:
        redis = RedisProcess(Path(tempfile.mkdtemp(prefix="kvgate-chaos-redis-")), PortPicker().port())
        redis.start()
    assert redis is not None
    fleet = Fleet(out_dir / "logs", startup_timeout_s=120.0)
    prompts = PromptBuilder()
    outcomes: list[RequestOutcome] = []
    calm_outcomes = [RequestOutcome(i, 0.0) for i in range(min(config.calm_requests, len(requests)))]
    try:
        total_blocks = MAX_REPETITIONS * sum(-(-r.num_prompt_tokens // demo.block_size) + 2 for r in requests)
        profile = worker_profile(demo)
        profile["enable-fault-injection"] = True
        profile_path = out_dir / "logs" / "worker-profile.yaml"
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
        specs = [WorkerSpec(f"worker-{i}", total_blocks, 0, demo.block_size, 1.0 / config.time_scale)
                 for i in range(config.num_workers)]
        fleet.start_workers(specs, ["--profile", str(profile_path)])
        await fleet.wait_ready()
        policy = gateway_policy("session_sticky+cache_aware", demo)
        extra = {"sessions": {"store": "redis", "url": redis.url, "key_prefix": "chaos:",
                              "idle_timeout_s": 1800.0 / config.time_scale},
                 "health": {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2, "success_threshold": 1},
                 "circuit_breaker": {"open_s": 2.0}}
        fleet.start_gateway(policy, demo.block_size, extra)
        fleet.start_replica("gateway-b", policy, demo.block_size, extra)
        await fleet.wait_ready()
        assert fleet.gateway is not None
        chaos = Chaos(config, fleet, redis)
        urls = [fleet.gateway.url, fleet.replicas[0].url]
        base_s = requests[0].arrival_s
        span_s = requests[-1].arrival_s - base_s + 1.0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            baseline = await sample_gateway(session, fleet.gateway.url, 0.0, "baseline")
            port_names = _port_names(fleet, redis)
            pid = fleet.gateway.popen.pid
            fds_before = describe_fds(pid, port_names)
            chaos.note(f"load: the {len(requests)}-request slice ({span_s / config.time_scale:.0f} s) repeated "
                       f"until the faults are over; {config.num_workers} workers, 2 gateways")
            start = time.monotonic()
            schedule = asyncio.create_task(chaos.schedule(session))

            async def one(r: TraceRequest, out: RequestOutcome) -> None:
                out.start_s = time.monotonic() - start
                body = {"model": "sim", "prompt": prompts.prompt(r), "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True,
                        "max_tokens": max(1, min(r.num_output_tokens, config.max_output_tokens))}
                headers = {"x-session-id": "chaos-" + r.session_id} if r.session_id else {}
                await send_with_failover(session, urls, out.index % 2, body, headers, out, config.deadline_s)

            senders: list[asyncio.Task[None]] = []
            for k in range(MAX_REPETITIONS):
                for r in requests:
                    at = start + (k * span_s + r.arrival_s - base_s) / config.time_scale
                    while not schedule.done() and time.monotonic() < at:
                        await asyncio.wait({schedule}, timeout=at - time.monotonic())
                    if schedule.done():
                        break
                    if k:
                        r = msgspec.structs.replace(r, namespace=f"chaos-{k}", session_id=f"{k}-{r.session_id}")
                    out = RequestOutcome(len(outcomes), 0.0)
                    outcomes.append(out)
                    senders.append(asyncio.create_task(one(r, out)))
                if schedule.done():
                    break
            await schedule
            await asyncio.gather(*senders)
            chaos.note(f"load done: {len(outcomes)} requests")
            gateways = [fleet.gateway, *fleet.replicas]
            recovered = await wait_for(lambda: _matches(session, fleet), config.recovery_timeout_s)
            chaos.note(f"recovered: {recovered}")
            slots = asyncio.Semaphore(CALM_CONCURRENCY)

            async def calm(k: int) -> None:
                r = requests[k]
                async with slots:
                    calm_outcomes[k].start_s = time.monotonic() - start
                    body = {"model": "sim", "prompt": prompts.prompt(r), "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True, "max_tokens": 1}
                    headers = {"x-session-id": "chaos-" + r.session_id} if r.session_id else {}
                    await send_with_failover(session, urls, k % 2, body, headers, calm_outcomes[k],
                                             config.deadline_s)

            await asyncio.gather(*(calm(k) for k in range(len(calm_outcomes))))
            chaos.note(f"calm pass: {len(calm_outcomes)} requests")

            async def gauges_zero() -> bool:
                for g in gateways:
                    m = await scrape(session, g.url)
                    if any(total(m, name) for name in GAUGES_AT_ZERO):
                        return False
                return True

            is_idle = await wait_for(gauges_zero, config.recovery_timeout_s)
            gauge_detail = {g.name: {n: total(m, n) for n in GAUGES_AT_ZERO}
                            for g in gateways for m in [await scrape(session, g.url)]}
            matched = await wait_for(lambda: _matches(session, fleet), config.recovery_timeout_s)
            _, index_detail = await _index_matches(session, fleet)
            live = {w.name for w in fleet.workers}
            orphans = []
            for g in gateways:
                listing = await get_json(session, g.url + "/admin/sessions?limit=10000")
                orphans += [s for s in listing["sessions"] if s.get("worker_id") not in live]
        # The client's keep-alive connections are gone with its session: each held a descriptor and a handler task
        # on the gateway. The gateway's own idle connections to the workers close after their keep-alive time.
        first_url = urls[0]
        async with aiohttp.ClientSession() as probe:
            after = await sample_gateway(probe, first_url, 0.0, "after")

            async def is_flat() -> bool:
                nonlocal after
                after = await sample_gateway(probe, first_url, 0.0, "after")
                unpooled = _unpooled(describe_fds(pid, port_names)) - _unpooled(fds_before)
                return unpooled <= config.slack_fds and after.num_tasks - baseline.num_tasks <= config.slack_tasks

            await wait_for(is_flat, config.recovery_timeout_s, interval_s=1.0)
            fds_after = describe_fds(pid, port_names)
            chaos.note("checks read")
    finally:
        fleet.stop()
        if own_redis:
            redis.stop()
    counts = {kind: sum(1 for o in outcomes if o.kind == kind)
              for kind in ("completed", "clean_error", "unclean_error", "hung")}
    counts["requests"] = len(outcomes)
    counts["retried"] = sum(1 for o in outcomes if o.num_attempts > 1)
    counts["calm_requests"] = len(calm_outcomes)
    mismatches = {"over_predicted": 0, "under_predicted": 0, "over_predicted_calm": 0, "under_predicted_calm": 0,
                  "checked_calm": 0, "cached_tokens_calm": 0}
    for is_calm, batch in ((False, outcomes), (True, calm_outcomes)):
        suffix = "_calm" if is_calm else ""
        for o in batch:
            if o.kind != "completed" or o.num_predicted_cached_tokens is None or o.num_cached_tokens is None:
                continue
            if is_calm:
                mismatches["checked_calm"] += 1
                mismatches["cached_tokens_calm"] += o.num_cached_tokens
            if o.num_predicted_cached_tokens > o.num_cached_tokens:
                mismatches["over_predicted" + suffix] += 1
            elif o.num_predicted_cached_tokens < o.num_cached_tokens:
                mismatches["under_predicted" + suffix] += 1
    calm_failed = [f"#{o.index}: {o.kind} {o.detail}" for o in calm_outcomes if o.kind != "completed"]
    unclean = [f"#{o.index} (sent at {o.start_s:.1f} s, ended after {o.e2e_s:.1f} s, {o.num_attempts} sends, worker "
               f"{o.worker}): {o.kind} {o.detail}" for o in outcomes if o.kind in ("unclean_error", "hung")]
    checks = [
        ("no request hung", counts["hung"] == 0, str(counts["hung"])),
        ("every request completed or got a clean OpenAI error", counts["unclean_error"] == 0,
         "; ".join(unclean[:5])),
        ("in-flight, pending and admission gauges 0 on every gateway", is_idle, str(gauge_detail)),
        ("each gateway's index equals the workers' snapshots", matched, index_detail[:600]),
        ("every session owned by a live worker", not orphans, str(orphans[:5])),
        ("descriptors flat on the replica never restarted (pooled connections to workers and Redis aside)",
         _unpooled(fds_after) - _unpooled(fds_before) <= config.slack_fds,
         f"{baseline.num_fds:.0f} -> {after.num_fds:.0f}: {fds_before} -> {fds_after}"),
        ("pooled connections within the pools' bounds",
         _pooled(fds_after, "redis") <= REDIS_MAX_CONNECTIONS
         and all(n <= WORKER_POOL_LIMIT for k, n in fds_after.items() if k.endswith(" http")), str(fds_after)),
        ("asyncio tasks flat on the replica never restarted",
         after.num_tasks - baseline.num_tasks <= config.slack_tasks,
         f"{baseline.num_tasks:.0f} -> {after.num_tasks:.0f}"),
        ("every calm-pass request completed", not calm_failed, "; ".join(calm_failed[:5])),
        ("calm pass: predicted cached tokens equal the reported ones (no wrong index)",
         mismatches["over_predicted_calm"] == 0 and mismatches["under_predicted_calm"] == 0
         and mismatches["checked_calm"] == len(calm_outcomes) and mismatches["cached_tokens_calm"] > 0,
         str(mismatches)),
    ]
    return Outcome(counts=counts, checks=checks, mismatches=mismatches, outcomes=outcomes, log=chaos.log)


REDIS_MAX_CONNECTIONS = 64
"""``sessions.max_connections``' default: the Redis session store's pool bound per replica."""

WORKER_POOL_LIMIT = 256
"""Most pooled HTTP connections the check allows from one replica to one worker (the requests in flight at once
bound it; idle ones close after the transport's keep-alive)."""


def _pooled(fds: dict[str, int], peer: str) -> int:
    return sum(n for kind, n in fds.items() if kind.startswith("tcp to ") and kind.endswith(peer))


def _unpooled(fds: dict[str, int]) -> int:
    """Descriptors that are not pooled connections to a worker's HTTP port or to Redis."""
    return sum(fds.values()) - _pooled(fds, " http") - _pooled(fds, "redis")


def _port_names(fleet: Fleet, redis: RestartableRedis) -> dict[int, str]:
    """Listening port -> process name, for ``describe_fds``."""
    names = {int(redis.url.rsplit(":", 1)[1].split("/")[0]): "redis", 0: "(listening)"}
    for proc in (*fleet.workers, *fleet.replicas):
        names[int(proc.url.rsplit(":", 1)[1])] = proc.name + " http"
        for endpoint, label in ((proc.events_endpoint, "events"), (proc.replay_endpoint, "replay")):
            if endpoint is not None:
                names[int(endpoint.rsplit(":", 1)[1])] = f"{proc.name} {label}"
    return names


async def _matches(session: aiohttp.ClientSession, fleet: Fleet) -> bool:
    ok, _ = await _index_matches(session, fleet)
    return ok


def report(config: ChaosConfig, outcome: Outcome) -> None:
    """Print the counts and checks; write ``chaos.json`` under ``--out``."""
    c = outcome.counts
    print(f"requests {c['requests']}: completed {c['completed']}, clean errors {c['clean_error']}, unclean "
          f"{c['unclean_error']}, hung {c['hung']} (retried on the other replica: {c['retried']})", flush=True)
    print(f"cached tokens vs prediction: {outcome.mismatches}", flush=True)
    errors: dict[str, int] = {}
    for o in outcome.outcomes:
        if o.kind != "completed":
            key = o.detail.split(":")[0][:60] if o.detail else o.kind
            errors[f"{o.kind}: {key}"] = errors.get(f"{o.kind}: {key}", 0) + 1
    for key, n in sorted(errors.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {key}", flush=True)
    for name, ok, detail in outcome.checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail if not ok else ''}", flush=True)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_bytes(msgspec.json.encode({"config": config, "outcome": outcome}))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.chaos [flags]``: 0 when every check passes, 1 otherwise, 2 for bad flags."""
    d = ChaosConfig(trace="")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="Mooncake conversation trace (default: the bundled slice)")
    parser.add_argument("--out", default=d.out)
    for name in ("time_scale", "hold_s", "deadline_s", "recovery_timeout_s", "slow_delay_s"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    for name in ("max_requests", "calm_requests", "num_workers", "max_output_tokens", "slack_fds", "slack_tasks"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    parser.add_argument("--faults", default=",".join(SCHEDULE),
                        help="comma-separated subset of: " + ", ".join(SCHEDULE))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if set(args.faults) - set(SCHEDULE):
        parser.error(f"unknown faults {sorted(set(args.faults) - set(SCHEDULE))}")
    trace = args.trace or find_default_trace()
    if trace is None:
        parser.error("the bundled trace is missing; pass --trace")
    if args.max_requests < 1 or args.num_workers < 2 or args.time_scale <= 0 or args.deadline_s <= 0:
        parser.error("--max-requests must be >= 1, --num-workers >= 2, --time-scale and --deadline-s positive")
    config = ChaosConfig(trace=trace, **{k: getattr(args, k) for k in ChaosConfig.__struct_fields__
                                         if k not in ("trace",)})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    outcome = asyncio.run(run_chaos(config))
    report(config, outcome)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
