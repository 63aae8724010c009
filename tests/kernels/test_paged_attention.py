"""Paged prefill and decode attention against the torch reference (interpreter on CPU, or on a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")

from kernels.paged_attention import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    paged_decode_attention,
    paged_prefill_attention,
)
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402

pytestmark = pytest.mark.unit

TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}  # (atol, rtol) against float32 math
DTYPES = [torch.bfloat16, torch.float16]


def make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device):
    """K and V halves of one layer, as views of one pool ``[2, num_blocks, block_size, heads, head_size]``."""
    pool = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=device).to(dtype)
    return pool[0], pool[1]


def make_block_table(num_seqs, max_blocks, num_blocks, device):
    ids = torch.randperm(num_blocks)[: num_seqs * max_blocks]
    return ids.reshape(num_seqs, max_blocks).to(device=device, dtype=torch.int32)


def poisoned_like(tensor):
    return torch.full_like(tensor, float("nan"))


# (seq_lens, block_size, num_heads, num_kv_heads, head_size, num_splits, kv_heads per program)
DECODE_CASES = [
    ([13, 1, 30], 4, 8, 2, 32, 2, 1),
    ([13, 1, 30], 4, 8, 2, 32, 2, 2),  # both KV heads in one program
    ([7, 64], 16, 4, 4, 16, 3, 1),
    ([7, 64], 16, 4, 4, 16, 3, 4),  # no GQA, all heads in one program
    ([9, 33], 8, 16, 4, 32, 2, 2),  # group 4, two of four KV heads per program
    ([40], 8, 6, 1, 24, 5, 1),  # odd head size (padded), more splits than tiles
    ([40], 8, 12, 2, 24, 3, 8),  # kv_heads clipped to num_kv_heads
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(case, dtype, device):
    seq_lens_list, block_size, num_heads, num_kv_heads, head_size, num_splits, kv_heads = case
    max_blocks = -(-max(seq_lens_list) // block_size)
    num_blocks = max_blocks * len(seq_lens_list) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    table = make_block_table(len(seq_lens_list), max_blocks, num_blocks, device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens_list), num_heads, head_size, device=device).to(dtype)
    inputs = [t.clone() for t in (q, k_cache, v_cache)]
    out = poisoned_like(q)
    paged_decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        seq_lens,
        out=out,
        config=DecodeConfig(block_n=16, num_splits=num_splits, kv_heads=kv_heads),
    )
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, head_size**-0.5)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    for before, after in zip(inputs, (q, k_cache, v_cache), strict=True):
        assert torch.equal(before, after)


# (q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_size)
PREFILL_CASES = [
    ([5, 1, 20], [13, 1, 30], 4, 8, 2, 32),  # cached prefixes, a single-token chunk, a chunk spanning tiles
    ([17], [17], 16, 2, 1, 16),  # from scratch, one block boundary crossed
    ([3, 9], [40, 9], 8, 3, 3, 24),  # no GQA, odd head size
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_reference(case, dtype, device):
    q_lens, seq_lens_list, block_size, num_heads, num_kv_heads, head_size = case
    max_blocks = -(-max(seq_lens_list) // block_size)
    num_blocks = max_blocks * len(seq_lens_list) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    table = make_block_table(len(seq_lens_list), max_blocks, num_blocks, device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_heads, head_size, device=device).to(dtype)
    out = poisoned_like(q)
    paged_prefill_attention(
        q, k_cache, v_cache, table, cu, seq_lens, out=out, config=PrefillConfig(block_m=16, block_n=16)
    )
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, seq_lens, head_size**-0.5)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_decode_equals_prefill_of_one_token(device):
    k_cache, v_cache = make_cache(12, 4, 2, 16, torch.float16, device)
    table = make_block_table(2, 5, 12, device)
    seq_lens = torch.tensor([9, 18], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 16, device=device).half()
    cu = torch.arange(3, dtype=torch.int32, device=device)
    dec = paged_decode_attention(q, k_cache, v_cache, table, seq_lens, config=DecodeConfig(block_n=16, num_splits=2))
    pre = paged_prefill_attention(q, k_cache, v_cache, table, cu, seq_lens, config=PrefillConfig(16, 16))
    torch.testing.assert_close(dec, pre, atol=2e-3, rtol=2e-3)


def test_launchers_reject_bad_arguments(device):
    k_cache, v_cache = make_cache(8, 4, 2, 16, torch.bfloat16, device)
    table = make_block_table(1, 4, 8, device)
    seq_lens = torch.tensor([9], dtype=torch.int32, device=device)
    q = torch.randn(1, 4, 16, device=device).bfloat16()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.half(), k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="head_size differs"):
        paged_decode_attention(q[..., :8], k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(q, k_cache, v_cache, table, seq_lens, config=DecodeConfig(block_n=24))
    with pytest.raises(ValueError, match="kv_heads"):
        paged_decode_attention(q, k_cache, v_cache, table, seq_lens, config=DecodeConfig(kv_heads=0))
    k6, v6 = make_cache(8, 4, 6, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="kv_heads"):
        paged_decode_attention(q.repeat(1, 3, 1), k6, v6, table, seq_lens, config=DecodeConfig(kv_heads=4))
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        paged_prefill_attention(q, k_cache, v_cache, table, seq_lens, seq_lens)
    with pytest.raises(ValueError, match="share shape and strides"):
        paged_decode_attention(q, k_cache, v_cache.contiguous()[:, :2], table, seq_lens)
