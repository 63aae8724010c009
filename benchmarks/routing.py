"""Routing side by side: kvgate's policies and the peer routers on one sim fleet, the same slice, interleaved.

Run: ``python -m benchmarks routing [--workload mooncake|agentic|synthetic] [--start-s S] [--max-requests N]
[--repetitions 2] [--routers LABEL,...] [--concurrency 8] [--num-cpu-blocks B] [--gpu-fraction F]
[--cpu-fraction F] [--long-prefill-token-threshold T] [--out DIR]``.

Method:

1. Read the workload: a slice of the bundled Mooncake conversation trace (``--start-s``, ``--max-requests``; the
   demo's slice by default), the agentic coding sessions of ``--trace`` (default: the nearest
   ``shared/traces/kv-cache-tester`` beside the checkout or a directory above it, ``find_agentic_traces``; closed
   loop, ``--concurrency`` sessions in flight), or the synthetic agentic generator (closed loop). Turns whose prompt
   plus ``max_tokens`` exceeds the sim workers' context (their config's ``max-model-len``) are left out
   (``cut_to_context``: a 400 for every router alike); the header says how many.
2. Size one fleet of sim workers as ``kvgate demo`` sizes it (``loadgen.sizing.size_fleet``; prefill
   ``prefill_slowdown`` times slower than the default profile, kvgate's cost model told the same rates), or a
   fraction of it (``--gpu-fraction``, with a CPU tier of ``--cpu-fraction`` of it: memory pressure), start it
   once.
3. For each repetition, for each router (A B C A B C): reset every worker's prefix cache, start the router (a fresh
   process: fresh tree, fresh session table), replay the slice through it, stop it. Peers are started from their
   own venvs (``scripts/setup-peers``); a peer that is not installed is skipped with the reason printed.
4. Print one table: requests ok / failed, hit ratio ÷ the ceiling over the same successful requests, TTFT
   p50 / p90 / p99 (simulated seconds: the workers' engine time scaled, the rest, the router's own time included,
   as measured, ``loadgen.report.simulated_ttft_s``), the median of that real-time part (ms), load imbalance
   (max ÷ mean prompt tokens per worker) and kvgate's cached token mismatch by cause (the index wrong / the worker
   evicted after the decision / the block was still pending at the decision / it held more than the index knew),
   each as the mean over repetitions with the spread (min–max) beside it. ``results.json`` and ``records.jsonl``
   go to ``--out``.
5. For each kvgate router, a table of observed ÷ predicted TTFT by band of the queue its cost model predicted on
   the chosen worker, over every repetition (``loadgen.queue_bands``: each request's record joined with its entry
   of ``/admin/decisions`` by the gateway's request id), in ``queue_bands.md`` too.

A kvgate label ending in ``@unscaled`` (``kvgate:cache_aware@unscaled``) runs that policy with the workers listed
in the gateway config without their ``time_scale`` (``loadgen.fleet.Fleet.enable_gateway_time_scale`` off), as
this benchmark did before: the cost model then drains each worker's queue per wall second, ``--time-scale`` times
slower than the sim workers serve it. Beside the label without the suffix it compares the two in one run.

Peers, their session headers and how they start: ``loadgen.peers``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Console

from loadgen.ceiling import ceiling
from loadgen.demo_config import DemoConfig, find_default_trace, gateway_policy, worker_profile
from loadgen.errors import FleetError, LoadgenError
from loadgen.fleet import Fleet, WorkerSpec
from loadgen.peers import PEER_ENV, SIM_WORKER_HEADER, PeerRouter, peer_argv, peer_labels, resolve_peer
from loadgen.prompts import PromptBuilder
from loadgen.queue_bands import PredictionPair, markdown_bands, pair_predictions, queue_bands
from loadgen.replay import ReplayConfig, new_session_prefix, request_max_tokens
from loadgen.report import RunSummary
from loadgen.runner import RunOutcome, replay_with_progress, write_results
from loadgen.sessions import derive_sessions
from loadgen.sizing import size_fleet
from loadgen.synthetic import SyntheticConfig, generate
from loadgen.traces import TraceRequest, read_agentic_sessions, read_mooncake
from workers.config import build_config

__all__ = ["ContextCut", "cut_to_context", "find_agentic_traces", "main", "summarize_router"]

KVGATE_ROUTERS: tuple[str, ...] = ("kvgate:cache_aware", "kvgate:session_sticky+cache_aware")
"""kvgate's runs, ``kvgate:<loadgen.demo.POLICIES label>`` (or a label of ``EXTRA_POLICIES``)."""
UNSCALED_SUFFIX = "@unscaled"
"""Label suffix of a kvgate run whose gateway is not told the workers' time scale (module docstring)."""
EXTRA_POLICIES: dict[str, dict[str, Any]] = {
    "session_sticky_margins+cache_aware": {"name": "session_sticky", "price_moves": False, "max_extra_ttft_s": 0.5,
                                           "max_ttft_ratio": 2.0, "inner": {"name": "cache_aware"}},
    "session_sticky_uncharged+cache_aware": {"name": "session_sticky", "charge_returning_sessions": False,
                                             "inner": {"name": "cache_aware"}},
    "session_sticky_unpriced+cache_aware": {"name": "session_sticky", "price_moves": False,
                                            "inner": {"name": "cache_aware"}},
}
"""kvgate runs besides the demo's, on request (``--routers``): the default policy as it was before its move rule
(fixed margins: a session moves when its owner is 0.5 s and 2x costlier than the best), the default policy
without its charge for the returning sessions a new session's prefill holds up (``policies/returning.py``), and the
default policy without its move rule (a session leaves its owner only when the owner is unavailable or saturated),
which weighs the prefix hits the priced moves give away against the TTFT they save."""
AGENTIC_TRACES = Path("shared") / "traces" / "kv-cache-tester"
"""Where the agentic coding sessions are looked for without ``--trace``: this path in a directory that holds the
checkout or one above it (``find_agentic_traces``), as ``../shared/traces/kv-cache-tester`` beside a checkout."""


