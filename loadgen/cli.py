"""``kvgate loadgen``: replay a trace (or a synthetic agentic workload) against an OpenAI-compatible endpoint.

Examples::

    kvgate loadgen --trace traces/conversation_trace.jsonl --url http://127.0.0.1:8000 --max-requests 300
    kvgate loadgen --trace traces/kv-cache-tester --url http://127.0.0.1:8000 --mode closed --concurrency 4
    kvgate loadgen --synthetic --syn-num-sessions 8 --url http://127.0.0.1:8000 --mode closed

Every run puts a prefix in front of its session ids (``--session-prefix``; by default a fresh random
``lg-<8 hex>-``), so a gateway's sticky sessions from an earlier run, or another client's sessions, do not apply
to this run's sessions; it is printed at the start and recorded in ``results.json`` (``session_prefix``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import msgspec
from rich.console import Console

from loadgen.ceiling import ceiling
from loadgen.client import DEFAULT_PREDICTED_CACHED_HEADER, DEFAULT_WORKER_HEADER
from loadgen.errors import LoadgenError
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, check_session_prefix, new_session_prefix
from loadgen.report import markdown_table
from loadgen.runner import replay_with_progress, write_results
from loadgen.sessions import derive_sessions
from loadgen.synthetic import SyntheticConfig, generate
from loadgen.traces import TraceRequest, detect_format, read_agentic_sessions, read_mooncake

logger = logging.getLogger(__name__)


class TraceSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Where the requests come from and which slice of them is replayed."""

    path: str | None = None
    """A Mooncake ``.jsonl`` file, a kv-cache-tester ``.json`` file or a directory of them; ``None`` with
    ``synthetic``."""
    synthetic: SyntheticConfig | None = None
    """Generate a synthetic agentic workload instead of reading a file."""
    start_s: float = 0.0
    """Skip requests arriving before this trace time, seconds."""
    duration_s: float | None = None
    """Keep requests arriving within this many trace seconds after ``start_s``."""
    max_requests: int | None = None
    """Keep at most this many requests."""
    session_stagger_s: float = 0.0
    """Agentic session files: the i-th file's session starts i × this many seconds after the first."""
    max_requests_per_session: int | None = None
    """Agentic session files: keep only each session's first requests."""


def load_requests(source: TraceSource) -> list[TraceRequest]:
    """Read (or generate) the slice and assign sessions.

    Raises:
        TraceError: unreadable or malformed trace.
        ValueError: neither a path nor a synthetic config.
    """
    if source.synthetic is not None:
        requests = generate(source.synthetic)
    elif source.path is not None:
        if detect_format(source.path) == "mooncake":
            raw = read_mooncake(
                source.path, start_s=source.start_s, duration_s=source.duration_s, max_requests=source.max_requests
            )
            return derive_sessions(raw)
        requests = read_agentic_sessions(
            [source.path],
            session_stagger_s=source.session_stagger_s,
            max_requests_per_session=source.max_requests_per_session,
        )
    else:
        raise ValueError("a trace path or a synthetic workload is needed")
    requests = [r for r in requests if r.arrival_s >= source.start_s]
    if source.duration_s is not None:
        requests = [r for r in requests if r.arrival_s <= source.start_s + source.duration_s]
    if source.max_requests is not None:
        requests = requests[: source.max_requests]
    base_s = requests[0].arrival_s if requests else 0.0
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s - base_s) for r in requests]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _session_prefix(text: str) -> str:
    try:
        return check_session_prefix(text)
    except LoadgenError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_slice_arguments(parser: argparse._ActionsContainer) -> None:
    """Options choosing the slice of a trace (shared with ``kvgate demo``)."""
    parser.add_argument(
        "--start-s", type=_non_negative_float, default=0.0, help="skip requests before this trace time (s)"
    )
    parser.add_argument(
        "--duration-s", type=_positive_float, default=None, help="replay only this many trace seconds after --start-s"
    )
    parser.add_argument("--max-requests", type=_positive_int, default=None, help="replay at most this many requests")


