# torch.cuda.Event is unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""The harness of ``benchmarks.kernels``: the KV shape, timing (CUDA events, ``do_bench``), the copy ceilings and
the report every section writes to."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Llama-3-8B KV shape, bf16.
NUM_LAYERS = 32
NUM_KV_HEADS = 8
NUM_HEADS = 32
HEAD_SIZE = 128
BLOCK_SIZE = 16
PREFIX_TOKENS = 32_768
NUM_PREFIX_BLOCKS = PREFIX_TOKENS // BLOCK_SIZE  # 2,048


@dataclass
class Report:
    """Rows of the summary table and the full log, printed as markdown."""

    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.append(line)

    def row(self, name: str, figure: str, ceiling: str, ratio: float, target: str) -> None:
        self.rows.append((name, figure, ceiling, f"{ratio:.3f}", target))
        self.say(f"RESULT {name}: {figure} / {ceiling} = {ratio:.3f} (target {target})")

    def table(self) -> str:
        lines = ["| measurement | figure | ceiling / baseline | ratio | target |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Timing:
    """Milliseconds over repeated runs."""

    median_ms: float
    min_ms: float
    max_ms: float

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (min {self.min_ms:.3f}, max {self.max_ms:.3f})"


def time_cuda(fn: Callable[[], Any], *, warmup: int = 3, repeat: int = 10) -> Timing:
    """Median, min and max of ``fn`` in ms, each call timed with CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return Timing(statistics.median(times), min(times), max(times))


def time_bench(fn: Callable[[], Any]) -> Timing:
    """Median, min and max of ``fn`` in ms from ``triton.testing.do_bench`` (L2 cleared before each call)."""
    from triton.testing import do_bench

    median, low, high = do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.0, 1.0])
    return Timing(float(median), float(low), float(high))


def gbps(num_bytes: float, timing: Timing) -> float:
    """``num_bytes`` over the median time, in GB/s."""
    return num_bytes / (timing.median_ms * 1e-3) / 1e9


@contextlib.contextmanager
def section(report: Report, name: str) -> Iterator[None]:
    """A section of the report with its wall time; its failure is logged with the traceback, not raised."""
    report.say(f"\n## {name}")
    t0 = time.perf_counter()
    try:
        yield
    except Exception:  # one failing section must not hide the others' figures
        report.say(f"SECTION FAILED: {name}\n```\n{traceback.format_exc()}```")
    finally:
        report.say(f"({name}: {time.perf_counter() - t0:.1f} s wall)")


def measure_ceilings(report: Report) -> dict[str, float]:
    """Copy ceilings in GB/s: ``copy`` (device, read + write), ``d2h`` and ``h2d`` (pinned), and the 32K prefix's
    KV size in ``bytes``."""
    import torch

    num_bytes = NUM_LAYERS * 2 * NUM_PREFIX_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2
    src = torch.randn(num_bytes // 2, device="cuda").bfloat16()
    dst = torch.empty_like(src)
    t_copy = time_bench(lambda: dst.copy_(src))
    copy_bw = gbps(2 * num_bytes, t_copy)
    report.say(f"device copy of {num_bytes / 1e9:.2f} GB: {t_copy}, {copy_bw:.0f} GB/s (read + write), do_bench")
    t_single = time_cuda(lambda: dst.copy_(src))
    report.say(f"device copy, single synchronized call: {t_single}, {gbps(2 * num_bytes, t_single):.0f} GB/s")
    host = torch.empty(num_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    t_d2h = time_cuda(lambda: host.copy_(src, non_blocking=True), warmup=2, repeat=6)
    t_h2d = time_cuda(lambda: dst.copy_(host, non_blocking=True), warmup=2, repeat=6)
    d2h, h2d = gbps(num_bytes, t_d2h), gbps(num_bytes, t_h2d)
    report.say(f"pinned device->host: {t_d2h}, {d2h:.1f} GB/s; host->device: {t_h2d}, {h2d:.1f} GB/s")
    return {"copy": copy_bw, "d2h": d2h, "h2d": h2d, "bytes": float(num_bytes)}


def make_pool(num_blocks: int) -> Any:
    """A random bf16 KV pool ``[NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE]`` on the GPU."""
    import torch

    shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def wait_copy(copy: Callable[..., Any], *args: Any) -> None:
    """Run an asynchronous copy and make the current stream wait for its completion event."""
    import torch

    torch.cuda.current_stream().wait_event(copy(*args))


def like(t: Any) -> dict[str, Any]:
    """``t``'s dtype and device, as keyword arguments of a tensor constructor."""
    return {"dtype": t.dtype, "device": t.device}