def find_agentic_traces(checkout: Path | None = None) -> Path:
    """The nearest ``AGENTIC_TRACES`` directory holding ``*.json`` files in the parent of ``checkout`` (default: this
    repository's root) or any directory above it.

    Raises:
        SystemExit: none found; the message names ``--trace`` and every directory looked in.
    """
    root = (checkout or Path(__file__).resolve().parent.parent).resolve()
    looked = []
    for parent in root.parents:
        candidate = parent / AGENTIC_TRACES
        if candidate.is_dir() and any(candidate.glob("*.json")):
            return candidate
        looked.append(str(candidate))
    raise SystemExit(f"no agentic traces: pass --trace DIR, a directory of kv-cache-tester trace_*.json files (a "
                     f"subset of 16 is bundled in loadgen/data/kv-cache-tester); looked in {', '.join(looked)}")


def default_routers() -> list[str]:
    """kvgate's two policies, then every peer policy."""
    return [*KVGATE_ROUTERS, *peer_labels()]


def resolve_routers(labels: Sequence[str]) -> list[PeerRouter]:
    """Each label's run (kvgate's as a ``PeerRouter`` without a python); a peer without its venv is skipped."""
    out = []
    for label in labels:
        if label.startswith("kvgate:"):
            out.append(PeerRouter(label))
        else:
            try:
                out.append(resolve_peer(label))
            except LoadgenError as exc:
                raise SystemExit(str(exc)) from exc
    return out


