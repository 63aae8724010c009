"""The Llama-shaped model on the CPU (tiny config): determinism, and cached or restored prefixes equal scratch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")

from workers.model.config import TINY  # noqa: E402
from workers.model.kv_pool import KVTransfer, allocate_cpu_pool  # noqa: E402
from workers.model.llama import LlamaModel, PagedBatch, SeqSlice  # noqa: E402

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
# float32: caching changes only the order of the sums, not the inputs, so the logits (std ~0.15) agree to ~1e-6.
# In bfloat16 the same reordering moves a logit by a rounding step (2**-8 relative), and which CPU kernels torch
# picks (AVX-512 BF16 or not) decides how many steps: a bf16 tolerance passes on one host and fails on another.
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture
def model():
    return LlamaModel.random(TINY, seed=7, device=torch.device("cpu"), dtype=torch.float32)


def make_prompt(num_tokens, seed=3):
    return torch.randint(0, TINY.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))


def run(model, pool, tokens, block_ids, start_pos):
    batch = PagedBatch.build(
        [SeqSlice(block_ids, start_pos, tokens.shape[0] - start_pos)], block_size=BLOCK_SIZE, device=model.device
    )
    return model.forward(tokens[start_pos:], batch, pool, attention="torch")


def greedy(model, prompt, num_new_tokens):
    pool = model.allocate_kv_pool(16, BLOCK_SIZE)
    blocks = tuple(range(16))
    logits = run(model, pool, prompt, blocks, 0)
    tokens = prompt.tolist()
    for _ in range(num_new_tokens):
        tokens.append(int(logits[-1].argmax()))
        batch = PagedBatch.build([SeqSlice(blocks, len(tokens) - 1, 1)], block_size=BLOCK_SIZE, device=model.device)
        logits = model.forward(torch.tensor(tokens[-1:]), batch, pool, attention="torch")
    return tokens[prompt.shape[0] :]


def test_greedy_generation_is_deterministic(model):
    prompt = make_prompt(11)
    first = greedy(model, prompt, 6)
    again = greedy(LlamaModel.random(TINY, seed=7, device=torch.device("cpu"), dtype=torch.float32), prompt, 6)
    assert first == again
    assert len(first) == 6


def test_decode_step_matches_prefill_of_the_longer_prompt(model):
    prompt = make_prompt(13)
    pool = model.allocate_kv_pool(8, BLOCK_SIZE)
    blocks = tuple(range(8))
    run(model, pool, prompt[:12], blocks, 0)
    decoded = run(model, pool, prompt, blocks, 12)
    scratch = run(model, model.allocate_kv_pool(8, BLOCK_SIZE), prompt, blocks, 0)
    torch.testing.assert_close(decoded, scratch, atol=ATOL, rtol=RTOL)


def test_prompt_from_cached_gpu_blocks_matches_scratch(model):
    prompt = make_prompt(22)
    scratch = run(model, model.allocate_kv_pool(12, BLOCK_SIZE), prompt, (3, 1, 4, 0, 5, 9), 0)
    pool = model.allocate_kv_pool(12, BLOCK_SIZE)
    blocks = (7, 2, 11, 6, 8, 10)
    run(model, pool, prompt[:16], blocks[:4], 0)  # an earlier request left 4 full blocks cached
    cached = run(model, pool, prompt, blocks, 16)
    torch.testing.assert_close(cached, scratch, atol=ATOL, rtol=RTOL)


def test_prompt_from_blocks_restored_from_cpu_matches_scratch(model):
    prompt = make_prompt(22)
    scratch = run(model, model.allocate_kv_pool(12, BLOCK_SIZE), prompt, tuple(range(6)), 0)
    pool = model.allocate_kv_pool(12, BLOCK_SIZE)
    run(model, pool, prompt[:16], (0, 1, 2, 3), 0)
    cpu_pool = allocate_cpu_pool(pool, num_blocks=10)
    transfer = KVTransfer(pool)
    transfer.offload([0, 1, 2, 3], cpu_pool, [9, 4, 5, 0])
    pool.normal_()  # the GPU copies are gone (evicted and overwritten)
    transfer.restore([6, 2, 10, 11], cpu_pool, [9, 4, 5, 0])
    restored = run(model, pool, prompt, (6, 2, 10, 11, 3, 4), 16)
    torch.testing.assert_close(restored, scratch, atol=ATOL, rtol=RTOL)
    # Control: the same step over blocks that were not restored is visibly wrong.
    wrong = run(model, pool, prompt, (1, 5, 7, 8, 3, 4), 16)
    assert (wrong - scratch).abs().max() > 10 * ATOL


def test_batch_rejects_short_block_tables():
    with pytest.raises(ValueError, match="cannot hold"):
        PagedBatch.build([SeqSlice((0,), 0, 5)], block_size=BLOCK_SIZE, device=torch.device("cpu"))


def test_host_runs_group_consecutive_ids_and_split_at_chunks():
    from workers.model.kv_pool import _host_runs, _Run, _split_runs

    runs = _host_runs([5, 6, 7, 2, 9, 10, 3], 7)
    assert runs == [_Run(0, 5, 3), _Run(3, 2, 1), _Run(4, 9, 2), _Run(6, 3, 1)]
    assert _host_runs(None, 4) == [_Run(0, 0, 4)]
    assert _host_runs(torch.tensor([4, 5]), 2) == [_Run(0, 4, 2)]
    assert _split_runs(runs, 2) == [
        (0, [_Run(0, 5, 2)]),
        (2, [_Run(2, 7, 1), _Run(3, 2, 1)]),
        (4, [_Run(4, 9, 2)]),
        (6, [_Run(6, 3, 1)]),
    ]
    with pytest.raises(ValueError, match="host block ids for"):
        _host_runs([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        _host_runs([1, -2], 2)


def test_transfer_rejects_unknown_mode(model):
    with pytest.raises(ValueError, match="mode must be one of"):
        KVTransfer(model.allocate_kv_pool(4, BLOCK_SIZE), mode="fast")  # type: ignore[arg-type]


def test_auto_restore_stages_only_long_runs(model):
    from workers.model.kv_pool import STAGED_MIN_RUN_BYTES, _Run

    pool = model.allocate_kv_pool(4, BLOCK_SIZE)
    transfer = KVTransfer(pool)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    long_run = -(-STAGED_MIN_RUN_BYTES // block_bytes)
    assert transfer._runs_are_long([_Run(0, 0, long_run)])
    assert not transfer._runs_are_long([_Run(0, 0, long_run), _Run(long_run, 0, 1)])
    assert not transfer._runs_are_long([])
