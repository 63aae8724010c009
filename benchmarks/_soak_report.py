"""The soak's settings and result (``python -m benchmarks soak``) and its report: the RSS curve, bytes per index
holding, the C heap and top allocation sites per phase, the checks, ``soak.json`` and the RSS plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from benchmarks._probe import ProcessSample, rss_curve
from common.allocator import JEMALLOC_CONF

INDEX_BENCH_BYTES_PER_HOLDING = 143
"""``benchmarks.index``'s published memory figure (its docstring), bytes per (block, worker) holding."""

SURVIVOR_SITES = 1000
"""Allocation sites a traced soak lists at the baseline and after the clears (``survivors`` diffs the two)."""


class SoakConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Settings of one soak run (module docstring; the flags of the same names)."""

    trace: str
    out: str = "out/soak"
    trace_hours: float = 1.0
    time_scale: float = 30.0
    num_workers: int = 3
    num_gpu_blocks: int = 16384
    """GPU blocks per worker (at least twice the longest prompt's): small, so caches fill early and evict."""
    max_output_tokens: int = 4
    max_in_flight: int = 32
    max_duration_s: float = 900.0
    sample_interval_s: float = 2.0
    churn_interval_s: float = 5.0
    warmup_fraction: float = 0.3
    tolerance: float = 0.10
    slack_fds: int = 4
    slack_tasks: int = 4
    tracemalloc: str = "none"
    """Processes started with ``PYTHONTRACEMALLOC=1``: ``"none"``, ``"gateway"`` or ``"all"`` (a snapshot of a
    traced heap takes seconds on a busy host; traced processes run slower)."""
    tracemalloc_frames: int = 1
    """Frames each traced allocation keeps (``PYTHONTRACEMALLOC=N``); above 1 the top sites are whole stacks."""
    allocator: str = "auto"
    """The gateway's allocator: ``"auto"`` (``"jemalloc"`` where ``libjemalloc.so.2`` is installed, the documented
    way to run the gateway, else ``"pymalloc"``), or one of ``common.allocator.ALLOCATORS``: ``"pymalloc"``
    (CPython's default), ``"malloc"`` (``PYTHONMALLOC=malloc``: glibc for every object) or ``"jemalloc"``
    (``PYTHONMALLOC=malloc`` over a preloaded jemalloc); ``common.allocator.allocator_env``."""
    malloc_conf: str = JEMALLOC_CONF
    """jemalloc's options (``MALLOC_CONF``) with ``allocator="jemalloc"``."""
    write_plot: bool = True
    seed: int = 0


class SoakResult(msgspec.Struct):
    """What one soak run measured and whether its checks passed."""

    samples: dict[str, list[ProcessSample]]
    checks: list[tuple[str, bool, str]]
    num_requests: int
    num_failed: int
    error_kinds: dict[str, int]
    trace_s_covered: float
    bytes_per_holding: dict[str, float]
    top_sites: dict[str, Any]
    worker_bytes_per_block: dict[str, dict[str, float]] = {}
    allocator: str = "pymalloc"
    """The allocator the gateway ran under (``SoakConfig.allocator`` resolved)."""

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)



