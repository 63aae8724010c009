"""``kvgate demo``: a sim fleet and the gateway on 127.0.0.1, one replay of a real trace slice per policy.

Steps:

1. Read a slice of ``conversation_trace.jsonl`` (Mooncake FAST'25), derive its sessions (``loadgen.sessions``)
   and compute its infinite-cache ceiling (``loadgen.ceiling``).
2. Size the fleet from the slice: the smallest single LRU cache reaching ``lru_target`` (0.97) of the ceiling,
   in the workers' blocks, times ``headroom`` (room for output tokens and running requests), split evenly over
   the workers (``loadgen.sizing``). Each worker then holds a fraction of the slice's distinct blocks (reported;
   well under half with 4 workers), so where requests go decides the hit ratio.
3. Start the sim workers (``kvgate worker --engine sim``) running ``time_scale`` times faster than real time,
   with prefill ``prefill_slowdown`` times slower than their default profile (a larger model, so queueing shows;
   ``cache_aware`` gets the same rates and no online calibration), then for each policy: reset the workers'
   prefix caches, start ``kvgate serve`` with that policy, replay the slice open-loop on its timestamps
   (``time_scale`` times faster; times reported in simulated seconds), stop the gateway.
   Then each installed peer router (``loadgen.peers``: sglang-router, vllm-router, from ``scripts/setup-peers``)
   the same way, so the table gains their rows.
4. Print the comparison table and the acceptance checks, write ``results.json``, ``results.md``,
   ``records.jsonl`` and the plots to ``--out``; stop every process it started, also on Ctrl-C or SIGTERM. The
   exit status is 1 when a check fails or a request failed.

``--pd`` replaces step 3 with an aggregated and a prefill/decode fleet side by side (``loadgen.demo_pd``); the
settings and what they set on the fleet are in ``loadgen.demo_config``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

import msgspec
from rich.console import Console

from loadgen.demo_config import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_TRACE_CANDIDATES,
    POLICIES,
    PREFILL_SLOWDOWN,
    QUICK_MAX_REQUESTS,
    DemoConfig,
    find_default_trace,
    gateway_policy,
    replay_config,
    worker_profile,
    write_worker_profile,
)
from loadgen.demo_pd import run_pd_demo
from loadgen.errors import FleetError, LoadgenError
from loadgen.fleet import Fleet, WorkerSpec
from loadgen.peers import PEER_ENV, SIM_WORKER_HEADER, PeerRouter, installed_peers, peer_argv, resolve_peer
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig
from loadgen.report import RunSummary, markdown_table
from loadgen.runner import RunOutcome, replay_with_progress, write_results
from loadgen.sessions import derive_sessions
from loadgen.sizing import FleetSizing, size_fleet
from loadgen.traces import TraceRequest, read_mooncake, spread_buckets

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_REQUESTS", "DEFAULT_POLICY", "DEFAULT_TRACE_CANDIDATES", "POLICIES", "PREFILL_SLOWDOWN",
    "QUICK_MAX_REQUESTS", "QUICK_NOTE", "AcceptanceCheck", "DemoConfig", "FleetSizing", "acceptance",
    "add_arguments", "find_default_trace", "gateway_policy", "main", "run_demo", "size_fleet", "standard_checks",
    "worker_profile",
]
"""What ``loadgen.demo`` offers, its settings and fleet sizing (``loadgen.demo_config``, ``loadgen.sizing``)
included."""


class AcceptanceCheck(msgspec.Struct, frozen=True):
    """One acceptance criterion on the demo's results.

    Attributes:
        name: the criterion, with its limit.
        value: the measured value (``None`` when it cannot be computed).
        limit: the limit ``value`` is compared with.
        passed: whether ``value`` meets the limit.
        unit: how ``value`` and ``limit`` are shown: ``"ratio"`` (3 decimals), ``"percent"`` (a fraction shown
            as a percentage, as the table's ``cached mismatch``), ``"count"`` or ``"seconds"`` (shown with the
            limit).
    """

    name: str
    value: float | None
    limit: float
    passed: bool
    unit: Literal["ratio", "percent", "count", "seconds"] = "ratio"

    def format_value(self) -> str:
        """``value`` in the check's unit (``–`` when missing)."""
        if self.value is None:
            return "–"
        if self.unit == "percent":
            return f"{self.value:.2%}"
        if self.unit == "count":
            return f"{self.value:.0f}"
        if self.unit == "seconds":  # as many decimals as tell the two apart (at most 4)
            digits = next((d for d in (2, 3, 4) if f"{self.value:.{d}f}" != f"{self.limit:.{d}f}"), 4)
            return f"{self.value:.{digits}f} (limit {self.limit:.{digits}f})"
        return f"{self.value:.3f}"


