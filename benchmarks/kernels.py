# torch.cuda.Event is unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""Benchmarks of every kernel family on one GPU, each figure a ratio to a ceiling or baseline from the same run.

Run: ``python -m benchmarks.kernels [--out BENCH.md] [--sections copy,transfer,decode,prefill,recompute]``.

Ceilings, measured first in the same process:

- device-to-device copy bandwidth (``dst.copy_(src)`` of 4.3 GB, bytes read + written);
- pinned host<->device bandwidth each way (``copy_`` between a pinned host tensor and a device tensor);
- torch baselines: ``index_select`` for the gather; ``scaled_dot_product_attention`` (each backend that accepts
  the inputs; the fastest is the baseline) on the same KV laid out contiguously for decode and prefill.

Sections (Llama-3-8B KV shape: 32 layers, 8 KV heads, head size 128, block 16, bf16):

- ``copy``: gather/scatter of 2,048 random blocks (4.3 GB) device to device, vs copy bandwidth;
- ``transfer``: offload (gather straight into pinned host memory) and restore (scatter straight from it) of a
  32,768-token prefix, and a staged variant (device staging buffers + copy engine on a side stream), vs pinned
  bandwidth;
- ``decode``: one layer, batch 32 x 32K context from the paged pool, vs SDPA decode on contiguous KV;
- ``prefill``: a 4,096-token chunk over 28,672 cached tokens from the paged pool, vs SDPA on contiguous data;
- ``recompute``: prefill of the 32K prefix with the Llama-3-8B-shaped model (random weights) on SDPA and on our
  kernels, vs restoring the same prefix from pinned host memory.

Kernel-vs-ceiling and kernel-vs-torch comparisons (copy, decode, prefill) are timed with
``triton.testing.do_bench`` (median; min and max beside it), both sides alike: it clears the L2 before each call,
so the host's launch work overlaps that clearing and a kernel is not charged for Python launch overhead. The
synchronized single-call figure (``time_cuda``: events around one call on an idle GPU, launch overhead included)
is printed beside the headline rows. Transfers and the model prefill (tens of ms and more) use ``time_cuda``.
Correctness of each kernel at these sizes is checked against torch on the same inputs, outputs poisoned first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

from benchmarks._kernel_attention import bench_decode, bench_prefill
from benchmarks._kernel_copy import bench_copy, bench_transfer
from benchmarks._kernel_timing import (
    BLOCK_SIZE,
    NUM_PREFIX_BLOCKS,
    PREFIX_TOKENS,
    Report,
    measure_ceilings,
    section,
    time_cuda,
    wait_copy,
)


def bench_recompute(report: Report, ceil: dict[str, float]) -> None:
    import torch

    from workers.model.config import LLAMA3_8B
    from workers.model.kv_pool import KVTransfer
    from workers.model.llama import LlamaModel, PagedBatch

    model = LlamaModel.random(LLAMA3_8B, seed=0, device=torch.device("cuda"), dtype=torch.bfloat16)
    pool = model.allocate_kv_pool(num_blocks=NUM_PREFIX_BLOCKS + 16)
    tokens = torch.randint(0, LLAMA3_8B.vocab_size, (PREFIX_TOKENS,), device="cuda")
    batch = PagedBatch.prefill_from_scratch(tokens.shape[0], block_size=BLOCK_SIZE, device=torch.device("cuda"))
    timings = {}
    for backend in ("sdpa", "triton"):
        t = time_cuda(
            partial(model.forward, tokens, batch, pool, attention=backend, last_token_logits=True),
            warmup=1,
            repeat=3,
        )
        timings[backend] = t
        report.say(f"recompute 32K prefix, attention={backend}: {t}")
    ids = batch.block_table[0].clone()
    host = torch.empty((ids.numel(), *pool.shape[:2], *pool.shape[3:]), dtype=pool.dtype, pin_memory=True)
    transfer = KVTransfer(pool)
    cpu_ids = torch.randperm(ids.numel()).tolist()
    t_res = time_cuda(partial(wait_copy, transfer.restore, ids, host, cpu_ids), warmup=1, repeat=5)
    report.say(f"restore of the same prefix (engine path, random CPU slots): {t_res}")
    report.row(
        "recompute (torch SDPA) / restore, 32K prefix, Llama-3-8B shape",
        f"{timings['sdpa'].median_ms:.0f} ms",
        f"restore {t_res.median_ms:.1f} ms",
        timings["sdpa"].median_ms / t_res.median_ms,
        ">= 15",
    )
    report.row(
        "recompute (our kernels) / restore",
        f"{timings['triton'].median_ms:.0f} ms",
        f"restore {t_res.median_ms:.1f} ms",
        timings["triton"].median_ms / t_res.median_ms,
        "(info)",
    )


SECTIONS = ("copy", "transfer", "decode", "prefill", "recompute")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="markdown file for the table and the full log")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS)
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    import triton

    report = Report()
    props = torch.cuda.get_device_properties(0)
    report.say(
        f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    wanted = set(args.sections.split(","))
    ceil: dict[str, float] = {}
    with section(report, "ceilings"):
        ceil = measure_ceilings(report)
    runners: dict[str, Callable[[], None]] = {
        "copy": lambda: bench_copy(report, ceil),
        "transfer": lambda: bench_transfer(report, ceil),
        "decode": lambda: bench_decode(report),
        "prefill": lambda: bench_prefill(report),
        "recompute": lambda: bench_recompute(report, ceil),
    }
    for name in SECTIONS:
        if name in wanted:
            with section(report, name):
                runners[name]()
            torch.cuda.empty_cache()
    summary = "\n## Summary\n\n" + report.table()
    print(summary, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(summary + "\n\n## Full log\n\n```\n" + "\n".join(report.log) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