def load_workload(args: argparse.Namespace) -> list[TraceRequest]:
    """The slice (module docstring, step 1), sessions assigned."""
    if args.workload == "mooncake":
        trace = args.trace or find_default_trace()
        if trace is None:
            raise SystemExit("no trace: pass --trace")
        return derive_sessions(read_mooncake(trace, start_s=args.start_s, max_requests=args.max_requests))
    if args.workload == "agentic":
        if args.trace and not Path(args.trace).exists():
            raise SystemExit(f"--trace {args.trace}: no such file or directory")
        try:
            requests = read_agentic_sessions([args.trace or find_agentic_traces()],
                                             max_requests_per_session=args.max_requests_per_session)
        except LoadgenError as exc:
            raise SystemExit(f"--trace: {exc}") from exc
        return requests[: args.max_requests]
    return generate(SyntheticConfig(num_sessions=args.num_sessions, seed=args.seed))[: args.max_requests]


@dataclasses.dataclass(frozen=True)
class ContextCut:
    """The requests that fit the workers' context, and what was left out (``cut_to_context``).

    Attributes:
        kept: the requests whose prompt plus ``max_tokens`` fits, in their order.
        num_turns_left_out: requests left out.
        num_sessions_cut: sessions that lost at least one turn.
        num_sessions_left_out: sessions that lost every turn.
    """

    kept: list[TraceRequest]
    num_turns_left_out: int
    num_sessions_cut: int
    num_sessions_left_out: int


def cut_to_context(requests: Sequence[TraceRequest], max_model_len: int, max_output_tokens: int | None) -> ContextCut:
    """Leave out every request whose prompt tokens plus the ``max_tokens`` the replay sends
    (``loadgen.replay.request_max_tokens``) exceed ``max_model_len`` (tokens): a worker answers it with a 400 for
    every router alike. A session keeps its other turns."""
    kept: list[TraceRequest] = []
    left_out: list[TraceRequest] = []
    for r in requests:
        fits = r.num_prompt_tokens + request_max_tokens(r, max_output_tokens) <= max_model_len
        (kept if fits else left_out).append(r)
    cut = {r.session_id for r in left_out}
    return ContextCut(kept, len(left_out), len(cut), len(cut - {r.session_id for r in kept}))


def _spread(values: Sequence[float | None], spec: str) -> str:
    """``mean (min–max)`` of the values present; ``–`` for none; one value alone."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    mean = statistics.fmean(present)
    if len(present) == 1 or max(present) == min(present):
        return format(mean, spec)
    return f"{format(mean, spec)} ({format(min(present), spec)}–{format(max(present), spec)})"


COLUMNS = ("router", "ok", "failed", "hit ÷ ceiling", "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)",
           "outside engine p50 (ms)", "imbalance", "mismatch: index", "mismatch: evicted",
           "mismatch: pending", "mismatch: late")


def summarize_router(label: str, runs: Sequence[RunSummary]) -> list[str]:
    """One table row over a router's repetitions (``COLUMNS``)."""
    return [
        label,
        str(sum(r.requests_ok for r in runs)),
        str(sum(r.requests_failed for r in runs)),
        _spread([r.fraction_of_ceiling for r in runs], ".3f"),
        _spread([r.ttft_p50_s for r in runs], ".2f"),
        _spread([r.ttft_p90_s for r in runs], ".2f"),
        _spread([r.ttft_p99_s for r in runs], ".2f"),
        _spread([None if r.ttft_outside_engine_p50_s is None else r.ttft_outside_engine_p50_s * 1e3 for r in runs],
                ".1f"),
        _spread([r.load_imbalance for r in runs], ".2f"),
        _spread([r.cached_mismatch_index_ratio for r in runs], ".2%"),
        _spread([r.cached_mismatch_evicted_ratio for r in runs], ".2%"),
        _spread([r.cached_mismatch_pending_ratio for r in runs], ".2%"),
        _spread([r.cached_mismatch_late_ratio for r in runs], ".2%"),
    ]