DEFAULT_POLICY = "session_sticky+cache_aware"
"""The gateway's default policy, held to the peers' standard (``standard_checks``)."""


def standard_checks(summaries: Sequence[RunSummary], peers: Sequence[str]) -> list[AcceptanceCheck]:
    """The default policy against the peers' runs (labels in ``peers``) and the fixed bars: hit ratio ÷ ceiling at
    least 0.97 and within 0.01 of the best peer's, TTFT p50 and p99 under every peer's, and no cached-token
    mismatch from a wrong index (empty without a run of the default policy). A peer in ``peers`` without a run (it
    did not start) is a failed check of its own, so the demo does not pass on a comparison it never made."""
    by = {s.policy: s for s in summaries}
    ours = by.get(DEFAULT_POLICY)
    if ours is None:
        return []
    frac = ours.fraction_of_ceiling
    checks = [AcceptanceCheck(f"{DEFAULT_POLICY} hit ratio ÷ ceiling >= 0.97", frac, 0.97,
                              frac is not None and frac >= 0.97)]
    theirs = [by[p] for p in peers if p in by]
    for label in peers:
        if label not in by:  # asked for (or installed, with auto) but not run: the comparison was not made
            checks.append(AcceptanceCheck(f"{label} replayed (the default policy is held to its run)", None, 1.0,
                                          False, unit="count"))
    if theirs:
        best = max(p.fraction_of_ceiling or 0.0 for p in theirs)
        checks.append(AcceptanceCheck(f"{DEFAULT_POLICY} hit ratio ÷ ceiling >= best peer's - 0.01", frac,
                                      best - 0.01, frac is not None and frac >= best - 0.01))
        for name, ours_s, peer_values in (
            ("p50", ours.ttft_p50_s, [p.ttft_p50_s for p in theirs]),
            ("p99", ours.ttft_p99_s, [p.ttft_p99_s for p in theirs]),
        ):
            limit = min(v for v in peer_values if v is not None) if any(v is not None for v in peer_values) else 0.0
            checks.append(AcceptanceCheck(f"{DEFAULT_POLICY} TTFT {name} < every peer's (s)", ours_s, limit,
                                          ours_s is not None and ours_s < limit, unit="seconds"))
    wrong = ours.cached_mismatch_index_ratio
    if wrong is not None:
        checks.append(AcceptanceCheck(f"{DEFAULT_POLICY} cached-token mismatch from a wrong index = 0", wrong, 0.0,
                                      wrong == 0.0, unit="percent"))
    return checks


def acceptance(summaries: Sequence[RunSummary], peers: Sequence[str] = ()) -> list[AcceptanceCheck]:
    """The acceptance checks of ``cache_aware`` against ``round_robin`` (when both ran), then
    ``standard_checks`` of the default policy against the peers in ``peers``."""
    by = {s.policy: s for s in summaries}
    ca, rr = by.get("cache_aware"), by.get("round_robin")
    if ca is None or rr is None:
        return standard_checks(summaries, peers)
    checks: list[AcceptanceCheck] = []
    frac = ca.hit_ratio / ca.ceiling_hit_ratio if ca.ceiling_hit_ratio else None
    checks.append(
        AcceptanceCheck("cache_aware hit ratio ÷ ceiling >= 0.9", frac, 0.9, frac is not None and frac >= 0.9)
    )
    rel = ca.hit_ratio / rr.hit_ratio if rr.hit_ratio else None
    checks.append(
        AcceptanceCheck("cache_aware ÷ round_robin hit ratio >= 1.5", rel, 1.5, rel is not None and rel >= 1.5)
    )
    ttft = ca.ttft_p50_s / rr.ttft_p50_s if ca.ttft_p50_s and rr.ttft_p50_s else None
    checks.append(
        AcceptanceCheck("cache_aware ÷ round_robin TTFT p50 <= 0.7", ttft, 0.7, ttft is not None and ttft <= 0.7)
    )
    imb = ca.load_imbalance
    checks.append(AcceptanceCheck("cache_aware load imbalance <= 1.3", imb, 1.3, imb is not None and imb <= 1.3))
    mis = ca.cached_tokens_mismatch_ratio
    checks.append(
        AcceptanceCheck(
            "cache_aware cached-tokens mismatch <= 1%", mis, 0.01, mis is not None and mis <= 0.01, unit="percent"
        )
    )
    failed = sum(s.requests_failed for s in summaries)
    checks.append(AcceptanceCheck("no failed request (all runs)", float(failed), 0.0, failed == 0, unit="count"))
    return checks + standard_checks(summaries, peers)


