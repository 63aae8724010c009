"""Benchmark: the gathered prefill -> decode KV handoff (``workers.model.kv_handoff``) against per-block copies and
against the copy ceilings, all measured in one run on one GPU.

Method. Two pools of the Llama-3-8B shape (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks: 2 MiB a
block), a prompt of ``--tokens`` tokens held in random, distinct blocks of the sender's pool, received into random,
distinct blocks of the receiver's pool. Figures (median of ``--repeat`` runs after one warm-up, CUDA events around
each synchronized call):

* device -> device, gathered (``KVHandoff(path="device")``): gather kernel, one copy per chunk, scatter kernel;
  ceiling: one ``copy_`` of the same bytes between two contiguous device buffers; baseline: one ``copy_`` per
  (layer, K|V, block) slab.
* device -> pinned host -> device, gathered (``path="host"``): gather kernel into pinned memory, copy engine back,
  scatter kernel; ceiling: a contiguous device -> pinned ``copy_`` then a pinned -> device ``copy_`` of the same
  bytes; baseline: per-slab copies to pinned memory, then per-slab copies back.

Every path is checked bit-exact against the source blocks. With one GPU the device -> device path is a copy within
HBM; across GPUs it would be a peer copy over NVLink (not measured here).

Run: ``python -m benchmarks.handoff [--tokens 8192] [--repeat 5] [--chunk-blocks 128]`` (needs CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


def _time_ms(fn: Callable[[], object], repeat: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)))
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-blocks", type=int, default=128)
    parser.add_argument("--sweep-chunks", default="", help="comma-separated chunk sizes to time the device path at")
    args = parser.parse_args(argv)

    import torch

    from workers.model.kv_handoff import KVHandoff, copy_per_block

    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    n = args.tokens // BLOCK_SIZE
    num_blocks = 2 * n + 64
    shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    gen = torch.Generator(device="cpu").manual_seed(0)
    src = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    dst = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    block_bytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2
    num_bytes = n * block_bytes
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"# {args.tokens} tokens = {n} blocks of {block_bytes / 2**20:.1f} MiB = {num_bytes / 2**30:.2f} GiB")
    print(f"# per-block path: {n * NUM_LAYERS * 2} copies of {block_bytes // (NUM_LAYERS * 2) // 1024} KiB")

    def check(name: str) -> None:
        torch.cuda.synchronize()
        want = src[:, :, src_ids]
        got = dst[:, :, dst_ids]
        if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
            raise RuntimeError(f"{name}: destination blocks differ from the source")
        dst.zero_()

    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    pinned = torch.empty(num_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    t_d2d_ceiling = _time_ms(lambda: b.copy_(a), args.repeat)
    t_d2h = _time_ms(lambda: pinned.copy_(a, non_blocking=True), args.repeat)
    t_h2d = _time_ms(lambda: b.copy_(pinned, non_blocking=True), args.repeat)
    t_host_ceiling = t_d2h + t_h2d

    rows: list[tuple[str, float, float, str]] = []
    dev_handoff = KVHandoff(src, dst, path="device", chunk_blocks=args.chunk_blocks)
    t_dev = _time_ms(lambda: dev_handoff.send(src_ids, dst_ids), args.repeat)
    check("device gathered")
    t_dev_blocks = _time_ms(lambda: copy_per_block(src, src_ids, dst, dst_ids), max(1, args.repeat // 2))
    check("device per-block")
    host_handoff = KVHandoff(src, dst, path="host", chunk_blocks=args.chunk_blocks)
    t_host = _time_ms(lambda: host_handoff.send(src_ids, dst_ids), args.repeat)
    check("host gathered")
    staging = torch.empty(
        (n, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), dtype=torch.bfloat16, pin_memory=True
    )

    def host_per_block() -> None:
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                for i, s in enumerate(src_ids):
                    staging[i, layer, kv].copy_(src[layer, kv, s], non_blocking=True)
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                for i, d in enumerate(dst_ids):
                    dst[layer, kv, d].copy_(staging[i, layer, kv], non_blocking=True)

    t_host_blocks = _time_ms(host_per_block, max(1, args.repeat // 2))
    check("host per-block")

    for chunk in [int(c) for c in args.sweep_chunks.split(",") if c]:
        h = KVHandoff(src, dst, path="device", chunk_blocks=chunk)
        t = _time_ms(lambda h=h: h.send(src_ids, dst_ids), args.repeat)  # type: ignore[misc]
        check(f"device chunk {chunk}")
        print(f"# device path, chunk_blocks={chunk}: {t:.3f} ms, {t_d2d_ceiling * 2 / t:.3f} of the two-pass ceiling")

    def gbs(t_ms: float) -> float:
        return float(num_bytes / (t_ms * 1e-3) / 1e9)

    rows.append(("device->device ceiling (one copy_ of the bytes)", t_d2d_ceiling, 1.0, "ceiling"))
    rows.append(("device->device two-pass ceiling (2 x copy_: gather + scatter)", 2 * t_d2d_ceiling, 1.0, "ceiling"))
    rows.append(
        ("device->device gathered handoff", t_dev, t_d2d_ceiling / t_dev, f"{t_dev_blocks / t_dev:.1f}x per-block")
    )
    rows.append(("device->device per-block copies", t_dev_blocks, t_d2d_ceiling / t_dev_blocks, "baseline"))
    rows.append(("device->pinned->device ceiling (d2h + h2d copy_)", t_host_ceiling, 1.0, "ceiling"))
    rows.append(
        (
            "device->pinned->device gathered handoff",
            t_host,
            t_host_ceiling / t_host,
            f"{t_host_blocks / t_host:.1f}x per-block",
        )
    )
    rows.append(("device->pinned->device per-block copies", t_host_blocks, t_host_ceiling / t_host_blocks, "baseline"))
    print(f"\n| handoff of {args.tokens} tokens ({num_bytes / 2**30:.2f} GiB) | time | GB/s | of ceiling | note |")
    print("|---|---|---|---|---|")
    for name, t, ratio, note in rows:
        print(f"| {name} | {t:.2f} ms | {gbs(t):.1f} | {ratio:.3f} | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