def write_plot(samples: dict[str, list[ProcessSample]], path: Path) -> None:
    """RSS of every process (MiB) and the gateway's index holdings over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for name, series in samples.items():
        ax.plot([s.t_s for s in series], [s.rss_bytes / 2**20 for s in series], label=f"{name} RSS")
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("RSS (MiB)")
    twin = ax.twinx()
    gw = samples.get("gateway", [])
    twin.plot([s.t_s for s in gw], [s.num_entries for s in gw], "k:", label="gateway index holdings")
    twin.set_ylabel("(block, worker) holdings")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize="small")
    ax.set_title("soak: RSS and index holdings")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _site_key(site: dict[str, Any]) -> tuple[str, ...]:
    return tuple(site["stack"]) if site.get("stack") else (f"{site['file']}:{site['line']}",)


def survivors(baseline: dict[str, Any], cleared: dict[str, Any], limit: int = 12) -> list[dict[str, Any]]:
    """The allocation sites that grew most from ``baseline`` to ``cleared`` (two ``memory_report`` bodies of one
    traced process), as ``{"size_bytes", "num_blocks"`` (both the growth), ``"site"`` (the cleared report's
    entry)``}``, largest growth first, at most ``limit``; a site absent from the baseline's list counts from 0
    (its ``SURVIVOR_SITES`` largest only, so a growth is exact for a site listed in both)."""
    before = {_site_key(s): s for s in baseline.get("sites", [])}
    grown = []
    for site in cleared.get("sites", []):
        old = before.get(_site_key(site), {"size_bytes": 0, "num_blocks": 0})
        grown.append({"size_bytes": site["size_bytes"] - old["size_bytes"],
                      "num_blocks": site["num_blocks"] - old["num_blocks"], "site": site})
    grown.sort(key=lambda g: -g["size_bytes"])
    return grown[:limit]


def report(config: SoakConfig, result: SoakResult) -> None:
    """Print the curve, the bytes per holding, the top sites and the checks; write ``soak.json`` and the plot."""
    print(f"requests: {result.num_requests} sent, {result.num_failed} failed {result.error_kinds}; trace covered "
          f"{result.trace_s_covered:.0f} s of {config.trace_hours * 3600:.0f} s", flush=True)
    for name, series in result.samples.items():
        print(f"{name}: RSS {rss_curve(series)}", flush=True)
    per = result.bytes_per_holding
    print("bytes per (block, worker) holding in the gateway: " + ", ".join(
        f"{k} {v:,.0f}" for k, v in per.items()) + f" (index bench's published figure "
        f"{INDEX_BENCH_BYTES_PER_HOLDING})", flush=True)
    for name, figures in result.worker_bytes_per_block.items():
        if figures:
            print(f"{name}: RSS over baseline per cached GPU block {figures['rss_bytes_per_cached_block']:,.0f} bytes "
                  f"at {figures['cached_blocks_at_plateau']:,.0f} blocks (KV manager, tiers, replay buffer; the "
                  f"engine's own figure: its block metadata, block_size token ids each)", flush=True)
    for label in ("baseline", "plateau", "cleared"):
        traced = {name: f"{rep['traced_bytes'] / 2**20:.1f}" for name, rep in result.top_sites.get(label, {}).items()
                  if isinstance(rep, dict) and rep.get("is_tracing")}
        if traced:
            print(f"traced Python MiB, {label}: {traced}", flush=True)
    for label in ("baseline", "plateau", "cleared"):
        heap = result.top_sites.get(label, {}).get("gateway", {})
        if isinstance(heap, dict) and heap.get("malloc"):
            print(f"gateway C heap, {label}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in heap["malloc"].items()
                                                           if k != "releasable_bytes"), flush=True)
    for label in ("baseline", "plateau", "cleared", "collected"):
        heap = result.top_sites.get(label, {}).get("gateway", {})
        if isinstance(heap, dict) and heap.get("jemalloc"):
            print(f"gateway jemalloc heap, {label}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                                                  for k, v in heap["jemalloc"].items()), flush=True)
    collected = result.top_sites.get("collected", {}).get("gateway", {})
    after_gc = [s.rss_bytes for s in result.samples.get("gateway", []) if s.phase == "collected"]
    if isinstance(collected, dict) and collected.get("num_collected") is not None and after_gc:
        print(f"gateway after a full garbage collection (past the checks): {collected['num_collected']} unreachable "
              f"objects freed, RSS {after_gc[-1] / 2**20:.1f} MiB", flush=True)
    for label in ("baseline", "cleared"):
        bins = result.top_sites.get(label, {}).get("gateway", {}).get("jemalloc_bins")
        if bins:
            print(f"gateway jemalloc size classes with the most idle slab bytes, {label}: " + ", ".join(
                f"{b['region_bytes']} B: {b['idle_bytes'] / 2**20:.1f} of {b['slab_bytes'] / 2**20:.1f} MiB"
                for b in bins[:6]), flush=True)
    for label in ("plateau", "cleared"):
        for name, rep in result.top_sites.get(label, {}).items():
            if not isinstance(rep, dict) or not rep.get("sites"):
                continue
            print(f"top allocation sites, {name}, {label} (traced {rep['traced_bytes'] / 2**20:.1f} MiB):")
            for site in rep["sites"][:12]:
                print(f"  {site['size_bytes'] / 2**20:8.2f} MiB {site['num_blocks']:>9} blocks  "
                      f"{site['file']}:{site['line']}")
                for frame in site.get("stack", [])[1:]:
                    print(f"        {frame}")
    for name, rep in result.top_sites.get("cleared", {}).items():
        base = result.top_sites.get("baseline", {}).get(name)
        if not isinstance(rep, dict) or not rep.get("sites") or not isinstance(base, dict):
            continue
        print(f"survivors, {name} (traced {base['traced_bytes'] / 2**20:.1f} MiB at the baseline, "
              f"{rep['traced_bytes'] / 2**20:.1f} after the clears): the sites that grew most")
        for g in survivors(base, rep):
            print(f"  {g['size_bytes'] / 2**20:+8.2f} MiB {g['num_blocks']:>+9} blocks  {g['site']['file']}:"
                  f"{g['site']['line']}")
            for frame in g["site"].get("stack", [])[1:]:
                print(f"        {frame}")
    for name, ok, detail in result.checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_bytes(msgspec.json.encode({"config": config, "result": result}))
    if config.write_plot:
        write_plot(result.samples, out / "soak.png")
        print(f"wrote {out / 'soak.png'} and {out / 'soak.json'}", flush=True)
