"""One replay with a live progress bar, and the results files (JSON, Markdown, plots) of one or more runs."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadgen.ceiling import served_ceiling
from loadgen.client import RequestRecord
from loadgen.plots import RunRecords, write_plots
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayConfig, Replayer
from loadgen.report import RunSummary, markdown_table, summarize
from loadgen.traces import TraceRequest

logger = logging.getLogger(__name__)

_MISMATCH_SERIES = re.compile(r'^kvgate_cached_tokens_mismatches_total\{([^}]*)\}\s+([0-9.eE+-]+)', re.MULTILINE)
_CAUSE_LABEL = re.compile(r'cause="([^"]*)"')


def parse_mismatches(text: str) -> dict[str, int]:
    """The gateway's cached-token mismatches by cause, summed over workers, from its Prometheus text."""
    out: dict[str, int] = {}
    for labels, value in _MISMATCH_SERIES.findall(text):
        cause = _CAUSE_LABEL.search(labels)
        if cause is not None:
            out[cause.group(1)] = out.get(cause.group(1), 0) + int(float(value))
    return out


async def read_mismatches(metrics_url: str | None) -> dict[str, int] | None:
    """``parse_mismatches`` of ``metrics_url`` (``None`` when not given, unreachable, or without the series)."""
    if metrics_url is None:
        return None
    try:
        async with aiohttp.ClientSession() as session, session.get(
                metrics_url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        logger.warning("could not read %s: %s", metrics_url, exc)
        return None
    return parse_mismatches(text) if "kvgate_" in text else None


class RunOutcome(msgspec.Struct):
    """A finished run: its summary and its records."""

    summary: RunSummary
    records: list[RequestRecord]


async def replay_with_progress(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    prompts: PromptBuilder,
    *,
    label: str,
    workers: Sequence[str] = (),
    console: Console | None = None,
    show_progress: bool = True,
) -> RunOutcome:
    """Replay ``requests`` and summarize the run, showing a rich progress bar (requests done, failures).

    The summary's ceiling is that of the requests that succeeded (``served_ceiling``), the population of its hit
    ratio.

    Args:
        requests: the slice (arrival order, sessions assigned).
        config: the replay settings.
        prompts: prompt builder.
        label: the run's name (the policy).
        workers: the fleet's worker ids, for load balance (empty: those the gateway names).
        console: where the bar is drawn (stderr by default).
        show_progress: draw the bar.

    Raises:
        ReplayError: as ``Replayer``.
    """
    num_failed = 0
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        disable=not show_progress,
        transient=False,
    ) as progress:
        task = progress.add_task(label, total=len(requests), failed=0)

        def on_complete(record: RequestRecord) -> None:
            nonlocal num_failed
            if not record.is_ok:
                num_failed += 1
            progress.update(task, advance=1, failed=num_failed)

        before = await read_mismatches(config.metrics_url)
        result = await Replayer(requests, config, prompts, on_complete).run()
        after = await read_mismatches(config.metrics_url) if before is not None else None
    bound = served_ceiling(requests, result.records)
    summary = summarize(
        result.records,
        policy=label,
        ceiling_hit_ratio=bound.hit_ratio,
        duration_s=result.duration_s,
        time_scale=config.time_scale,
        workers=workers,
        num_skipped=result.num_skipped,
        skip_reason=result.skip_reason,
        session_prefix=config.session_prefix,
        mismatches_by_cause=None if before is None or after is None else {
            cause: n - before.get(cause, 0) for cause, n in after.items()},
    )
    return RunOutcome(summary=summary, records=result.records)


def write_results(
    out_dir: Path,
    outcomes: Sequence[RunOutcome],
    *,
    extra: dict[str, Any] | None = None,
    plots: bool = True,
) -> list[Path]:
    """Write ``results.json`` (``{"runs": [...summaries], **extra}``), ``results.md``, ``records.jsonl`` and
    the plots into ``out_dir``; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = dict(extra or {})
    payload["runs"] = [o.summary for o in outcomes]
    results_json = out_dir / "results.json"
    results_json.write_bytes(msgspec.json.format(msgspec.json.encode(payload), indent=2) + b"\n")
    results_md = out_dir / "results.md"
    results_md.write_text(markdown_table([o.summary for o in outcomes]), encoding="utf-8")
    records = out_dir / "records.jsonl"
    with records.open("wb") as handle:
        for o in outcomes:
            for r in o.records:
                handle.write(msgspec.json.encode({"run": o.summary.policy, **msgspec.structs.asdict(r)}) + b"\n")
    paths = [results_json, results_md, records]
    if plots:
        runs = [RunRecords(o.summary.policy, o.records, o.summary.time_scale) for o in outcomes]
        paths.extend(write_plots(runs, out_dir))
    return paths
