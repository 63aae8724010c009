# Triton kernels take untyped pointer and scalar arguments; only the launchers are typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Paged attention over the KV pool: prefill of a chunk of new tokens, and split-context decode.

One kernel family: attention whose keys and values are read through a block table from one layer's half of the
paged pool, with grouped-query attention (``num_heads = group * num_kv_heads``) and variable lengths in one batch.

Cache layout (one layer, K and V alike; ``pool[layer, 0]`` and ``pool[layer, 1]`` of the pool in
:mod:`kernels.kv_copy`)::

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_size]      head_size contiguous
    block_table       [num_seqs, max_blocks_per_seq]   token t of seq b is at
                      (block_table[b, t // block_size], t % block_size)

- **Prefill** (:func:`paged_prefill_attention`): sequence ``b`` brings ``q_len`` new tokens (packed in ``q`` by
  ``cu_seqlens_q``) whose K/V are already written to the pool; they sit at positions ``[seq_len - q_len,
  seq_len)`` and attend causally (bottom-right aligned) to everything before them. Grid ``(m_tiles, num_heads,
  num_seqs)``, longest tiles first. Each program runs two loops: keys every query row sees (no masks), then the
  diagonal band with the causal mask.
- **Decode** (:func:`paged_decode_attention`): one query token per sequence. The context is split into
  ``num_splits`` ranges; grid ``(num_kv_heads / kv_heads, num_splits, num_seqs)``, KV heads fastest so programs
  that run side by side read whole token rows (all heads) of the same blocks. A program takes ``kv_heads`` KV
  heads and loads the ``kv_heads * group`` query heads that share them as the rows of one tile (padded to 16 rows
  for the tensor cores), so each K/V byte is read once, not once per query head; with several KV heads, the key
  tile holds every head of each token (contiguous rows) and scores across heads are masked out. A second kernel
  merges the splits by their log-sum-exp.

Softmax runs in base 2 (``exp2`` with ``scale * log2(e)`` folded in), accumulators in float32. Under the CPU
interpreter, dot operands are upcast to float32 (``UPCAST_DOT``) because its bf16 ``tl.dot`` is wrong.

Requires torch and triton (the ``gpu`` extra); import this module only where they are installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import check_launchable, check_same_device, check_tensor, is_interpreter

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
LOG2_E = 1.4426950408889634
MIN_DOT_ROWS = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    Attributes:
        block_n: context tokens per loop step.
        num_splits: context ranges per (sequence, KV head group); 0 picks one from the device's multiprocessor
            count.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads.
        kv_heads: KV heads per program (a power of two dividing ``num_kv_heads``; clipped to it). With all of a
            block's heads in one program, each step reads whole token rows (``kv_heads * head_size`` contiguous
            elements per token).
    """

    block_n: int = 128
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 3
    kv_heads: int = 1


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel.

    Attributes:
        block_m: query tokens per program.
        block_n: context tokens per loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _kv_tile_offsets(
    block_table_row_ptr,  # [max_blocks_per_seq] of one sequence
    tokens,  # [BLOCK_N] token positions
    token_mask,  # [BLOCK_N] or None-equivalent all-true
    kv_head,  # scalar, or [BLOCK_N] (one head per key row)
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets of ``(token, kv_head, 0)`` in one cache half, for a tile of token positions."""
    block_ids = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    return (
        block_ids * stride_cache_block
        + (tokens % BLOCK_SIZE).to(tl.int64) * stride_cache_token
        + (kv_head.to(tl.int64) * stride_cache_head)
    )


@triton.jit
def _attend_tile(
    q,  # [ROWS, HEAD_PAD], pre-scaled by scale*log2(e) only through qk_scale
    k_cache_ptr,
    v_cache_ptr,
    kv_offsets,  # [BLOCK_N] int64 element offsets of (token, kv_head, 0)
    load_mask,  # [BLOCK_N, HEAD_PAD]
    score_mask,  # [ROWS, BLOCK_N] or a scalar True
    dims,  # [HEAD_PAD]
    m_i,
    l_i,
    acc,
    qk_scale,
    UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over a tile of keys and values; returns the updated ``(m_i, l_i, acc)``."""
    k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0)
    if UPCAST_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    out_partial_ptr,  # [num_seqs, num_heads, num_splits, HEAD_PAD] float32
    lse_partial_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    qk_scale,  # scale * log2(e)
    num_heads,
    num_splits,
    head_size,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    KV_HEADS: tl.constexpr,  # KV heads per program
    ROWS: tl.constexpr,  # KV_HEADS * GROUP padded to >= 16
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    kv_head0 = tl.program_id(0) * KV_HEADS  # fastest: programs side by side read all heads of the same tokens
    split = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # Rows: the KV_HEADS * GROUP query heads of this program's KV heads (consecutive). Key rows of a step:
    # BLOCK_N tokens x KV_HEADS heads, token-major, so one token's heads are contiguous in the cache. A score
    # counts only where the query row's KV head is the key row's head.
    rows = tl.arange(0, ROWS)
    heads = kv_head0 * GROUP + rows
    row_mask = rows < KV_HEADS * GROUP
    row_kv = tl.minimum(rows // GROUP, KV_HEADS - 1)  # padded rows copy the last head: finite, never stored
    key_rows = tl.arange(0, BLOCK_N * KV_HEADS)
    key_kv = key_rows % KV_HEADS
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < head_size
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + key_rows // KV_HEADS
        token_mask = tokens < end
        offsets = _kv_tile_offsets(
            table_row,
            tokens,
            token_mask,
            kv_head0 + key_kv,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )
        if KV_HEADS == 1:
            score_mask = token_mask[None, :]
        else:
            score_mask = (row_kv[:, None] == key_kv[None, :]) & token_mask[None, :]
        m_i, l_i, acc = _attend_tile(
            q,
            k_cache_ptr,
            v_cache_ptr,
            offsets,
            token_mask[:, None] & dim_mask[None, :],
            score_mask,
            dims,
            m_i,
            l_i,
            acc,
            qk_scale,
            UPCAST_DOT,
        )

    is_empty = l_i == 0.0
    out = acc / tl.where(is_empty, 1.0, l_i)[:, None]
    lse = tl.where(is_empty, float("-inf"), m_i + tl.math.log2(tl.where(is_empty, 1.0, l_i)))
    partial_row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
    tl.store(out_partial_ptr + partial_row[:, None] * HEAD_PAD + dims[None, :], out, mask=row_mask[:, None])
    tl.store(lse_partial_ptr + partial_row, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    out_partial_ptr,  # [num_seqs, num_heads, num_splits, HEAD_PAD] float32
    lse_partial_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    out_ptr,  # [num_seqs, num_heads, head_size]
    num_splits,
    head_size,
    stride_out_seq,
    stride_out_head,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    row = (seq * num_heads + head) * num_splits
    lse = tl.load(lse_partial_ptr + row + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.math.exp2(lse - lse_max)
    partial = tl.load(
        out_partial_ptr + (row + splits)[:, None] * HEAD_PAD + dims[None, :], mask=split_mask[:, None], other=0.0
    )
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq]
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_size]
    qk_scale,  # scale * log2(e)
    head_size,
    num_m_tiles,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    m_tile = num_m_tiles - 1 - tl.program_id(0)  # the longest tiles first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - q_len
    kv_head = head // GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < head_size
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    load_mask = dim_mask[None, :]

    # Keys every row of the tile sees: whole tiles before the first query's position, no masks.
    first_query_pos = cached_len + m_tile * BLOCK_M
    full_end = (first_query_pos // BLOCK_N) * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        offsets = _kv_tile_offsets(
            table_row,
            tokens,
            tokens < full_end,
            kv_head,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, load_mask, True, dims, m_i, l_i, acc, qk_scale, UPCAST_DOT
        )

    # The diagonal band: causal mask, bounded by the sequence's end.
    query_pos = cached_len + rows
    band_end = tl.minimum(first_query_pos + BLOCK_M, seq_len)
    for tile_start in range(full_end, band_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < band_end
        offsets = _kv_tile_offsets(
            table_row,
            tokens,
            token_mask,
            kv_head,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )
        causal = (tokens[None, :] <= query_pos[:, None]) & token_mask[None, :]
        m_i, l_i, acc = _attend_tile(
            q,
            k_cache_ptr,
            v_cache_ptr,
            offsets,
            token_mask[:, None] & load_mask,
            causal,
            dims,
            m_i,
            l_i,
            acc,
            qk_scale,
            UPCAST_DOT,
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _check_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> int:
    """Shared checks; returns the GQA group size (query heads per KV head)."""
    check_tensor("q", q, ndim=3, dtypes=SUPPORTED_DTYPES, contiguous=False)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, ndim=4, dtypes=(q.dtype,), contiguous=False)
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: head_size must be the contiguous dimension, strides {cache.stride()}")
        check_launchable(name, cache)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must share shape and strides: {tuple(k_cache.shape)}/{k_cache.stride()} vs "
            f"{tuple(v_cache.shape)}/{v_cache.stride()}"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"q: head_size must be the contiguous dimension, strides {q.stride()}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_size differs: q {q.shape[2]}, cache {k_cache.shape[3]}")
    num_kv_heads = k_cache.shape[2]
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64), contiguous=False)
    if block_table.stride(1) != 1:
        raise ValueError("block_table: rows must be contiguous")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, seq_lens {seq_lens.shape[0]} entries")
    check_launchable("q", q)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    if seq_lens.device.type == "cpu" and seq_lens.numel() > 0:
        capacity = block_table.shape[1] * block_size
        if int(seq_lens.max()) > capacity:
            raise ValueError(f"a seq_len exceeds the block table's capacity of {capacity} tokens")
    return q.shape[1] // num_kv_heads


def _check_tile(name: str, value: int) -> None:
    """A tile size in tokens must be a power of two of at least ``MIN_DOT_ROWS`` (``tl.dot``'s minimum).

    Raises:
        ValueError: otherwise.
    """
    if value < MIN_DOT_ROWS or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {MIN_DOT_ROWS}, got {value}")


def _out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``q``, or a fresh tensor like ``q`` when omitted.

    Raises:
        ValueError: ``out`` differs from ``q`` in shape, dtype or device, or ``head_size`` is not contiguous.
    """
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError("out must match q in shape, dtype and device, with head_size contiguous")
    return out


def _num_splits_for(num_programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Enough splits to give every multiprocessor about 32 programs, each with at least two tiles.

    Measured on an H200 (batch 32 x 32K, 8 KV heads): 16 splits (4,096 programs) beat 5 by 12%.
    """
    num_sms = int(torch.cuda.get_device_properties(device).multi_processor_count) if device.type == "cuda" else 1
    wanted = 1 << max(0, (32 * num_sms // max(num_programs, 1)).bit_length() - 1)  # a power of two
    return max(1, min(int(wanted), int(triton.cdiv(max_seq_len, 2 * block_n))))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole context, read from the paged pool.

    Args:
        q: ``[num_seqs, num_heads, head_size]`` bf16/fp16, ``head_size`` contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, same dtype, ``head_size`` contiguous.
        v_cache: same shape, dtype and strides as ``k_cache``.
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32/int64, rows contiguous.
        seq_lens: ``[num_seqs]`` int32/int64 context lengths in tokens, the new token (already in the pool)
            included; 0 gives a zero output row.
        scale: softmax scale; ``head_size ** -0.5`` when omitted.
        max_seq_len: upper bound of ``seq_lens`` in tokens, used to pick the split count without a device sync;
            read from ``seq_lens`` when omitted.
        out: ``[num_seqs, num_heads, head_size]`` in ``q.dtype`` to write into; allocated when omitted.
        config: launch parameters; defaults from :class:`DecodeConfig`.

    Returns:
        ``out``, ``[num_seqs, num_heads, head_size]``.

    Raises:
        ValueError: on a wrong shape, dtype, device, stride or configuration.
    """
    group = _check_cache(q, k_cache, v_cache, block_table, seq_lens)
    cfg = config or DecodeConfig()
    _check_tile("block_n", cfg.block_n)
    num_seqs, num_heads, head_size = q.shape
    out = _out_like(q, out)
    if num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    kv_heads = min(cfg.kv_heads, num_kv_heads)
    if kv_heads <= 0 or kv_heads & (kv_heads - 1) or num_kv_heads % kv_heads:
        raise ValueError(f"kv_heads must be a power of two dividing num_kv_heads {num_kv_heads}, got {cfg.kv_heads}")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_groups = num_kv_heads // kv_heads
    num_splits = cfg.num_splits or _num_splits_for(num_seqs * num_groups, max_seq_len, cfg.block_n, q.device)
    head_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(head_size))
    out_partial = torch.empty((num_seqs, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
    lse_partial = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    scale = head_size**-0.5 if scale is None else scale
    _decode_split_kernel[(num_groups, num_splits, num_seqs)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        out_partial_ptr=out_partial,
        lse_partial_ptr=lse_partial,
        qk_scale=scale * LOG2_E,
        num_heads=num_heads,
        num_splits=num_splits,
        head_size=head_size,
        stride_q_seq=q.stride(0),
        stride_q_head=q.stride(1),
        stride_cache_block=k_cache.stride(0),
        stride_cache_token=k_cache.stride(1),
        stride_cache_head=k_cache.stride(2),
        stride_table_seq=block_table.stride(0),
        GROUP=group,
        KV_HEADS=kv_heads,
        ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(kv_heads * group)),
        HEAD_PAD=head_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=cfg.block_n,
        UPCAST_DOT=is_interpreter(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        out_partial_ptr=out_partial,
        lse_partial_ptr=lse_partial,
        out_ptr=out,
        num_splits=num_splits,
        head_size=head_size,
        stride_out_seq=out.stride(0),
        stride_out_head=out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_PAD=head_pad,
        num_warps=4 if num_splits <= 32 else 8,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk of new tokens over their sequence's cached tokens plus themselves.

    Sequence ``b`` has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens at positions
    ``[seq_lens[b] - q_len, seq_lens[b])``, whose K/V are already written to the pool; query ``i`` attends to
    positions ``[0, seq_lens[b] - q_len + i]``.

    Args:
        q: ``[num_tokens, num_heads, head_size]`` bf16/fp16, sequences packed back to back, ``head_size``
            contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, same dtype, ``head_size`` contiguous.
        v_cache: same shape, dtype and strides as ``k_cache``.
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32/int64, rows contiguous.
        cu_seqlens_q: ``[num_seqs + 1]`` int32/int64 cumulative new-token counts, starting at 0.
        seq_lens: ``[num_seqs]`` int32/int64 total tokens per sequence (cached + new).
        scale: softmax scale; ``head_size ** -0.5`` when omitted.
        max_q_len: upper bound of the new-token counts, to size the grid without a device sync.
        out: ``[num_tokens, num_heads, head_size]`` in ``q.dtype`` to write into; allocated when omitted.
        config: launch parameters; defaults from :class:`PrefillConfig`.

    Returns:
        ``out``, ``[num_tokens, num_heads, head_size]``.

    Raises:
        ValueError: on a wrong shape, dtype, device, stride or configuration.
    """
    group = _check_cache(q, k_cache, v_cache, block_table, seq_lens)
    cfg = config or PrefillConfig()
    _check_tile("block_m", cfg.block_m)
    _check_tile("block_n", cfg.block_n)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    num_tokens, num_heads, head_size = q.shape
    out = _out_like(q, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    num_m_tiles = math.ceil(max_q_len / cfg.block_m)
    if num_m_tiles == 0:
        return out
    scale = head_size**-0.5 if scale is None else scale
    _prefill_kernel[(num_m_tiles, num_heads, num_seqs)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=block_table,
        cu_seqlens_q_ptr=cu_seqlens_q,
        seq_lens_ptr=seq_lens,
        out_ptr=out,
        qk_scale=scale * LOG2_E,
        head_size=head_size,
        num_m_tiles=num_m_tiles,
        stride_q_token=q.stride(0),
        stride_q_head=q.stride(1),
        stride_out_token=out.stride(0),
        stride_out_head=out.stride(1),
        stride_cache_block=k_cache.stride(0),
        stride_cache_token=k_cache.stride(1),
        stride_cache_head=k_cache.stride(2),
        stride_table_seq=block_table.stride(0),
        GROUP=group,
        HEAD_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        UPCAST_DOT=is_interpreter(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