async def run_demo(config: DemoConfig, console: Console) -> tuple[list[RunOutcome], FleetSizing]:
    """Run the whole demo (module docstring); stops every process it started before returning or raising.

    Raises:
        LoadgenError: bad trace, a process that does not start, a failed cache reset.
    """
    raw = read_mooncake(config.trace, start_s=config.start_s, max_requests=config.max_requests)
    if not raw:
        raise LoadgenError(f"the slice of {config.trace} holds no requests")
    if config.spread_buckets:
        raw = spread_buckets(raw)
    requests = derive_sessions(raw)
    sizing = size_fleet(requests, config)
    console.print(
        f"slice: {len(requests)} requests, {len({r.session_id for r in requests})} sessions, "
        f"{requests[-1].arrival_s:.0f} s of trace, {sizing.ceiling.num_prompt_tokens} prompt tokens; "
        f"ceiling hit ratio {sizing.ceiling.hit_ratio:.3f}"
    )
    console.print(
        f"fleet: {config.num_workers} sim workers × {sizing.num_gpu_blocks_per_worker} GPU blocks of "
        f"{config.block_size} tokens; one LRU of the fleet's capacity reaches {sizing.fleet_lru.hit_ratio:.3f} "
        f"({sizing.fleet_lru.hit_ratio / max(sizing.ceiling.hit_ratio, 1e-12):.2f} of the ceiling); each worker "
        f"holds {sizing.worker_share_of_distinct:.2f} of the slice's {sizing.num_distinct_blocks} distinct blocks"
    )
    out_dir = Path(config.out)
    if config.pd:
        return await run_pd_demo(config, console, requests, sizing), sizing
    fleet = Fleet(out_dir / "logs", startup_timeout_s=config.startup_timeout_s)
    prompts = PromptBuilder()
    outcomes: list[RunOutcome] = []
    try:
        specs = [
            WorkerSpec(
                f"worker-{i}",
                sizing.num_gpu_blocks_per_worker,
                config.num_cpu_blocks,
                config.block_size,
                1.0 / config.time_scale,
            )
            for i in range(config.num_workers)
        ]
        profile_path = write_worker_profile(config, out_dir / "logs" / "worker-profile.yaml")
        fleet.start_workers(specs, ["--profile", str(profile_path)])
        await fleet.wait_ready()
        for label in config.policies:
            await fleet.reset_caches()
            sessions = None
            if config.redis_url:  # a fresh key prefix per run: no owner of an earlier run is read back
                prefix = f"kvgate-demo-{os.getpid()}-{len(outcomes)}-{config.gateway_processes}:"
                sessions = {"sessions": {"store": "redis", "url": config.redis_url, "key_prefix": prefix}}
            fleet.start_gateway(gateway_policy(label, config), config.block_size, sessions,
                                ("--processes", str(config.gateway_processes)) if config.gateway_processes > 1 else ())
            await fleet.wait_ready()
            assert fleet.gateway is not None
            outcome = await replay_with_progress(
                requests,
                replay_config(config, fleet.gateway.url),
                prompts,
                label=label,
                workers=[s.worker_id for s in specs],
                console=console,
                show_progress=config.show_progress,
            )
            outcomes.append(outcome)
            fleet.stop_gateway()
        for peer in map(resolve_peer, config.peers):
            outcome_or_none = await _run_peer(fleet, peer, requests, prompts, config, specs, console)
            if outcome_or_none is not None:
                outcomes.append(outcome_or_none)
    finally:
        fleet.stop()
    return outcomes, sizing


