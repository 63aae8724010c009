# torch.cuda.Event is unannotated in torch.
# mypy: disable-error-code="no-untyped-call"
"""The ``decode`` and ``prefill`` sections of ``benchmarks.kernels``: the paged attention kernels over a 32K context
against torch SDPA on the same KV laid out contiguously (each backend that accepts it; the fastest is the
baseline), with a sweep of launch configurations."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks._kernel_timing import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    PREFIX_TOKENS,
    Report,
    Timing,
    gbps,
    time_bench,
    time_cuda,
)


def decode_sweep() -> list[Any]:
    """Decode configs timed in the ``decode`` section: ``(block_n, num_splits, num_warps, num_stages, kv_heads)``."""
    from kernels.paged_attention import DecodeConfig

    rows = [
        (64, 0, 4, 3, 1),
        (128, 16, 4, 3, 1),
        (128, 32, 4, 3, 1),
        (128, 16, 4, 4, 1),
        (256, 16, 4, 2, 1),
        (256, 16, 8, 3, 1),
        (64, 0, 4, 3, 2),
        (64, 32, 4, 3, 2),
        (64, 32, 4, 4, 2),
        (32, 0, 4, 3, 4),
        (32, 64, 4, 3, 4),
        (64, 32, 4, 3, 4),
        (64, 64, 8, 3, 4),
        (32, 32, 8, 3, 4),
        (16, 0, 4, 2, 8),
        (16, 0, 4, 3, 8),
        (16, 64, 4, 3, 8),
        (16, 128, 8, 3, 8),
        (32, 64, 8, 2, 8),
        (32, 64, 4, 2, 8),
        (16, 64, 8, 4, 8),
    ]
    return [DecodeConfig(block_n=b, num_splits=n, num_warps=w, num_stages=st, kv_heads=h) for b, n, w, st, h in rows]


def bench_decode(report: Report) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.paged_attention import DecodeConfig, paged_decode_attention

    num_seqs, ctx = 32, PREFIX_TOKENS
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    kv = torch.randn((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = kv[0], kv[1]
    table = torch.randperm(num_blocks, device="cuda").reshape(num_seqs, blocks_per_seq).int()
    seq_lens = torch.full((num_seqs,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn((num_seqs, NUM_HEADS, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    num_bytes = 2 * num_seqs * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
    k_contig = k_cache[table.long()].reshape(num_seqs, ctx, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    v_contig = v_cache[table.long()].reshape(num_seqs, ctx, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]
    baselines = sdpa_variants(lambda: F.scaled_dot_product_attention(q4, k_contig, v_contig, enable_gqa=True))
    if not baselines:
        raise RuntimeError("no SDPA backend ran the decode baseline")
    base_name, base_t, base_out = min(baselines, key=lambda b: b[1].median_ms)
    for name, t, _ in baselines:
        report.say(f"SDPA decode [{name}]: {t}, {gbps(num_bytes, t):.0f} GB/s")
    reference = base_out[:, :, 0, :].float()
    out = torch.full_like(q, float("nan"))
    best: tuple[float, DecodeConfig | None] = (math.inf, None)
    for cfg in decode_sweep():
        try:
            t = time_bench(
                partial(
                    paged_decode_attention,
                    q,
                    k_cache,
                    v_cache,
                    table,
                    seq_lens,
                    max_seq_len=ctx,
                    out=out,
                    config=cfg,
                )
            )
        except Exception as exc:  # a config the compiler rejects (shared memory) is skipped
            report.say(f"decode {cfg}: failed ({type(exc).__name__}: {str(exc)[:100]})")
            continue
        report.say(f"decode {cfg}: {t}, {gbps(num_bytes, t):.0f} GB/s, {base_t.median_ms / t.median_ms:.3f} of SDPA")
        if t.median_ms < best[0]:
            best = (t.median_ms, cfg)
    report.say(f"best decode config: {best[1]}")
    out.fill_(float("nan"))
    paged_decode_attention(q, k_cache, v_cache, table, seq_lens, max_seq_len=ctx, out=out)
    err = ((out.float() - reference).norm() / reference.norm()).item()
    report.say(f"decode (default config) vs SDPA: relative error {err:.2e}")
    if not err < 1e-2:
        raise RuntimeError(f"decode differs from SDPA: {err}")
    t = time_bench(lambda: paged_decode_attention(q, k_cache, v_cache, table, seq_lens, max_seq_len=ctx, out=out))
    t_single = time_cuda(lambda: paged_decode_attention(q, k_cache, v_cache, table, seq_lens, max_seq_len=ctx, out=out))
    with sdpa_kernel(getattr(SDPBackend, base_name)):
        base_single = time_cuda(lambda: F.scaled_dot_product_attention(q4, k_contig, v_contig, enable_gqa=True))
    report.say(
        f"single synchronized call (launch overhead included): decode default {t_single}, "
        f"SDPA[{base_name}] {base_single}, ratio {base_single.median_ms / t_single.median_ms:.3f}"
    )
    report.row(
        "decode b32 x 32K paged (default config)",
        f"{t.median_ms:.3f} ms, {gbps(num_bytes, t):.0f} GB/s",
        f"SDPA[{base_name}] {base_t.median_ms:.3f} ms",
        base_t.median_ms / t.median_ms,
        ">= 0.95",
    )
    if best[1] is not None:
        report.row(
            f"decode best sweep config {best[1]}",
            f"{best[0]:.3f} ms",
            f"SDPA {base_t.median_ms:.3f} ms",
            base_t.median_ms / best[0],
            ">= 0.95",
        )


def sdpa_variants(fn: Callable[[], Any]) -> list[tuple[str, Timing, Any]]:
    """Time ``fn`` under each SDPA backend that accepts it; returns (backend, timing, output)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                out = fn()
                t = time_bench(fn)
        except Exception:  # backend rejects these inputs
            continue
        results.append((backend.name, t, out))
    return results


