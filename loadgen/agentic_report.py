"""The agentic scenario's report: table, targets, the seeds' figures beside ours, plots, files (``loadgen.agentic``)."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import msgspec  # noqa: E402
from rich.console import Console  # noqa: E402

from loadgen.agentic import (  # noqa: E402
    BUNDLED_DIR,
    CONFIGS,
    SEEDS,
    SEEDS_NOTE,
    AgenticConfig,
    LevelResult,
    Sizing,
    run_agentic,
)
from loadgen.errors import LoadgenError  # noqa: E402

SHORT_RUN_FLAGS = "--configs split,shared --levels 16 --max-turns 3"
"""The agentic flags of a run of about a minute (the README's smoke test of this scenario)."""

HEADER = (
    "| config | level | ok | failed | errors | reuse | ÷ ceiling | GPU | CPU | pool | computed | prompt tok/s "
    "| output tok/s | TTFT p50 s | TTFT p99 s | restores | restore tokens | restore s | pool read wall s | mismatch "
    "| of it wrong index | pool evicted |"
)


def _f(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def errors_text(errors_by_kind: dict[str, int]) -> str:
    """``"timeout 100, http_502 8"`` (most first), ``–`` for none."""
    if not errors_by_kind:
        return "–"
    return ", ".join(f"{kind or '?'} {n}" for kind, n in sorted(errors_by_kind.items(), key=lambda kv: (-kv[1], kv[0])))


def markdown(results: Sequence[LevelResult]) -> str:
    """One row per configuration and level (times in simulated seconds)."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.config} | {r.level} | {r.requests_ok} | {r.requests_failed} | {errors_text(r.errors_by_kind)} "
            f"| {r.reuse:.3f} "
            f"| {_f(r.reuse_of_ceiling, '.3f')} | {r.share_gpu:.3f} | {r.share_cpu:.3f} | {r.share_pool:.3f} "
            f"| {r.share_computed:.3f} | {r.throughput_prompt_tokens_per_s:,.0f} "
            f"| {r.throughput_output_tokens_per_s:,.1f} "
            f"| {_f(r.ttft_p50_s, '.3f')} | {_f(r.ttft_p99_s, '.3f')} | {r.num_restores} "
            f"| {r.mean_restore_tokens:,.0f} | {r.mean_restore_s:.4f} | {_f(r.mean_pool_read_wall_s, '.3f')} "
            f"| {_f(r.cached_mismatch_ratio, '.2%')} | {_f(r.cached_mismatch_index_ratio, '.2%')} "
            f"| {'–' if r.pool_evicted_keys is None else r.pool_evicted_keys} |"
        )
    return "\n".join(lines) + "\n"


TURN_HEADER = (
    "| config | level | steady window s | requests in it | prompt tok/s (steady) | output tok/s (steady) "
    "| prompt tok/s (whole run) | think s | TTFT s | rest of the answer s | turn s |"
)


def turn_markdown(results: Sequence[LevelResult]) -> str:
    """Throughput while every slot was busy, and a turn's mean time split (``loadgen.agentic_steady``)."""
    lines = [TURN_HEADER, "|" + "---|" * (TURN_HEADER.count("|") - 1)]
    for r in results:
        st = r.steady
        if st is None:
            continue
        turn_s = st.mean_think_s + st.mean_ttft_s + st.mean_decode_s
        lines.append(
            f"| {r.config} | {r.level} | {st.window_s:,.0f} | {st.num_requests} | {st.prompt_tokens_per_s:,.0f} "
            f"| {st.output_tokens_per_s:,.1f} | {r.prompt_tokens_per_s:,.0f} | {st.mean_think_s:.2f} "
            f"| {st.mean_ttft_s:.2f} | {st.mean_decode_s:.2f} | {turn_s:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _pool_targets(results: Sequence[LevelResult], pooled: str, split_name: str) -> list[tuple[str, bool, str]]:
    """The targets of one shared-pool configuration against its split-pool twin (none when it did not run)."""
    shared = [r for r in results if r.config == pooled]
    split = {r.level: r for r in results if r.config == split_name}
    out: list[tuple[str, bool, str]] = []
    if not shared:
        return out
    worst = min((r.reuse_of_ceiling or 0.0) for r in shared)
    out.append((f"{pooled} reuse ÷ ceiling >= 0.97 at every level", worst >= 0.97, f"{worst:.3f}"))
    top = max(shared, key=lambda r: r.level)
    if top.level in split and split[top.level].throughput_prompt_tokens_per_s:
        ratio = top.throughput_prompt_tokens_per_s / split[top.level].throughput_prompt_tokens_per_s
        out.append((f"{pooled} ÷ {split_name} prompt throughput at {top.level} >= 1.5", ratio >= 1.5, f"{ratio:.2f}"))
    mis = max((r.cached_mismatch_ratio or 0.0) for r in shared)
    if all(r.cached_mismatch_index_ratio is not None for r in shared):
        wrong = max((r.cached_mismatch_index_ratio or 0.0) for r in shared)
        short = sum(r.num_pool_short_reads for r in shared)
        # Mooncake tells no one what it evicts: the worker whose read finds a block gone announces it removed, which
        # the gateway reads as a forecast miss when it lands before the answer (else as a wrong index)
        why = f"; {short} pool reads found blocks the master evicted after the lookup" if short else ""
        out.append((f"{pooled}: no mismatch from a wrong index", wrong == 0.0,
                    f"{wrong:.2%} (all causes {mis:.2%}{why})"))  # fmt: skip
    else:
        out.append((f"{pooled}: predicted = reported cached tokens", mis == 0.0, f"{mis:.2%}"))
    evicted = sum(r.pool_evicted_keys or 0 for r in shared)
    out.append((f"{pooled}: the master evicted", evicted > 0, str(evicted)))
    return out


def targets(results: Sequence[LevelResult]) -> list[tuple[str, bool, str]]:
    """The issue's targets: (name, passed, value)."""
    out: list[tuple[str, bool, str]] = []
    for pooled, split_name in (("shared", "split"), ("pd-shared", "pd-split")):
        out += _pool_targets(results, pooled, split_name)
    failed = sum(r.requests_failed for r in results)
    where = "; ".join(f"{r.config} @ {r.level}: {errors_text(r.errors_by_kind)}" for r in results if r.requests_failed)
    out.append(("no failed request", failed == 0, str(failed) + (f" ({where})" if where else "")))
    return out


def failure_lines(results: Sequence[LevelResult]) -> list[str]:
    """One line per configuration, level and error kind: the first such request's id and message."""
    return [f"- {r.config} @ {r.level}, {kind}: {example}" for r in results
            for kind, example in r.error_examples.items()]


def explain(results: Sequence[LevelResult], sizing: Sizing, time_scale: float) -> list[str]:
    """Why a shared pool's throughput at the top level is not 1.5× its split twin's, from the run's numbers.

    Throughputs are the steady window's where measured (``LevelResult.throughput_prompt_tokens_per_s``). Model
    bound: the split fleet's computed tokens per second (its prompt throughput × its computed share) is what the
    fleet's compute sustained; the shared fleet, computing a smaller share, could serve that ÷ its computed share,
    and no closed loop serves more than ``level × mean prompt ÷ mean think time``. Turn times: with every slot
    busy, a slot serves one turn per think + TTFT + rest of the answer (``loadgen.agentic_steady``), so the ratio
    follows the inverse ratio of the turn times, and the think time, the same for both, caps it. What waits: the
    restores' real pool reads, ``mean_pool_read_wall_s × time_scale`` simulated seconds each (times are wall ×
    time scale) against the model's ``mean_restore_s``.
    """
    lines: list[str] = []
    for pooled, split_name in (("shared", "split"), ("pd-shared", "pd-split")):
        shared = [r for r in results if r.config == pooled]
        split = {r.level: r for r in results if r.config == split_name}
        if not shared:
            continue
        top = max(shared, key=lambda r: r.level)
        twin = split.get(top.level)
        if twin is None or not twin.throughput_prompt_tokens_per_s:
            continue
        twin_per_s = twin.throughput_prompt_tokens_per_s
        ratio = top.throughput_prompt_tokens_per_s / twin_per_s
        if ratio >= 1.5:
            continue
        computed_per_s = twin_per_s * twin.share_computed
        compute_bound = computed_per_s / top.share_computed if top.share_computed else math.inf
        think_bound = top.level * sizing.mean_prompt_tokens / sizing.mean_think_s if sizing.mean_think_s else math.inf
        bound = min(compute_bound, think_bound)
        text = (
            f"{pooled} ÷ {split_name} at {top.level} is {ratio:.2f}: {split_name} computes {twin.share_computed:.0%} "
            f"of its prompt tokens ({computed_per_s:,.0f} computed tokens per simulated s), {pooled} "
            f"{top.share_computed:.0%}, so the model's compute would serve {compute_bound:,.0f} prompt tokens/s and "
            f"the sessions' think times allow {think_bound:,.0f}: a model-bound ratio of "
            f"{bound / twin_per_s:.2f}."
        )
        if top.steady is not None and twin.steady is not None:
            a, b = twin.steady, top.steady
            turn_a = a.mean_think_s + a.mean_ttft_s + a.mean_decode_s
            turn_b = b.mean_think_s + b.mean_ttft_s + b.mean_decode_s
            text += (
                f" A turn took {turn_a:.1f} simulated s on {split_name} (think {a.mean_think_s:.1f}, TTFT "
                f"{a.mean_ttft_s:.1f}, rest {a.mean_decode_s:.1f}) and {turn_b:.1f} on {pooled} (think "
                f"{b.mean_think_s:.1f}, TTFT {b.mean_ttft_s:.1f}, rest {b.mean_decode_s:.1f}): with every slot busy "
                f"that alone gives {turn_a / turn_b if turn_b else math.inf:.2f}, and no shorter TTFT could give more "
                f"than {turn_a / b.mean_think_s if b.mean_think_s else math.inf:.2f} (think time only)."
            )
        if top.mean_pool_read_wall_s is not None:
            text += (
                f" What waits instead: {top.num_restores} of {top.requests_ok} requests restored from the pool, "
                f"each read taking {top.mean_pool_read_wall_s:.3f} s of wall time on this host "
                f"({top.mean_pool_read_wall_s * time_scale:.1f} simulated s at time scale {time_scale:g}) against "
                f"the model's {top.mean_restore_s:.3f} s (the restoring request waits for the later of the two; the "
                f"worker's other sequences keep running meanwhile)."
            )
        lines.append(text)
    return lines


def plot(results: Sequence[LevelResult], path: Path) -> Path:
    """Throughput and reuse against concurrency per configuration, and the tier shares (stacked)."""
    configs = [c for c in CONFIGS if any(r.config == c for r in results)]
    fig, axes = plt.subplots(1, 2 + len(configs), figsize=(5 * (2 + len(configs)), 4))
    for c in configs:
        rows = sorted((r for r in results if r.config == c), key=lambda r: r.level)
        levels = [r.level for r in rows]
        axes[0].plot(levels, [r.throughput_prompt_tokens_per_s for r in rows], marker="o", label=c)
        axes[1].plot(levels, [r.reuse_of_ceiling or 0.0 for r in rows], marker="o", label=c)
    axes[0].set(title="prompt tokens / simulated s", xlabel="sessions in flight")
    axes[1].set(title="reuse ÷ ceiling", xlabel="sessions in flight")
    for ax in axes[:2]:
        ax.legend()
    for ax, c in zip(axes[2:], configs, strict=True):
        rows = sorted((r for r in results if r.config == c), key=lambda r: r.level)
        names = [str(r.level) for r in rows]
        bottom = [0.0] * len(rows)
        for label, key in (("GPU", "share_gpu"), ("CPU", "share_cpu"), ("pool", "share_pool"),
                           ("computed", "share_computed")):  # fmt: skip
            values = [getattr(r, key) for r in rows]
            ax.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set(title=f"{c}: share of prompt tokens", xlabel="sessions in flight", ylim=(0, 1))
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def config_from_args(args: argparse.Namespace) -> AgenticConfig:
    """The agentic settings of ``kvgate demo --scenario agentic``.

    Raises:
        LoadgenError: bad values, or a flag of the conversation scenario only (``--quick``, ``--pd``,
            ``--max-requests``), which this scenario would otherwise ignore.
    """
    conversation_only = [
        flag
        for flag, is_given in (
            ("--quick", getattr(args, "quick", False)),
            ("--pd", getattr(args, "pd", False)),
            ("--max-requests", getattr(args, "max_requests", None) is not None),
        )
        if is_given
    ]
    if conversation_only:
        raise LoadgenError(
            f"{', '.join(conversation_only)} apply to the conversation scenario only; a short agentic run is "
            f"{SHORT_RUN_FLAGS}"
        )
    levels = tuple(int(x) for x in str(args.levels).split(",") if x.strip())
    configs = tuple(x.strip() for x in str(args.configs).split(",") if x.strip())
    if not levels or min(levels) < 1:
        raise LoadgenError("--levels must be positive integers")
    if getattr(args, "sessions_per_slot", 1) < 1:
        raise LoadgenError("--sessions-per-slot must be at least 1")
    if not configs or any(c not in CONFIGS for c in configs):
        raise LoadgenError(f"--configs must be from {', '.join(CONFIGS)}")
    trace = args.trace or str(BUNDLED_DIR)
    if not Path(trace).is_dir():
        raise LoadgenError(f"--trace for the agentic scenario is a directory of trace_*.json files: {trace}")
    return AgenticConfig(
        trace_dir=trace,
        out=args.out if args.out != "out/demo" else "out/agentic",
        num_workers=args.num_workers,
        levels=levels,
        configs=configs,
        max_turns_per_session=args.max_turns,
        sessions_per_slot=getattr(args, "sessions_per_slot", 2),
        max_think_s=args.max_think_s,
        time_scale=args.time_scale,
        max_output_tokens=args.max_output_tokens,
        prefill_slowdown=args.prefill_slowdown,
        startup_timeout_s=args.startup_timeout_s,
        show_progress=not args.no_progress,
        write_plots=not args.no_plots,
    )


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Run the scenario; 0 when every check passed (``targets``: no failed request among them), 1 otherwise, 2 on
    bad input or startup failure."""
    console = Console()
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        config = config_from_args(args)
        results, sizing = asyncio.run(run_agentic(config, console))
    except LoadgenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; every process the scenario started was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report(console, config, results, sizing, time.monotonic() - t0)
    return exit_status(results)


def exit_status(results: Sequence[LevelResult]) -> int:
    """The scenario's exit status after a run: 0 when every check of ``targets`` passed, else 1."""
    return 0 if all(ok for _, ok, _ in targets(results)) else 1


def report(
    console: Console, config: AgenticConfig, results: Sequence[LevelResult], sizing: Sizing, wall_s: float
) -> list[Path]:
    """Print and write the results (``agentic.md``, ``agentic.json``, ``agentic.png``)."""
    table = markdown(results) + "\n" + turn_markdown(results)
    checks = targets(results)
    seeds = "\n".join(f"- {name}: seeds {value}" for name, value in SEEDS)
    console.print(table, markup=False, highlight=False, soft_wrap=True)
    for name, ok, value in checks:
        console.print(f"{'[green]PASS[/green]' if ok else '[red]FAIL[/red]'} {name}: {value}")
    failures = failure_lines(results)
    for line in failures:
        console.print(line, markup=False, highlight=False)
    why = explain(results, sizing, config.time_scale)
    for line in why:
        console.print(line, markup=False, highlight=False)
    console.print(seeds + "\n" + SEEDS_NOTE, markup=False, highlight=False)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "agentic.md"
    md.write_text(
        table + "\n" + "\n".join(f"- {'PASS' if ok else 'FAIL'} {n}: {v}" for n, ok, v in checks) + "\n\n"
        + "".join(line + "\n" for line in failures) + ("\n" if failures else "")
        + "".join(line + "\n\n" for line in why)
        + "Seeds' figures:\n" + seeds + "\n\n" + SEEDS_NOTE + "\n",
        encoding="utf-8",
    )
    js = out / "agentic.json"
    js.write_bytes(
        msgspec.json.format(
            msgspec.json.encode({"config": config, "sizing": sizing, "results": results, "wall_s": wall_s}), indent=2
        )
    )
    paths = [md, js]
    if config.write_plots and results:
        paths.append(plot(results, out / "agentic.png"))
    console.print(f"wrote {', '.join(map(str, paths))} in {wall_s:.0f} s")
    return paths
