# torch.cuda.Event is unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""The ``copy`` and ``transfer`` sections of ``benchmarks.kernels``: KV gather/scatter device to device against the
copy ceiling, and offload/restore of a 32K-token prefix through pinned host memory against the pinned ceilings."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks._kernel_timing import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    NUM_PREFIX_BLOCKS,
    Report,
    Timing,
    gbps,
    like,
    make_pool,
    time_bench,
    time_cuda,
    wait_copy,
)


def transfer_row(
    report: Report, name: str, num_bytes: float, timing: Timing, ceil: dict[str, float], direction: str
) -> None:
    """A summary row for a KV transfer: bandwidth against the ``direction`` (``"d2h"``/``"h2d"``) copy ceiling."""
    bw = gbps(num_bytes, timing)
    report.row(
        name,
        f"{bw:.1f} GB/s ({timing.median_ms:.1f} ms)",
        f"{direction} {ceil[direction]:.1f} GB/s",
        bw / ceil[direction],
        ">= 0.93",
    )


def sweep_tiles(
    report: Report,
    what: str,
    copy: Callable[..., Any],
    args: tuple[Any, ...],
    num_bytes: float,
    ceil: dict[str, float],
    direction: str,
) -> None:
    """Log ``copy(*args)`` over a few tile sizes and warp counts, against the ``direction`` copy ceiling."""
    for tile, warps in ((8192, 8), (16384, 8), (4096, 4)):
        t = time_cuda(partial(copy, *args, tile_numel=tile, num_warps=warps), warmup=1, repeat=5)
        bw = gbps(num_bytes, t)
        ratio = bw / ceil[direction]
        report.say(f"{what} direct tile={tile} warps={warps}: {t}, {bw:.1f} GB/s, {ratio:.3f} of {direction}")


def bench_copy(report: Report, ceil: dict[str, float]) -> None:
    import torch

    from kernels.kv_copy import gather_kv_blocks, scatter_kv_blocks

    pool = make_pool(2 * NUM_PREFIX_BLOCKS)
    ids = torch.randperm(pool.shape[2], device="cuda")[:NUM_PREFIX_BLOCKS].int()
    num_bytes = ceil["bytes"]
    out = torch.empty((NUM_PREFIX_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), **like(pool))
    out.fill_(float("nan"))
    gather_kv_blocks(pool, ids, out)
    if not torch.equal(out, pool[:, :, ids.long()].permute(2, 0, 1, 3, 4, 5)):
        raise RuntimeError("gather differs from torch indexing")
    report.say("gather correctness at full size: bit-exact")
    best: tuple[float, str] = (0.0, "")
    for tile in (2048, 4096):
        for warps in (4, 8):
            for units in (2, 4, 8):
                for streaming in (False, True):
                    t = time_bench(
                        partial(
                            gather_kv_blocks,
                            pool,
                            ids,
                            out,
                            tile_numel=tile,
                            num_warps=warps,
                            units_per_program=units,
                            streaming=streaming,
                        )
                    )
                    bw = gbps(2 * num_bytes, t)
                    name = f"tile={tile} warps={warps} units={units} streaming={streaming}"
                    report.say(f"gather {name}: {t}, {bw:.0f} GB/s, {bw / ceil['copy']:.3f} of copy")
                    best = max(best, (bw, name))
    report.say(f"best gather config: {best[1]} ({best[0]:.0f} GB/s)")
    t_default = time_bench(lambda: gather_kv_blocks(pool, ids, out))
    bw = gbps(2 * num_bytes, t_default)
    t_single = time_cuda(lambda: gather_kv_blocks(pool, ids, out))
    report.say(f"gather default, single synchronized call: {t_single}, {gbps(2 * num_bytes, t_single):.0f} GB/s")
    report.row(
        "gather 2,048 blocks (default config)",
        f"{bw:.0f} GB/s",
        f"copy {ceil['copy']:.0f} GB/s",
        bw / ceil["copy"],
        ">= 0.93",
    )
    t_idx = time_bench(lambda: torch.index_select(pool, 2, ids))
    bw_idx = gbps(2 * num_bytes, t_idx)
    report.row(
        "torch.index_select baseline",
        f"{bw_idx:.0f} GB/s",
        f"copy {ceil['copy']:.0f} GB/s",
        bw_idx / ceil["copy"],
        "~0.3",
    )
    src = torch.randn_like(out)
    expected = pool.clone()
    expected[:, :, ids.long()] = src.permute(1, 2, 0, 3, 4, 5)
    scatter_kv_blocks(pool, ids, src)
    if not torch.equal(pool, expected):
        raise RuntimeError("scatter differs from torch indexing")
    report.say("scatter correctness at full size: bit-exact")
    del expected
    scatter_sweep = ((2048, 8, 4, False), (2048, 8, 4, True), (2048, 4, 4, True), (4096, 8, 8, True))
    for tile, warps, units, streaming in scatter_sweep:
        t = time_bench(
            partial(
                scatter_kv_blocks,
                pool,
                ids,
                src,
                tile_numel=tile,
                num_warps=warps,
                units_per_program=units,
                streaming=streaming,
            )
        )
        bw = gbps(2 * num_bytes, t)
        report.say(
            f"scatter tile={tile} warps={warps} units={units} streaming={streaming}: {t}, {bw:.0f} GB/s, "
            f"{bw / ceil['copy']:.3f} of copy"
        )
    t_sc = time_bench(lambda: scatter_kv_blocks(pool, ids, src))
    t_single = time_cuda(lambda: scatter_kv_blocks(pool, ids, src))
    report.say(f"scatter default, single synchronized call: {t_single}, {gbps(2 * num_bytes, t_single):.0f} GB/s")
    bw = gbps(2 * num_bytes, t_sc)
    report.row("scatter 2,048 blocks", f"{bw:.0f} GB/s", f"copy {ceil['copy']:.0f} GB/s", bw / ceil["copy"], ">= 0.93")


