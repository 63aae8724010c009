"""Torch references for every kernel family, and the attention the model runs on the CPU.

Each function computes the same result as its Triton counterpart with plain torch operations, in float32, and
never modifies its inputs (the scatter reference returns a new pool). Tests compare kernels against these; the
model's CPU path calls the attention references directly.

Requires torch; import this module only where it is installed.
"""

from __future__ import annotations

import torch


def gather_kv_blocks_ref(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`kernels.kv_copy.gather_kv_blocks`.

    Args:
        kv_pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``.
        block_ids: ``[num_ids]`` integer block ids.

    Returns:
        ``[num_ids, num_layers, 2, block_size, num_kv_heads, head_size]``, a new tensor.
    """
    return kv_pool[:, :, block_ids.long()].permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_kv_blocks_ref(kv_pool: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`kernels.kv_copy.scatter_kv_blocks`, returning an updated copy of the pool.

    Args:
        kv_pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (left unchanged).
        block_ids: ``[num_ids]`` distinct integer block ids.
        src: ``[num_ids, num_layers, 2, block_size, num_kv_heads, head_size]``.

    Returns:
        A new pool equal to ``kv_pool`` with the listed blocks replaced by ``src``.
    """
    out = kv_pool.clone()
    out[:, :, block_ids.long()] = src.permute(1, 2, 0, 3, 4, 5).to(out.device)
    return out


def gather_sequence_kv(cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of one sequence, read through its block table.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` (the K or the V half of one layer).
        block_table_row: ``[max_blocks_per_seq]`` block ids of the sequence, in token order.
        num_tokens: tokens to read.

    Returns:
        ``[num_tokens, num_kv_heads, head_size]``, a new tensor.
    """
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_table_row[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached tokens plus themselves, read from the pool.

    Sequence ``b`` has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens at positions
    ``[seq_lens[b] - q_len, seq_lens[b])``; their K/V are already in the pool. Query ``i`` of it attends to
    positions ``[0, seq_lens[b] - q_len + i]`` (bottom-right aligned causal mask).

    Args:
        q: ``[num_tokens, num_heads, head_size]``, sequences packed back to back.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``; ``num_heads % num_kv_heads == 0``.
        v_cache: same shape as ``k_cache``.
        block_table: ``[num_seqs, max_blocks_per_seq]`` block ids.
        cu_seqlens_q: ``[num_seqs + 1]`` cumulative new-token counts, starting at 0.
        seq_lens: ``[num_seqs]`` total tokens per sequence (cached + new).
        scale: softmax scale, usually ``head_size ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_b = q[cu[b] : cu[b + 1]].float()
        q_len = q_b.shape[0]
        if q_len == 0:
            continue
        k = gather_sequence_kv(k_cache, block_table[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_sequence_kv(v_cache, block_table[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over the sequence's whole context in the pool.

    Args:
        q: ``[num_seqs, num_heads, head_size]``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        v_cache: same shape as ``k_cache``.
        block_table: ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: ``[num_seqs]`` context length per sequence, the new token included.
        scale: softmax scale.

    Returns:
        ``[num_seqs, num_heads, head_size]`` in ``q.dtype``.
    """
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, cu, seq_lens, scale)