def add_replay_arguments(parser: argparse._ActionsContainer) -> None:
    """Options of the replay itself (shared with ``kvgate demo``)."""
    parser.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        help="trace time runs this many times faster than wall time and reported times are multiplied by it; "
        "against sim workers started with --time-scale 1/X (wall seconds per simulated second), pass X to read "
        "results in simulated seconds",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=_positive_int,
        default=None,
        help="cap on each request's max_tokens (default: the trace's output length)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json of the served model (default: byte-level, one token per byte, as the sim worker)",
    )
    parser.add_argument("--request-timeout-s", type=_positive_float, default=120.0, help="wall limit per request (s)")
    parser.add_argument(
        "--max-duration-s",
        type=_positive_float,
        default=None,
        help="wall limit of a replay (s): every wait (arrival time, think time, free slot) ends at it and nothing is "
        "sent after it; requests in flight finish",
    )
    parser.add_argument(
        "--max-in-flight", type=_positive_int, default=256, help="open loop: requests in flight at most"
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate loadgen``."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    source = parser.add_argument_group("workload")
    src = source.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        help="trace to replay: a Mooncake .jsonl (sessions derived from the hash-id chain), a kv-cache-tester "
        ".json session file, or a directory of them (one session per file, sub-agents as their own sessions)",
    )
    src.add_argument("--synthetic", action="store_true", help="generate a synthetic agentic workload (--syn-*)")
    add_slice_arguments(source)
    source.add_argument(
        "--session-stagger-s", type=_non_negative_float, default=0.0, help="agentic files: start of file i is i × this"
    )
    source.add_argument(
        "--max-requests-per-session", type=_positive_int, default=None, help="agentic files: first N turns only"
    )
    syn = parser.add_argument_group("synthetic workload (with --synthetic)")
    defaults = SyntheticConfig()
    for field in msgspec.structs.fields(SyntheticConfig):
        kind = type(getattr(defaults, field.name))
        syn.add_argument(
            f"--syn-{field.encode_name}",
            dest=f"syn_{field.name}",
            type=kind,
            default=field.default,
            help=_field_doc(SyntheticConfig, field.name),
        )
    target = parser.add_argument_group("target")
    target.add_argument("--url", required=True, help="base URL of the OpenAI-compatible endpoint (gateway or worker)")
    target.add_argument("--model", default="sim", help="model name sent in each request")
    target.add_argument("--session-header", default="x-session-id", help="request header carrying the session id")
    target.add_argument(
        "--session-prefix",
        type=_session_prefix,
        default=None,
        metavar="TEXT",
        help="put TEXT in front of every session id sent and recorded; None: a fresh random 'lg-<8 hex>-' per run "
        "(so a gateway's sticky sessions from an earlier run do not carry over); '' sends the trace's bare ids",
    )
    target.add_argument("--worker-header", default=DEFAULT_WORKER_HEADER, help="response header: serving worker")
    target.add_argument(
        "--predicted-cached-header",
        default=DEFAULT_PREDICTED_CACHED_HEADER,
        help="response header: the gateway's predicted cached tokens",
    )
    target.add_argument(
        "--metrics-url",
        default="auto",
        help="a kvgate gateway's /metrics, read before and after the run to split the cached-token mismatch by "
        "cause (auto: URL/metrics; none: not read)",
    )
    target.add_argument("--workers", default="", help="comma-separated worker ids of the fleet (for load balance)")
    run = parser.add_argument_group("replay")
    run.add_argument(
        "--mode",
        choices=("open", "closed"),
        default="open",
        help="open: send on the trace's timestamps; closed: --concurrency sessions, each turn after the previous "
        "one finished plus its think time",
    )
    run.add_argument("--concurrency", type=_positive_int, default=8, help="closed loop: sessions in flight")
    add_replay_arguments(run)
    run.add_argument("--label", default="run", help="name of this run in the reports")
    run.add_argument("--out", default=None, help="directory for results.json, results.md, records.jsonl and plots")


def _field_doc(cls: type, name: str) -> str:
    """The attribute docstring of a config field (msgspec keeps none, so read the source once)."""
    import inspect

    lines = inspect.getsource(cls).splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{name}:") and i + 1 < len(lines):
            return lines[i + 1].strip().strip('"')
    return name


def _trace_source(args: argparse.Namespace) -> TraceSource:
    synthetic = None
    if args.synthetic:
        synthetic = SyntheticConfig(
            **{f.name: getattr(args, f"syn_{f.name}") for f in msgspec.structs.fields(SyntheticConfig)}
        )
        synthetic = msgspec.convert(msgspec.to_builtins(synthetic), SyntheticConfig)  # validates the ranges
    return TraceSource(
        path=args.trace,
        synthetic=synthetic,
        start_s=args.start_s,
        duration_s=args.duration_s,
        max_requests=args.max_requests,
        session_stagger_s=args.session_stagger_s,
        max_requests_per_session=args.max_requests_per_session,
    )