def bench_transfer(report: Report, ceil: dict[str, float]) -> None:
    import torch

    from kernels.kv_copy import gather_kv_blocks, scatter_kv_blocks
    from workers.model.kv_pool import KVTransfer

    pool = make_pool(2 * NUM_PREFIX_BLOCKS)
    ids = torch.randperm(pool.shape[2], device="cuda")[:NUM_PREFIX_BLOCKS].int()
    num_bytes = ceil["bytes"]
    shape = (NUM_PREFIX_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    host = torch.empty(shape, dtype=pool.dtype, pin_memory=True)
    host.fill_(float("nan"))
    gather_kv_blocks(pool, ids, host)
    torch.cuda.synchronize()
    if not torch.equal(host, pool[:, :, ids.long()].permute(2, 0, 1, 3, 4, 5).cpu()):
        raise RuntimeError("gather into pinned host memory differs from torch indexing")
    report.say("gather straight into pinned host memory: bit-exact")
    sweep_tiles(report, "offload", gather_kv_blocks, (pool, ids, host), num_bytes, ceil, "d2h")
    t_off = time_cuda(lambda: gather_kv_blocks(pool, ids, host), warmup=1, repeat=5)
    transfer_row(report, "offload 32K-token prefix, direct (gather -> pinned)", num_bytes, t_off, ceil, "d2h")
    host_src = host.clone().pin_memory()
    pool2 = pool.clone()
    scatter_kv_blocks(pool2, ids, host_src)
    torch.cuda.synchronize()
    if not torch.equal(pool2[:, :, ids.long()].permute(2, 0, 1, 3, 4, 5).cpu(), host_src):
        raise RuntimeError("scatter from pinned host memory differs")
    del pool2
    report.say("scatter straight from pinned host memory: bit-exact")
    sweep_tiles(report, "restore", scatter_kv_blocks, (pool, ids, host_src), num_bytes, ceil, "h2d")
    t_res = time_cuda(lambda: scatter_kv_blocks(pool, ids, host_src), warmup=1, repeat=5)
    transfer_row(report, "restore 32K-token prefix, direct (pinned -> scatter)", num_bytes, t_res, ceil, "h2d")
    for chunk_blocks in (128, 256):
        staged = KVTransfer(pool, mode="staged", chunk_blocks=chunk_blocks)
        t_s_off = time_cuda(partial(wait_copy, staged.offload, ids, host), warmup=1, repeat=5)
        t_s_res = time_cuda(partial(wait_copy, staged.restore, ids, host_src), warmup=1, repeat=5)
        report.say(
            f"staged chunk={chunk_blocks}, consecutive host slots: offload {t_s_off} "
            f"({gbps(num_bytes, t_s_off) / ceil['d2h']:.3f} of d2h), restore {t_s_res} "
            f"({gbps(num_bytes, t_s_res) / ceil['h2d']:.3f} of h2d)"
        )
    # The engine's path (KVTransfer's default mode) for two CPU-slot layouts: the prefix's blocks in shuffled runs
    # of 16 consecutive slots (staged), and every slot random (runs of one block: the kernel reads directly).
    run_starts = (torch.randperm(NUM_PREFIX_BLOCKS // 16) * 16).tolist()
    layouts = {
        "CPU slots in runs of 16": [start + i for start in run_starts for i in range(16)],
        "random CPU slots": torch.randperm(NUM_PREFIX_BLOCKS).tolist(),
    }
    for chunk_blocks in (64, 128):
        transfer = KVTransfer(pool, chunk_blocks=chunk_blocks)
        t = time_cuda(partial(wait_copy, transfer.restore, ids, host_src, layouts["CPU slots in runs of 16"]))
        ratio = gbps(num_bytes, t) / ceil["h2d"]
        report.say(f"restore, engine path, runs of 16, chunk={chunk_blocks}: {t}, {ratio:.3f} of h2d")
    transfer = KVTransfer(pool)
    for layout, cpu_ids in layouts.items():
        expected = host_src[cpu_ids].clone()
        pool[:, :, ids.long()] = float("nan")
        wait_copy(transfer.restore, ids, host_src, cpu_ids)
        torch.cuda.synchronize()
        if not torch.equal(pool[:, :, ids.long()].permute(2, 0, 1, 3, 4, 5).cpu(), expected):
            raise RuntimeError(f"engine-path restore differs ({layout})")
        del expected
        t_eng = time_cuda(partial(wait_copy, transfer.restore, ids, host_src, cpu_ids), warmup=1, repeat=5)
        name = f"restore 32K-token prefix, engine path, {layout} (bit-exact)"
        transfer_row(report, name, num_bytes, t_eng, ceil, "h2d")
    cpu_ids = layouts["random CPU slots"]
    t_eng_off = time_cuda(partial(wait_copy, transfer.offload, ids, host, cpu_ids), warmup=1, repeat=5)
    name = "offload 32K-token prefix, engine path (gather -> pinned; random CPU slots)"
    transfer_row(report, name, num_bytes, t_eng_off, ceil, "d2h")