def markdown(rows: Sequence[Sequence[str]], skipped: Sequence[PeerRouter]) -> str:
    """The table, then a line per skipped router."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    lines.extend(f"skipped {s.label}: {s.skip_reason}" for s in skipped)
    return "\n".join(lines) + "\n"


async def run(
    args: argparse.Namespace, console: Console,
) -> tuple[dict[str, list[RunOutcome]], list[PeerRouter], dict[str, list[PredictionPair]]]:
    """Steps 2–3 of the module docstring: outcomes by router label, the skipped routers, and each kvgate router's
    predictions paired with what was observed (step 5), over its repetitions."""
    demo = DemoConfig(trace="", num_workers=args.num_workers, time_scale=args.time_scale,
                      max_output_tokens=args.max_output_tokens, num_cpu_blocks=args.num_cpu_blocks,
                      long_prefill_token_threshold=args.long_prefill_token_threshold)
    profile = worker_profile(demo)
    if not args.hold_prefix:
        profile.setdefault("scheduler", {})["hold-prefix-on-arrival"] = False
    max_model_len = build_config(profile).scheduler.max_model_len
    cut = cut_to_context(load_workload(args), max_model_len, args.max_output_tokens)
    requests = cut.kept
    if not requests:
        raise SystemExit("the slice holds no requests that fit the workers' context")
    sizing = size_fleet(requests, demo)
    # a fraction of the sizing, never below what the longest prompt and its output need on one worker
    longest = max(r.num_prompt_tokens for r in requests) + args.max_output_tokens
    num_gpu_blocks = max(round(sizing.num_gpu_blocks_per_worker * args.gpu_fraction),
                         -(-longest // demo.block_size) + 1)
    num_cpu_blocks = args.num_cpu_blocks + round(sizing.num_gpu_blocks_per_worker * args.cpu_fraction)
    bound = ceiling(requests)
    console.print(f"{args.workload}: {len(requests)} requests, {len({r.session_id for r in requests})} sessions, "
                  f"ceiling {bound.hit_ratio:.3f}; fleet {args.num_workers} × {num_gpu_blocks} "
                  f"GPU blocks (+{num_cpu_blocks} CPU), long-prefill-token-threshold "
                  f"{args.long_prefill_token_threshold}", markup=False, highlight=False)
    console.print(f"left out {cut.num_turns_left_out} turns over the workers' {max_model_len}-token context (prompt "
                  f"+ max_tokens; a 400 for every router): {cut.num_sessions_cut} sessions cut, "
                  f"{cut.num_sessions_left_out} left out whole", markup=False, highlight=False)
    specs = resolve_routers(args.routers.split(",") if args.routers else default_routers())
    running = [s for s in specs if s.skip_reason is None]
    out = Path(args.out)
    fleet = Fleet(out / "logs", startup_timeout_s=90.0)
    outcomes: dict[str, list[RunOutcome]] = {s.label: [] for s in running}
    predictions: dict[str, list[PredictionPair]] = {s.label: [] for s in running if s.label.startswith("kvgate:")}
    failed_to_start: dict[str, str] = {}
    prompts = PromptBuilder()
    worker_specs = [WorkerSpec(f"worker-{i}", num_gpu_blocks, num_cpu_blocks, demo.block_size, 1.0 / args.time_scale)
                    for i in range(args.num_workers)]
    try:
        profile_path = out / "logs" / "worker-profile.yaml"
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
        fleet.start_workers(worker_specs, ["--profile", str(profile_path)])
        await fleet.wait_ready()
        for repetition in range(args.repetitions):
            for spec in list(running):
                await fleet.reset_caches()
                kind, _, policy = spec.label.partition(":")
                if kind == "kvgate":
                    fleet.enable_gateway_time_scale = not policy.endswith(UNSCALED_SUFFIX)
                    policy = policy.removesuffix(UNSCALED_SUFFIX)
                    fleet.start_gateway(_kvgate_policy(policy, demo), demo.block_size)
                    session_header, worker_header = "x-session-id", "x-kvgate-worker"
                else:
                    port, metrics_port = fleet.free_port(), fleet.free_port()
                    fleet.start_router(spec.label.replace(":", "-"),
                                       peer_argv(spec, [w.url for w in fleet.workers], port, metrics_port), port,
                                       env=PEER_ENV)
                    session_header = spec.session_header
                    worker_header = SIM_WORKER_HEADER
                try:
                    await fleet.wait_ready()
                except FleetError as exc:  # a peer that does not start here is skipped with the reason
                    if kind == "kvgate":
                        raise
                    console.print(f"skipping {spec.label}: {exc}", markup=False, highlight=False)
                    fleet.stop_gateway()
                    failed_to_start[spec.label] = str(exc)
                    running = [s for s in running if s.label != spec.label]
                    continue
                assert fleet.gateway is not None
                replay = ReplayConfig(
                    url=fleet.gateway.url, mode="open" if args.workload == "mooncake" else "closed",
                    time_scale=args.time_scale, concurrency=args.concurrency,
                    max_output_tokens=args.max_output_tokens, request_timeout_s=args.request_timeout_s,
                    session_header=session_header, worker_header=worker_header, session_prefix=new_session_prefix(),
                    metrics_url=fleet.gateway.url + "/metrics" if kind == "kvgate" else None,
                )
                outcome = await replay_with_progress(requests, replay, prompts, label=spec.label,
                                                     workers=[w.worker_id for w in worker_specs], console=console,
                                                     show_progress=False)
                outcomes[spec.label].append(outcome)
                if kind == "kvgate":  # the latest decisions, every candidate's cost terms (for diagnosis)
                    decisions = await _save_decisions(
                        fleet.gateway.url, out / f"decisions-{spec.label.partition(':')[2]}-{repetition + 1}.json")
                    predictions[spec.label].extend(pair_predictions(outcome.records, decisions, args.time_scale))
                    behind = await _gateway_share(fleet.gateway.url, outcome,
                                                  1.0 / args.time_scale if fleet.enable_gateway_time_scale else 1.0)
                    if behind is not None:
                        console.print(f"  {spec.label}: mean TTFT {behind[0] * 1e3:.1f} ms at the client, "
                                      f"{behind[1] * 1e3:.1f} ms from the gateway's send to the first token (wall)",
                                      markup=False, highlight=False)
                s = outcome.summary
                console.print(f"rep {repetition + 1} {' | '.join(summarize_router(spec.label, [s]))}", markup=False,
                              highlight=False, soft_wrap=True)
                fleet.stop_gateway()
    finally:
        fleet.stop()
    skipped = [s for s in specs if s.skip_reason is not None]
    skipped.extend(PeerRouter(label, None, f"did not start: {why}") for label, why in failed_to_start.items())
    return outcomes, skipped, predictions


def _kvgate_policy(label: str, demo: DemoConfig) -> dict[str, Any]:
    """The gateway ``policy`` section of ``kvgate:<label>``: the demo's (``gateway_policy``), or an
    ``EXTRA_POLICIES`` one with the same cost-model rates."""
    if label not in EXTRA_POLICIES:
        return gateway_policy(label, demo)
    policy = copy.deepcopy(EXTRA_POLICIES[label])
    policy["inner"] = gateway_policy("cache_aware", demo)
    return policy


async def _save_decisions(url: str, path: Path) -> list[dict[str, Any]]:
    """``/admin/decisions`` of a kvgate gateway (its ring of recent decisions) into ``path``; returns its entries."""
    async with aiohttp.ClientSession() as session, session.get(url + "/admin/decisions?limit=100000") as resp:
        body = await resp.read()
    path.write_bytes(body)
    decisions: list[dict[str, Any]] = json.loads(body).get("decisions", [])
    return decisions


async def _gateway_share(url: str, outcome: RunOutcome, wall_s_per_worker_s: float) -> tuple[float, float] | None:
    """``(mean TTFT at the client, mean TTFT from the gateway's send)`` in wall seconds: what the gateway's own
    time (tokenizing, routing, its event loop) adds is the difference. The gateway's ``kvgate_ttft_seconds`` is in
    the worker's seconds (its wall time over the worker's ``time_scale``): ``wall_s_per_worker_s`` is that time
    scale as the gateway was told it (1.0 when it was not). ``None`` without the series."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("kvgate_ttft_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvgate_ttft_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    ttfts = [r.ttft_s for r in outcome.records if r.is_ok and r.ttft_s is not None]
    if not count or not ttfts:
        return None
    return sum(ttfts) / len(ttfts), total * wall_s_per_worker_s / count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("mooncake", "agentic", "synthetic"), default="mooncake")
    parser.add_argument("--trace", default=None,
                        help="the Mooncake .jsonl (default: the bundled slice), or the agentic sessions' directory "
                             "(default: shared/traces/kv-cache-tester beside the checkout or a directory above it)")
    parser.add_argument("--start-s", type=float, default=0.0, help="Mooncake: trace time where the slice starts")
    parser.add_argument("--max-requests", type=int, default=450, help="requests in the slice")
    parser.add_argument("--max-requests-per-session", type=int, default=None, help="agentic: first turns only")
    parser.add_argument("--num-sessions", type=int, default=16, help="synthetic: sessions")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: seed")
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: sessions in flight")
    parser.add_argument("--repetitions", type=int, default=2, help="interleaved repetitions (A B C A B C)")
    parser.add_argument("--routers", default="", help="comma-separated labels (default: " +
                        ",".join(default_routers()) + ")")
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--no-hold-prefix", dest="hold_prefix", action="store_false",
                        help="the sim workers look a request's prefix up only at admission, as vLLM does (default: "
                             "held from arrival, workers.config.SchedulerConfig.hold_prefix_on_arrival)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="the sim workers' cap on one request's tokens per step (vLLM's flag; default 0: off), "
                             "told to kvgate's cost model too; peers run on the same fleet")
    parser.add_argument("--num-cpu-blocks", type=int, default=0, help="CPU-tier blocks per worker")
    parser.add_argument("--gpu-fraction", type=float, default=1.0,
                        help="GPU blocks per worker as a fraction of the demo's sizing (below 1: memory pressure)")
    parser.add_argument("--cpu-fraction", type=float, default=0.0,
                        help="CPU-tier blocks per worker as a fraction of the demo's GPU sizing (added to "
                             "--num-cpu-blocks)")
    parser.add_argument("--time-scale", type=float, default=5.0, help="simulated seconds per wall second")
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", default="out/bench-routing")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every request of every run succeeded, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks routing", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    console = Console()
    outcomes, skipped, predictions = asyncio.run(run(args, console))
    rows = [summarize_router(label, [o.summary for o in runs]) for label, runs in outcomes.items() if runs]
    table = markdown(rows, skipped)
    console.print(table, markup=False, highlight=False, soft_wrap=True)
    bands = {label: queue_bands(pairs) for label, pairs in predictions.items() if pairs}
    band_tables = "\n".join(markdown_bands(f"{label}: observed ÷ predicted TTFT by the chosen worker's predicted "
                                            f"queue ({len(predictions[label])} requests)", b)
                            for label, b in bands.items())
    console.print(band_tables, markup=False, highlight=False, soft_wrap=True)
    out = Path(args.out)
    write_results(out, [o for runs in outcomes.values() for o in runs],
                  extra={"workload": args.workload, "start_s": args.start_s,
                         "long_prefill_token_threshold": args.long_prefill_token_threshold, "table": rows,
                         "queue_bands": bands},
                  plots=False)
    (out / "table.md").write_text(table, encoding="utf-8")
    (out / "queue_bands.md").write_text(band_tables, encoding="utf-8")
    failed = sum(o.summary.requests_failed for runs in outcomes.values() for o in runs)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