async def _run_peer(
    fleet: Fleet, peer: PeerRouter, requests: Sequence[TraceRequest], prompts: PromptBuilder, config: DemoConfig,
    specs: Sequence[WorkerSpec], console: Console,
) -> RunOutcome | None:
    """One replay through a peer router (caches reset first); ``None``, with the reason printed, when it is not
    installed or does not start."""
    if peer.skip_reason is not None:
        console.print(f"skipping {peer.label}: {peer.skip_reason}", markup=False, highlight=False)
        return None
    await fleet.reset_caches()
    port, metrics_port = fleet.free_port(), fleet.free_port()
    fleet.start_router(peer.label.replace(":", "-"), peer_argv(peer, [w.url for w in fleet.workers], port,
                                                               metrics_port), port, env=PEER_ENV)
    try:
        await fleet.wait_ready()
    except FleetError as exc:
        console.print(f"skipping {peer.label}: {exc}", markup=False, highlight=False)
        fleet.stop_gateway()
        return None
    assert fleet.gateway is not None
    replay = ReplayConfig(url=fleet.gateway.url, time_scale=config.time_scale,
                          max_output_tokens=config.max_output_tokens, request_timeout_s=config.request_timeout_s,
                          session_header=peer.session_header, worker_header=SIM_WORKER_HEADER)
    try:
        return await replay_with_progress(requests, replay, prompts, label=peer.label,
                                          workers=[s.worker_id for s in specs], console=console,
                                          show_progress=config.show_progress)
    finally:
        fleet.stop_gateway()


QUICK_NOTE = (
    "note: the --quick slice has little prefix reuse, so the policies barely differ and some checks are expected to "
    "fail; run without --quick to compare them."
)
"""Printed under the checks of a ``--quick`` run."""


