"""The model on a GPU through the Triton kernels: cached and CPU-restored prefixes equal scratch, greedy is stable."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from workers.model.config import ModelConfig  # noqa: E402
from workers.model.kv_pool import KVTransfer, allocate_cpu_pool  # noqa: E402
from workers.model.llama import LlamaModel, PagedBatch, SeqSlice  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SMALL = ModelConfig(
    vocab_size=4096, hidden_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_size=128, intermediate_size=1024
)
BLOCK_SIZE = 16
ATOL, RTOL = 1.5e-2, 2e-2


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(SMALL, seed=3, device=torch.device("cuda"), dtype=torch.bfloat16)


def run(model, pool, tokens, blocks, start, attention="triton"):
    batch = PagedBatch.build(
        [SeqSlice(blocks, start, tokens.shape[0] - start)], block_size=BLOCK_SIZE, device=model.device
    )
    return model.forward(tokens[start:].cuda(), batch, pool, attention=attention)


def prompt(n):
    return torch.randint(0, SMALL.vocab_size, (n,), generator=torch.Generator().manual_seed(n))


def test_triton_attention_matches_torch_reference_and_sdpa(model):
    tokens = prompt(300)
    blocks = tuple(range(19))
    ref = run(model, model.allocate_kv_pool(32, BLOCK_SIZE), tokens, blocks, 0, "torch")
    sdpa = run(model, model.allocate_kv_pool(32, BLOCK_SIZE), tokens, blocks, 0, "sdpa")
    tri = run(model, model.allocate_kv_pool(32, BLOCK_SIZE), tokens, blocks, 0, "triton")
    torch.testing.assert_close(tri, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(sdpa, ref, atol=ATOL, rtol=RTOL)


def test_cached_and_restored_prefix_match_scratch(model):
    tokens = prompt(517)
    n_blocks = -(-517 // BLOCK_SIZE)
    scratch = run(model, model.allocate_kv_pool(80, BLOCK_SIZE), tokens, tuple(range(n_blocks)), 0)
    pool = model.allocate_kv_pool(80, BLOCK_SIZE)
    blocks = tuple(torch.randperm(80)[:n_blocks].tolist())
    run(model, pool, tokens[:512], blocks[:32], 0)
    cached = run(model, pool, tokens, blocks, 512)
    torch.testing.assert_close(cached, scratch, atol=ATOL, rtol=RTOL)
    cpu_pool = allocate_cpu_pool(pool, 40)
    assert cpu_pool.is_pinned()
    transfer = KVTransfer(pool)
    cpu_ids = list(range(39, 7, -1))
    torch.cuda.current_stream().wait_event(transfer.offload(blocks[:32], cpu_pool, cpu_ids))
    pool.normal_()
    new_blocks = tuple(torch.randperm(80)[:n_blocks].tolist())
    torch.cuda.current_stream().wait_event(transfer.restore(new_blocks[:32], cpu_pool, cpu_ids))
    restored = run(model, pool, tokens, new_blocks, 512)
    torch.testing.assert_close(restored, scratch, atol=ATOL, rtol=RTOL)


def test_greedy_decode_is_deterministic(model):
    def greedy():
        pool = model.allocate_kv_pool(16, BLOCK_SIZE)
        blocks = tuple(range(16))
        tokens = prompt(40).tolist()
        logits = run(model, pool, torch.tensor(tokens), blocks, 0)
        for _ in range(8):
            tokens.append(int(logits[-1].argmax()))
            logits = run(model, pool, torch.tensor(tokens), blocks, len(tokens) - 1)
        return tokens

    assert greedy() == greedy()


@pytest.mark.parametrize("mode", ["auto", "direct", "staged"])
def test_transfer_modes_copy_arbitrary_host_ids(model, mode):
    pool = model.allocate_kv_pool(64, BLOCK_SIZE)
    pool.normal_()
    cpu_pool = allocate_cpu_pool(pool, 48)
    cpu_pool.view(torch.uint8).fill_(0x7F)
    transfer = KVTransfer(pool, mode=mode, chunk_blocks=5, copy_streams=3)  # runs cross chunk boundaries
    gpu_ids = torch.randperm(64)[:23].tolist()
    cpu_ids = [40, 41, 42, 43, 44, 45, 46, 3, 9, 10, 11, 0, 1, 2, 30, 29, 28, 12, 13, 14, 15, 16, 47]
    torch.cuda.current_stream().wait_event(transfer.offload(gpu_ids, cpu_pool, cpu_ids))
    torch.cuda.synchronize()
    expected = pool[:, :, gpu_ids].permute(2, 0, 1, 3, 4, 5).cpu()
    assert torch.equal(cpu_pool[cpu_ids], expected)
    new_ids = torch.randperm(64)[:23].tolist()
    before = pool.clone()
    pool[:, :, new_ids] = float("nan")
    torch.cuda.current_stream().wait_event(transfer.restore(new_ids, cpu_pool, torch.tensor(cpu_ids)))
    torch.cuda.synchronize()
    assert torch.equal(pool[:, :, new_ids].permute(2, 0, 1, 3, 4, 5).cpu(), expected)
    untouched = [i for i in range(64) if i not in new_ids]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])
