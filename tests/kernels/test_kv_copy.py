"""KV block gather/scatter against the torch reference (interpreter on CPU, or on a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")

from kernels.kv_copy import gather_kv_blocks, scatter_kv_blocks  # noqa: E402
from kernels.reference import gather_kv_blocks_ref, scatter_kv_blocks_ref  # noqa: E402

pytestmark = pytest.mark.unit

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
# (num_layers, num_blocks, block_size, num_kv_heads, head_size, num_ids)
SHAPES = [(2, 9, 4, 2, 16, 3), (3, 37, 16, 1, 24, 5), (1, 5, 2, 3, 8, 5)]


def make_pool(shape, dtype, device):
    num_layers, num_blocks, block_size, num_kv_heads, head_size, _ = shape
    pool = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_size, device=device)
    return pool.to(dtype)


def make_ids(num_blocks, num_ids, device, dtype=torch.int32):
    return torch.randperm(num_blocks)[:num_ids].to(device=device, dtype=dtype)


def poison(tensor):
    tensor.view(torch.uint8).fill_(0x7F)
    return tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_gather_matches_reference(shape, streaming, dtype, device):
    pool = make_pool(shape, dtype, device)
    ids = make_ids(shape[1], shape[5], device)
    pool_before = pool.clone()
    out = poison(torch.empty((shape[5], shape[0], 2, *pool.shape[3:]), dtype=dtype, device=device))
    gather_kv_blocks(pool, ids, out, tile_numel=256, streaming=streaming)
    ref = gather_kv_blocks_ref(pool, ids)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(pool.view(torch.uint8), pool_before.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_scatter_matches_reference(shape, streaming, dtype, device):
    pool = make_pool(shape, dtype, device)
    ids = make_ids(shape[1], shape[5], device, torch.int64)
    src = torch.randn((shape[5], shape[0], 2, *pool.shape[3:]), device=device).to(dtype)
    ref = scatter_kv_blocks_ref(pool, ids, src)
    scatter_kv_blocks(pool, ids, src, tile_numel=128, streaming=streaming)
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))


def test_round_trip_through_buffer_restores_blocks(device):
    pool = make_pool((2, 12, 4, 2, 16, 4), torch.bfloat16, device)
    ids = make_ids(12, 4, device)
    saved = gather_kv_blocks(pool, ids)
    original = pool.clone()
    pool[:, :, ids.long()] = 0
    scatter_kv_blocks(pool, ids, saved)
    assert torch.equal(pool, original)


def test_empty_id_list_is_a_no_op(device):
    pool = make_pool((1, 4, 2, 1, 16, 0), torch.float16, device)
    ids = torch.empty(0, dtype=torch.int32, device=device)
    assert gather_kv_blocks(pool, ids).shape == (0, 1, 2, 2, 1, 16)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p, i, b: (p[0], i, b), "dimensions"),
        (lambda p, i, b: (p, i.float(), b), "dtype"),
        (lambda p, i, b: (p, i, b[:1]), "shape"),
        (lambda p, i, b: (p, i, b.float()), "dtype"),
        (lambda p, i, b: (p.transpose(3, 4), i, b), "contiguous"),
        (lambda p, i, b: (p, i + 100, b), "block_ids must lie"),
    ],
)
def test_launcher_rejects_bad_arguments(mutate, message, device):
    if device != "cpu" and message == "block_ids must lie":
        pytest.skip("block id ranges are checked only for CPU ids (no device sync)")
    pool = make_pool((2, 8, 4, 2, 16, 2), torch.bfloat16, device)
    ids = make_ids(8, 2, device)
    buf = torch.empty((2, 2, 2, 4, 2, 16), dtype=torch.bfloat16, device=device)
    p, i, b = mutate(pool, ids, buf)
    with pytest.raises(ValueError, match=message):
        gather_kv_blocks(p, i, b)


def test_gather_and_scatter_through_a_second_block_pool(device):
    """The CPU tier's layout: the buffer is a pool of its own, addressed by its own block ids."""
    pool = make_pool((2, 10, 4, 2, 16, 3), torch.bfloat16, device)
    ids = make_ids(10, 3, device)
    tier_ids = torch.tensor([6, 0, 3], dtype=torch.int64, device=device)
    tier = poison(torch.empty((7, 2, 2, 4, 2, 16), dtype=torch.bfloat16, device=device))
    gather_kv_blocks(pool, ids, tier, out_block_ids=tier_ids)
    assert torch.equal(tier[tier_ids], gather_kv_blocks_ref(pool, ids))
    other = make_ids(10, 3, device)
    ref = scatter_kv_blocks_ref(pool, other, tier[tier_ids])
    scatter_kv_blocks(pool, other, tier, src_block_ids=tier_ids)
    assert torch.equal(pool, ref)
