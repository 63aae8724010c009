# Triton kernels take untyped pointer and scalar arguments; only the launchers are typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Paged prefill attention: a chunk of new tokens per sequence over its cached tokens plus themselves, causally.

Sequence ``b`` brings ``q_len`` new tokens (packed in ``q`` by ``cu_seqlens_q``) whose K/V are already written to
the pool; they sit at positions ``[seq_len - q_len, seq_len)`` and attend causally (bottom-right aligned) to
everything before them. Grid ``(m_tiles, num_heads, num_seqs)``, longest tiles first. Each program runs two loops:
keys every query row sees (no masks), then the diagonal band with the causal mask. Cache layout and the shared
tile step: :mod:`kernels.paged_tiles`.

Requires torch and triton (the ``gpu`` extra); import this module only where they are installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import check_same_device, check_tensor, is_interpreter
from kernels.paged_tiles import (
    LOG2_E,
    MIN_DOT_ROWS,
    attend_tile,
    check_paged_inputs,
    check_tile,
    kv_tile_offsets,
    out_like,
)


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
        offsets = kv_tile_offsets(
            table_row,
            tokens,
            tokens < full_end,
            kv_head,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, load_mask, True, dims, m_i, l_i, acc, qk_scale, UPCAST_DOT
        )

    # The diagonal band: causal mask, bounded by the sequence's end.
    query_pos = cached_len + rows
    band_end = tl.minimum(first_query_pos + BLOCK_M, seq_len)
    for tile_start in range(full_end, band_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < band_end
        offsets = kv_tile_offsets(
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
        m_i, l_i, acc = attend_tile(
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
    group = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens)
    cfg = config or PrefillConfig()
    check_tile("block_m", cfg.block_m)
    check_tile("block_n", cfg.block_n)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    num_tokens, num_heads, head_size = q.shape
    out = out_like(q, out)
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
