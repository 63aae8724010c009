"""CPU tier slot allocation: exact slots of fresh and evicting pools, free runs, and runs of a restored prefix."""

from __future__ import annotations

import pytest

from events.types import BlockRemoved, Medium
from workers.config import KVCacheConfig
from workers.kv.cpu_tier import FreeRuns
from workers.kv.hashing import to_engine_hash
from workers.kv.manager import KVCacheManager, SequenceKV

pytestmark = pytest.mark.unit

BS = 4


def make_manager(num_gpu_blocks: int = 32, num_cpu_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, block_size=BS))


def prefill_and_store(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[SequenceKV, tuple[int, ...]]:
    """Admit and compute a prompt, land its store; returns the sequence and the CPU slots of its store job."""
    seq = SequenceKV(rid)
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    stores, _ = kv.take_copies()
    slots: tuple[int, ...] = ()
    for store in stores:
        kv.complete_store(store.job_id)
        slots += store.dst_block_ids
    return seq, slots


def tokens(first: int, num_blocks: int) -> list[int]:
    return list(range(first, first + num_blocks * BS))


def test_free_runs_best_fit_longest_first_and_merging():
    runs = FreeRuns(10)
    assert runs.runs() == [(0, 10)]
    assert runs.take(3) == [0, 1, 2]
    assert runs.take(4) == [3, 4, 5, 6]
    assert runs.runs() == [(7, 3)] and runs.num_free == 3
    runs.add([0, 1, 4, 5])  # 0-1 and 4-5 free again; 4-5 is not adjacent to 7
    assert runs.runs() == [(0, 2), (4, 2), (7, 3)] and runs.num_free == 7
    assert runs.take(2) == [0, 1]  # best fit: the lowest of the length-2 runs, not a cut of 7-9
    assert runs.take(4) == [4, 7, 8, 9]  # no run covers 4: the longest (7-9), then 4-5 cut to one slot
    assert runs.runs() == [(5, 1)] and runs.num_free == 1
    runs.add([0, 1, 2, 3, 4, 6, 7, 8, 9])
    assert runs.runs() == [(0, 10)]  # merged with both neighbours of 5
    assert runs.take(20) == list(range(10)) and runs.num_free == 0 and runs.take(1) == []


def test_fresh_pool_gives_each_job_one_run():
    kv = make_manager(num_cpu_blocks=16)
    _, a = prefill_and_store(kv, "a", tokens(0, 3))
    _, b = prefill_and_store(kv, "b", tokens(100, 5))
    _, c = prefill_and_store(kv, "c", tokens(200, 2))
    assert (a, b, c) == ((0, 1, 2), (3, 4, 5, 6, 7), (8, 9))
    assert kv.cpu is not None and kv.cpu.free_runs() == [(10, 6)]


def test_evicting_pool_gives_free_slots_and_lru_victims_ascending():
    kv = make_manager(num_cpu_blocks=8)
    a, sa = prefill_and_store(kv, "a", tokens(0, 3))
    b, sb = prefill_and_store(kv, "b", tokens(100, 4))
    assert (sa, sb) == ((0, 1, 2), (3, 4, 5, 6))
    kv.take_events()
    # c needs 3: the one free slot (7), then the 2 least recently used blocks (a0, a1 in slots 0, 1)
    c, sc = prefill_and_store(kv, "c", tokens(200, 3))
    assert sc == (0, 1, 7)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved) and e.medium is Medium.CPU]
    assert removed == [
        BlockRemoved(block_hashes=tuple(to_engine_hash(h) for h in a.block_hashes[:2]), medium=Medium.CPU)
    ]
    # a restore touches b's blocks (most recently used); d's 4 slots then come from a2, c0, c1, c2: LRU order
    # unchanged, slots handed out ascending
    assert kv.cpu is not None
    assert kv.cpu.pin(b.block_hashes[:4]) == [3, 4, 5, 6]
    kv.cpu.unpin(b.block_hashes[:4])
    assert kv.cpu.lru_order() == [a.block_hashes[2], *c.block_hashes[:3], *b.block_hashes[:4]]
    _, sd = prefill_and_store(kv, "d", tokens(300, 4))
    assert sd == (0, 1, 2, 7)
    assert kv.cpu.free_runs() == []


def test_reset_returns_unpinned_slots_as_runs():
    kv = make_manager(num_cpu_blocks=8)
    a, _ = prefill_and_store(kv, "a", tokens(0, 3))
    b, _ = prefill_and_store(kv, "b", tokens(100, 4))
    assert kv.cpu is not None
    kv.cpu.pin(b.block_hashes[1:2])  # slot 4 stays
    kv.free(a)
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.cpu.free_runs() == [(0, 4), (5, 3)]
    _, s = prefill_and_store(kv, "c", tokens(200, 3))
    assert s == (5, 6, 7)  # best fit: the run of 3, not a cut of 0-3


def test_restored_prefix_reads_long_runs_for_the_staged_restore():
    torch = pytest.importorskip("torch")
    from workers.model.kv_pool import STAGED_MIN_RUN_BYTES, _host_runs

    # the CPU tier turns over (three 100-block prompts through 256 slots), then a 128-block prompt is computed
    # in 4 chunks (4 store jobs) whose slots come from evicting the oldest blocks
    kv = make_manager(num_gpu_blocks=1024, num_cpu_blocks=256)
    for i in range(3):
        seq, _ = prefill_and_store(kv, f"old{i}", tokens(10_000 * (i + 1), 100))
        kv.free(seq)
    prompt = tokens(0, 128)
    seq = SequenceKV("p")
    assert kv.admit(seq, kv.find_prefix(seq, prompt, len(prompt)), len(prompt))
    for end in range(128, 513, 128):
        kv.cache_computed(seq, prompt, end, len(prompt))
    stores = kv.take_copies()[0]
    assert len(stores) == 4
    for store in stores:
        kv.complete_store(store.job_id)
    kv.free(seq)
    assert kv.gpu.reset()  # the prompt leaves the GPU: the next turn restores it from CPU
    turn2 = SequenceKV("t2")
    hit = kv.find_prefix(turn2, [*prompt, 1], len(prompt) + 1)
    assert hit.num_cpu_blocks == 128
    assert kv.admit(turn2, hit, len(prompt) + 1)
    (restore,) = kv.take_copies()[1]
    runs = _host_runs(restore.src_block_ids, len(restore.src_block_ids))
    assert runs is not None and [(r.host_start, r.length) for r in runs] == [(44, 128)]  # one run: 44 .. 171
    # at Llama-3-8B shape (2 MiB blocks) the mean run is far above the staged threshold (8 MiB)
    llama_8b_block_bytes = 32 * 2 * 16 * 8 * 128 * torch.tensor([], dtype=torch.bfloat16).element_size()
    assert 128 * llama_8b_block_bytes / len(runs) >= STAGED_MIN_RUN_BYTES