def _print_results(
    console: Console, summaries: Sequence[RunSummary], checks: Sequence[AcceptanceCheck], *, is_quick: bool = False
) -> None:
    """The comparison table (Markdown, readable in any terminal width), the acceptance checks (each value in its
    unit, as in the table) and, for ``--quick``, ``QUICK_NOTE``."""
    console.print(markdown_table(summaries), markup=False, highlight=False, soft_wrap=True)
    for c in checks:
        console.print(f"{'[green]PASS[/green]' if c.passed else '[red]FAIL[/red]'} {c.name}: {c.format_value()}")
    if is_quick and checks:
        console.print(QUICK_NOTE, markup=False, highlight=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate demo``."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    d = DemoConfig(trace="")
    parser.add_argument(
        "--trace",
        default=None,
        help="conversation_trace.jsonl (default: its first 1,000 requests, bundled in loadgen/data/)",
    )
    parser.add_argument("--out", default=d.out, help="directory for results.json, results.md, plots and logs")
    parser.add_argument("--quick", action="store_true", help="a smaller slice (under a minute)")
    parser.add_argument("--num-workers", type=int, default=d.num_workers, help="sim workers")
    parser.add_argument("--start-s", type=float, default=d.start_s, help="trace time where the slice starts (s)")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help=f"requests in the slice (default {DEFAULT_MAX_REQUESTS}, --quick {QUICK_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="simulated seconds per wall second (sim workers and the replay)",
    )
    parser.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens, help="cap on output tokens")
    parser.add_argument("--headroom", type=float, default=d.headroom, help="fleet capacity multiplier")
    parser.add_argument(
        "--prefill-slowdown",
        type=float,
        default=d.prefill_slowdown,
        help="sim workers prefill this many times slower than Llama-3-8B on one H200 (cache_aware is told)",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="spread the requests of each bucketed timestamp of the trace (~3 s) up to the next one (default: bursts)",
    )
    parser.add_argument("--num-cpu-blocks", type=int, default=d.num_cpu_blocks, help="CPU-tier blocks per worker")
    parser.add_argument(
        "--policies", default=",".join(d.policies), help="comma-separated runs, from: " + ", ".join(POLICIES)
    )
    parser.add_argument(
        "--startup-timeout-s", type=float, default=d.startup_timeout_s, help="wall limit for a process to come up (s)"
    )
    parser.add_argument(
        "--scenario",
        choices=("conversation", "agentic"),
        default="conversation",
        help="conversation: the Mooncake trace per policy; agentic: coding-agent sessions closed loop on GPU-only, "
        "split-pool and shared-pool fleets (--trace DIR of kv-cache-tester files; default: the bundled subset)",
    )
    parser.add_argument("--levels", default="16,32,48,64",
                        help="agentic: sessions in flight, comma-separated (copies of the sessions above their number)")
    parser.add_argument("--configs", default="gpu,split,shared,pd-split,pd-shared",
                        help="agentic: fleet configurations")
    parser.add_argument("--max-turns", type=int, default=10, help="agentic: turns replayed per session")
    parser.add_argument("--sessions-per-slot", type=int, default=2,
                        help="agentic: sessions each in-flight slot replays in turn (throughput is measured while "
                        "every slot is busy)")
    parser.add_argument("--max-think-s", type=float, default=60.0, help="agentic: cap on think times (simulated s)")
    parser.add_argument(
        "--peers",
        default="auto",
        help="peer routers replayed after kvgate's policies: auto (every one scripts/setup-peers installed), none, "
        "or comma-separated labels (sglang:cache_aware, sglang:manual, vllm:cache_aware, vllm:consistent_hash)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress bars")
    parser.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    parser.add_argument(
        "--pd", action="store_true",
        help="run the requests on an aggregated fleet and on a prefill/decode fleet of the same size, side by side",
    )


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    trace = args.trace or find_default_trace()
    if trace is None:
        raise LoadgenError("the bundled trace loadgen/data/conversation_trace_head.jsonl is missing; pass --trace PATH")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise LoadgenError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.peers == "auto":
        peers = tuple(p.label for p in installed_peers())
    elif args.peers == "none":
        peers = ()
    else:
        peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
        for label in peers:
            resolve_peer(label)  # LoadgenError for an unknown one
    max_requests = args.max_requests or (QUICK_MAX_REQUESTS if args.quick else DEFAULT_MAX_REQUESTS)
    if args.num_workers < 1 or max_requests < 1 or args.time_scale <= 0 or args.max_output_tokens < 1:
        raise LoadgenError("--num-workers, --max-requests, --time-scale and --max-output-tokens must be positive")
    if args.headroom < 1.0:
        raise LoadgenError("--headroom must be >= 1")
    if args.prefill_slowdown <= 0:
        raise LoadgenError("--prefill-slowdown must be positive")
    return DemoConfig(
        trace=trace,
        out=args.out,
        num_workers=args.num_workers,
        start_s=args.start_s,
        max_requests=max_requests,
        time_scale=args.time_scale,
        max_output_tokens=args.max_output_tokens,
        headroom=args.headroom,
        prefill_slowdown=args.prefill_slowdown,
        spread_buckets=args.spread,
        num_cpu_blocks=args.num_cpu_blocks,
        policies=policies,
        startup_timeout_s=args.startup_timeout_s,
        show_progress=not args.no_progress,
        write_plots=not args.no_plots,
        is_quick=args.quick,
        pd=args.pd,
        peers=peers,
    )


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Run ``kvgate demo``: 0 when every request succeeded and every acceptance check passed, 1 otherwise, 2 on
    bad input or startup failure, 130 when interrupted (everything started is stopped in every case)."""
    if getattr(args, "scenario", "conversation") == "agentic":
        from loadgen.agentic_report import main as agentic_main

        return agentic_main(args)
    console = Console()
    try:
        config = _demo_config(args)
    except LoadgenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    t0 = time.monotonic()
    try:
        outcomes, sizing = asyncio.run(run_demo(config, console))
    except LoadgenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; every process the demo started was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    summaries = [o.summary for o in outcomes]
    checks = acceptance(summaries, config.peers)
    _print_results(console, summaries, checks, is_quick=config.is_quick)
    paths = write_results(
        Path(config.out),
        outcomes,
        extra={"config": config, "sizing": sizing, "acceptance": checks, "wall_s": time.monotonic() - t0},
        plots=config.write_plots,
    )
    console.print(f"wrote {', '.join(str(p) for p in paths)} in {time.monotonic() - t0:.0f} s")
    is_ok = all(s.requests_failed == 0 for s in summaries) and all(c.passed for c in checks)
    return 0 if is_ok else 1
