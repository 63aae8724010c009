# Triton kernels take untyped pointer and scalar arguments; only the launchers are typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""What the paged attention kernels share: the cache-layout tile helpers, the input checks and the constants.

Cache layout (one layer, K and V alike; ``pool[layer, 0]`` and ``pool[layer, 1]`` of the pool in
:mod:`kernels.kv_copy`)::

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_size]      head_size contiguous
    block_table       [num_seqs, max_blocks_per_seq]   token t of seq b is at
                      (block_table[b, t // block_size], t % block_size)

- :func:`kv_tile_offsets` (``@triton.jit``): element offsets of a tile of token positions through the block table;
- :func:`attend_tile` (``@triton.jit``): one online-softmax step over a tile of keys and values, in base 2;
- :func:`check_paged_inputs`, :func:`check_tile`, :func:`out_like`: the launchers' checks (``ValueError``).

Used by :mod:`kernels.paged_decode` and :mod:`kernels.paged_prefill`. Requires torch and triton (the ``gpu``
extra).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launchable, check_same_device, check_tensor

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
"""Query and cache dtypes the kernels take."""
LOG2_E = 1.4426950408889634
"""log2(e): the kernels' softmax runs in base 2, with ``scale * LOG2_E`` folded into the scores."""
MIN_DOT_ROWS = 16
"""``tl.dot``'s smallest tile side: tiles and padded head sizes are at least this."""


@triton.jit
def kv_tile_offsets(
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
def attend_tile(
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


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> int:
    """The checks both launchers make on the query, the cache halves, the block table and the lengths.

    Returns:
        The GQA group size (query heads per KV head).

    Raises:
        ValueError: a wrong shape, dtype, device or stride, a block size that is not a power of two, or (lengths on
            the CPU) a length over the block table's capacity.
    """
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


def check_tile(name: str, value: int) -> None:
    """A tile size in tokens must be a power of two of at least ``MIN_DOT_ROWS`` (``tl.dot``'s minimum).

    Raises:
        ValueError: otherwise.
    """
    if value < MIN_DOT_ROWS or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {MIN_DOT_ROWS}, got {value}")


def out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``q``, or a fresh tensor like ``q`` when omitted.

    Raises:
        ValueError: ``out`` differs from ``q`` in shape, dtype or device, or ``head_size`` is not contiguous.
    """
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError("out must match q in shape, dtype and device, with head_size contiguous")
    return out