def bench_prefill(report: Report) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kernels.paged_attention import PrefillConfig, paged_prefill_attention

    q_len, cached = 4096, PREFIX_TOKENS - 4096
    seq_len = q_len + cached
    num_blocks = seq_len // BLOCK_SIZE
    kv = torch.randn((2, 2 * num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = kv[0], kv[1]
    table = torch.randperm(2 * num_blocks, device="cuda")[:num_blocks].reshape(1, num_blocks).int()
    seq_lens = torch.tensor([seq_len], device="cuda", dtype=torch.int32)
    cu = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
    q = torch.randn((q_len, NUM_HEADS, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    flops = 4 * NUM_HEADS * HEAD_SIZE * (q_len * cached + q_len * (q_len + 1) / 2)
    k_c = k_cache[table[0].long()].reshape(1, seq_len, NUM_KV_HEADS, HEAD_SIZE)
    v_c = v_cache[table[0].long()].reshape(1, seq_len, NUM_KV_HEADS, HEAD_SIZE)
    k_t, v_t = k_c.transpose(1, 2).contiguous(), v_c.transpose(1, 2).contiguous()
    q_t = q[None].transpose(1, 2)
    mask = causal_lower_right(q_len, seq_len)
    baselines = sdpa_variants(lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, enable_gqa=True))
    variants = [(n, t, o[0].transpose(0, 1)) for n, t, o in baselines]
    with contextlib.suppress(Exception):  # FA2 through torch: causal is bottom-right aligned; checked below

        def flash() -> Any:
            return torch.ops.aten._flash_attention_forward(
                q[None], k_c, v_c, None, None, q_len, seq_len, 0.0, True, False, scale=HEAD_SIZE**-0.5
            )[0]

        out_f = flash()
        variants.append(("aten._flash_attention_forward", time_bench(flash), out_f[0]))
    # Reference rows: the first and the last 128 queries of every head, in float32.
    rows = torch.cat([torch.arange(128), torch.arange(q_len - 128, q_len)]).cuda()
    k_ref = k_c[0].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
    v_ref = v_c[0].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k_ref) * HEAD_SIZE**-0.5
    pos = cached + rows
    scores.masked_fill_(torch.arange(seq_len, device="cuda")[None, None, :] > pos[None, :, None], float("-inf"))
    reference = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_ref)
    del scores, k_ref, v_ref

    def rel_err(out: Any) -> float:
        return float(((out[rows].float() - reference).norm() / reference.norm()).item())

    valid = []
    for name, t, o in variants:
        err = rel_err(o)
        report.say(f"torch prefill [{name}]: {t}, {flops / t.median_ms / 1e9:.0f} TFLOP/s, rel err {err:.2e}")
        if err < 1e-2:
            valid.append((name, t))
    if not valid:
        raise RuntimeError("no torch prefill baseline matched the reference")
    base_name, base_t = min(valid, key=lambda v: v[1].median_ms)
    out = torch.full_like(q, float("nan"))
    best: tuple[float, PrefillConfig | None] = (math.inf, None)
    for bm, bn, warps, stages in (
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 64, 8, 4),
        (128, 32, 4, 4),
        (64, 128, 4, 3),
        (128, 128, 8, 2),
    ):
        cfg = PrefillConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            t = time_bench(
                partial(
                    paged_prefill_attention,
                    q,
                    k_cache,
                    v_cache,
                    table,
                    cu,
                    seq_lens,
                    max_q_len=q_len,
                    out=out,
                    config=cfg,
                )
            )
        except Exception as exc:
            report.say(f"prefill {cfg}: failed ({type(exc).__name__}: {str(exc)[:100]})")
            continue
        report.say(
            f"prefill {cfg}: {t}, {flops / t.median_ms / 1e9:.0f} TFLOP/s, "
            f"{base_t.median_ms / t.median_ms:.3f} of torch"
        )
        if t.median_ms < best[0]:
            best = (t.median_ms, cfg)
    report.say(f"best prefill config: {best[1]}")
    out.fill_(float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, table, cu, seq_lens, max_q_len=q_len, out=out)
    err = rel_err(out)
    report.say(f"prefill (default config) vs float32 reference rows: relative error {err:.2e}")
    if not err < 1e-2 or torch.isnan(out).any():
        raise RuntimeError(f"prefill differs from the reference: {err}")
    t = time_bench(lambda: paged_prefill_attention(q, k_cache, v_cache, table, cu, seq_lens, max_q_len=q_len, out=out))
    report.row(
        "prefill 4K chunk over 28K cached (default config)",
        f"{t.median_ms:.2f} ms, {flops / t.median_ms / 1e9:.0f} TFLOP/s",
        f"torch[{base_name}] {base_t.median_ms:.2f} ms",
        base_t.median_ms / t.median_ms,
        ">= 0.8",
    )
    if best[1] is not None:
        report.row(
            f"prefill best sweep config {best[1]}",
            f"{best[0]:.2f} ms",
            f"torch {base_t.median_ms:.2f} ms",
            base_t.median_ms / best[0],
            ">= 0.8",
        )