def _metrics_url(args: argparse.Namespace) -> str | None:
    """``--metrics-url``: ``auto`` is the target's ``/metrics`` (past any ``/v1...`` path), ``none`` none."""
    value = str(getattr(args, "metrics_url", "auto"))
    if value == "none":
        return None
    if value == "auto":
        base = str(args.url).rstrip("/")
        cut = base.find("/v1")
        return (base[:cut] if cut >= 0 else base) + "/metrics"
    return value


def _replay_config(args: argparse.Namespace) -> ReplayConfig:
    session_prefix = new_session_prefix() if args.session_prefix is None else args.session_prefix
    return ReplayConfig(
        url=args.url,
        model=args.model,
        mode=args.mode,
        time_scale=args.time_scale,
        concurrency=args.concurrency,
        max_in_flight=args.max_in_flight,
        max_output_tokens=args.max_output_tokens,
        request_timeout_s=args.request_timeout_s,
        max_duration_s=args.max_duration_s,
        session_header=args.session_header,
        worker_header=args.worker_header,
        predicted_cached_header=args.predicted_cached_header,
        metrics_url=_metrics_url(args),
        session_prefix=session_prefix,
    )


def _no_success_hint(num_ok: int, errors_by_kind: dict[str, int], url: str, model: str) -> str | None:
    """What to check when not one request succeeded and every failure is of one kind; ``None`` otherwise."""
    if num_ok or len(errors_by_kind) != 1:
        return None
    kind = next(iter(errors_by_kind))
    if kind == "connect":
        return f"no request reached {url}: is the gateway (or worker) up and listening there?"
    if kind == "http_404":
        return f"every request got 404: does {url} serve the model {model!r}? --model names it (default 'sim')"
    return None


def main(args: argparse.Namespace) -> int:
    """Run ``kvgate loadgen``; returns 0 when every request succeeded, 1 when some failed, 2 on bad input.

    ``results.json`` holds ``slice_ceiling`` (the infinite-cache bound of the whole slice, printed before the run)
    and the run's summary, whose ``ceiling_hit_ratio`` is over the requests that succeeded (``served_ceiling``),
    whose ``session_prefix`` is the run's, and whose ``num_skipped`` (``skip_reason``) counts the requests never
    sent, shown as ``not sent`` in the printed table.
    """
    console = Console()
    try:
        source = _trace_source(args)
        config = _replay_config(args)
        requests = load_requests(source)
        prompts = PromptBuilder(args.tokenizer)
    except (LoadgenError, ValueError, msgspec.ValidationError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if not requests:
        console.print("[red]error:[/red] the selected slice holds no requests")
        return 2
    bound = ceiling(requests)
    console.print(
        f"slice: {len(requests)} requests, {len({r.session_id for r in requests})} sessions, "
        f"{bound.num_prompt_tokens} prompt tokens; ceiling hit ratio of the slice {bound.hit_ratio:.3f}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if config.session_prefix:
        console.print(
            f"session ids prefixed with {config.session_prefix!r}", markup=False, highlight=False, soft_wrap=True
        )
    else:
        console.print("session ids sent without a prefix (--session-prefix '')", markup=False, highlight=False)
    workers = [w for w in args.workers.split(",") if w]
    try:
        outcome = asyncio.run(
            replay_with_progress(
                requests, config, prompts, label=args.label, workers=workers, show_progress=not args.no_progress
            )
        )
    except LoadgenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    console.print(markdown_table([outcome.summary]), markup=False, highlight=False, soft_wrap=True)
    hint = _no_success_hint(outcome.summary.requests_ok, outcome.summary.errors_by_kind, args.url, args.model)
    if hint:
        console.print(f"[red]error:[/red] {hint}", highlight=False, soft_wrap=True)
    if args.out:
        paths = write_results(
            Path(args.out),
            [outcome],
            extra={"slice_ceiling": bound, "trace": args.trace or "synthetic"},
            plots=not args.no_plots,
        )
        console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if outcome.summary.requests_failed == 0 else 1


if __name__ == "__main__":
    from router.cli import main as kvgate_main

    sys.exit(kvgate_main(["loadgen", *sys.argv[1:]]))
