"""PNG plots of one or more replays (matplotlib, Agg backend, no display needed).

* ``ttft_cdf.png``: empirical CDF of TTFT per run.
* ``hit_ratio_over_time.png``: cached ÷ prompt tokens of the requests finishing in each time bucket, per run.
* ``worker_load_over_time.png``: prompt tokens sent to each worker per time bucket, one panel per run.

Times in simulated seconds (wall seconds × ``time_scale``); the axes say wall seconds when every run has time
scale 1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.client import RequestRecord  # noqa: E402
from loadgen.report import simulated_ttft_s  # noqa: E402

logger = logging.getLogger(__name__)


class RunRecords(msgspec.Struct, frozen=True):
    """The records of one run, for plotting.

    Attributes:
        label: the run's name in legends.
        records: its request records.
        time_scale: wall seconds × this = simulated seconds.
    """

    label: str
    records: Sequence[RequestRecord]
    time_scale: float = 1.0


def _seconds_label(runs: Sequence[RunRecords]) -> str:
    """The unit of the time axes: ``"s"`` (wall) when every run has time scale 1, else ``"simulated s"``."""
    return "s" if all(run.time_scale == 1.0 for run in runs) else "simulated s"


def _bucket_edges(runs: Sequence[RunRecords], num_buckets: int) -> np.ndarray:
    end_s = max(
        ((r.start_s + r.e2e_s) * run.time_scale for run in runs for r in run.records),
        default=1.0,
    )
    return np.linspace(0.0, max(end_s, 1e-9), num_buckets + 1)


def _bucket(edges: np.ndarray, t_s: float) -> int:
    """Index of the bucket of ``edges`` holding ``t_s`` (clamped to the first and last)."""
    return max(0, min(int(np.searchsorted(edges, t_s, side="right")) - 1, len(edges) - 2))


def plot_ttft_cdf(runs: Sequence[RunRecords], path: Path) -> None:
    """TTFT CDF, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ttfts = np.sort([t for r in run.records if r.is_ok and (t := simulated_ttft_s(r, run.time_scale)) is not None])
        if ttfts.size:
            ax.plot(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size, label=run.label)
    ax.set_xlabel(f"TTFT ({_seconds_label(runs)})")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    if ax.lines:  # no successful request (every one failed, say the URL is down): no curve, no legend to draw
        ax.set_xscale("log")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no successful request", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_ratio_over_time(runs: Sequence[RunRecords], path: Path, num_buckets: int = 20) -> None:
    """Hit ratio per completion-time bucket, one line per run."""
    edges = _bucket_edges(runs, num_buckets)
    centers = (edges[:-1] + edges[1:]) / 2
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        cached = np.zeros(num_buckets)
        prompt = np.zeros(num_buckets)
        for r in run.records:
            if not r.is_ok:
                continue
            b = _bucket(edges, (r.start_s + r.e2e_s) * run.time_scale)
            cached[b] += r.num_cached_tokens or 0
            prompt[b] += r.num_reported_prompt_tokens or r.num_prompt_tokens
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(prompt > 0, cached / np.maximum(prompt, 1), np.nan)
        ax.plot(centers, ratio, marker="o", markersize=3, label=run.label)
    ax.set_xlabel(f"time ({_seconds_label(runs)})")
    ax.set_ylabel("cached ÷ prompt tokens")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Hit ratio over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_worker_load_over_time(runs: Sequence[RunRecords], path: Path, num_buckets: int = 20) -> None:
    """Prompt tokens per worker per send-time bucket, one panel per run."""
    edges = _bucket_edges(runs, num_buckets)
    centers = (edges[:-1] + edges[1:]) / 2
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.4 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        per_worker: dict[str, np.ndarray] = {}
        for r in run.records:
            if not r.is_ok or r.worker is None:
                continue
            tokens = r.num_reported_prompt_tokens or r.num_prompt_tokens
            per_worker.setdefault(r.worker, np.zeros(num_buckets))[_bucket(edges, r.start_s * run.time_scale)] += tokens
        for worker in sorted(per_worker):
            ax.plot(centers, per_worker[worker] / 1000.0, label=worker)
        ax.set_title(run.label, fontsize=9)
        ax.set_ylabel("k prompt tokens")
        ax.grid(True, alpha=0.3)
        if per_worker:
            ax.legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel(f"time ({_seconds_label(runs)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(runs: Sequence[RunRecords], out_dir: Path) -> list[Path]:
    """Write the three plots into ``out_dir`` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "ttft_cdf.png", out_dir / "hit_ratio_over_time.png", out_dir / "worker_load_over_time.png"]
    plot_ttft_cdf(runs, paths[0])
    plot_hit_ratio_over_time(runs, paths[1])
    plot_worker_load_over_time(runs, paths[2])
    return paths
