"""KV manager: exact block ids, free-queue order, events, cached-token rule, CPU tier store rules, restores."""

from __future__ import annotations

from typing import Literal

import pytest

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from workers.config import KVCacheConfig
from workers.kv.hashing import extend_block_hashes, hash_block, namespace_root, to_engine_hash
from workers.kv.manager import KVCacheManager, SequenceKV

pytestmark = pytest.mark.unit

BS = 4


def make_manager(
    num_gpu_blocks: int = 8, num_cpu_blocks: int = 0, policy: Literal["all", "prompt_only", "none"] = "all"
) -> KVCacheManager:
    return KVCacheManager(
        KVCacheConfig(
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, block_size=BS, cpu_store_policy=policy
        )
    )


def run_prefill(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> tuple[SequenceKV, int]:
    """Admit and fully compute a prompt; returns the sequence and its cached tokens."""
    seq = SequenceKV(rid, cache_salt=salt)
    hit = kv.find_prefix(seq, tokens, len(tokens))
    assert kv.admit(seq, hit, len(tokens))
    kv.cache_computed(seq, tokens, len(tokens), len(tokens))
    return seq, hit.num_cached_tokens


def eh(tokens: list[int], salt: str | None = None) -> list[int]:
    return [to_engine_hash(h) for h in extend_block_hashes([], namespace_root(None, salt), tokens, BS)]


def test_hash_chain_recomputes_and_namespaces_differ():
    root = namespace_root()
    h0 = hash_block(root, [1, 2, 3, 4])
    assert extend_block_hashes([], root, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == [h0, hash_block(h0, [5, 6, 7, 8])]
    assert len(h0) == 32
    assert hash_block(namespace_root(None, "salt"), [1, 2, 3, 4]) != h0
    assert hash_block(namespace_root("lora-a"), [1, 2, 3, 4]) != h0


def test_block_ids_free_queue_order_and_events():
    kv = make_manager(num_gpu_blocks=6)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    seq, cached = run_prefill(kv, "a", prompt)
    assert cached == 0
    assert seq.block_ids == [0, 1, 2]
    assert kv.gpu.get_all_free_block_ids() == [3, 4, 5]
    h = eh(prompt)
    assert kv.take_events() == [
        BlockStored(block_hashes=(h[0], h[1]), parent_block_hash=None, token_ids=tuple(range(8)), block_size=BS)
    ]
    kv.free(seq)
    # freed tail first: 2 (partial), 1, 0 go to the back in that order
    assert kv.gpu.get_all_free_block_ids() == [3, 4, 5, 2, 1, 0]
    # same prompt again: both full blocks hit, ref taken from the free queue
    seq2, cached2 = run_prefill(kv, "b", prompt)
    assert cached2 == 8
    assert seq2.block_ids == [0, 1, 3]
    assert [kv.gpu.blocks[b].ref_cnt for b in (0, 1, 3)] == [1, 1, 1]
    assert kv.gpu.get_all_free_block_ids() == [4, 5, 2]
    assert kv.take_events() == []
    kv.free(seq2)
    assert kv.gpu.get_all_free_block_ids() == [4, 5, 2, 3, 1, 0]
    # a 6-block prompt evicts the LRU blocks in order: 4, 5, 2, 3, then cached 1 and 0
    other = [100 + i for i in range(24)]
    seq3, _ = run_prefill(kv, "c", other)
    assert seq3.block_ids == [4, 5, 2, 3, 1, 0]
    events = kv.take_events()
    assert events[:2] == [BlockRemoved(block_hashes=(h[1],)), BlockRemoved(block_hashes=(h[0],))]
    stored = events[2]
    assert isinstance(stored, BlockStored) and stored.block_hashes == tuple(eh(other))
    assert kv.gpu.num_evicted_blocks == 2


@pytest.mark.parametrize(
    ("prompt_len", "expected"),
    [(8, 4), (9, 8), (12, 8), (13, 12), (3, 0)],
)
def test_cached_tokens_follow_vllm_last_token_rule(prompt_len, expected):
    kv = make_manager(num_gpu_blocks=16)
    tokens = list(range(prompt_len))
    seq, _ = run_prefill(kv, "warm", tokens + [999] * 8)
    kv.free(seq)
    _, cached = run_prefill(kv, "probe", tokens)
    assert cached == expected


def test_shared_prefix_refcounts_one_request_never_frees_another():
    kv = make_manager(num_gpu_blocks=8)
    a, _ = run_prefill(kv, "a", list(range(9)))
    b, cached = run_prefill(kv, "b", list(range(8)) + [50])
    assert cached == 8
    assert a.block_ids[:2] == b.block_ids[:2] == [0, 1]
    assert kv.gpu.blocks[0].ref_cnt == 2
    kv.free(b)
    kv.free(b)  # idempotent: a's references untouched
    assert kv.gpu.blocks[0].ref_cnt == 1 and kv.gpu.blocks[1].ref_cnt == 1
    assert 0 not in kv.gpu.get_all_free_block_ids()


def test_salt_isolates_and_event_carries_extra_keys():
    kv = make_manager(num_gpu_blocks=8)
    s, _ = run_prefill(kv, "a", list(range(5)), salt="tenant-1")
    (ev,) = kv.take_events()
    assert isinstance(ev, BlockStored) and ev.extra_keys == (("tenant-1",),)
    assert ev.block_hashes == tuple(eh(list(range(5)), "tenant-1"))
    kv.free(s)
    _, cached = run_prefill(kv, "b", list(range(5)))
    assert cached == 0


def test_admit_is_all_or_nothing():
    kv = make_manager(num_gpu_blocks=3)
    a, _ = run_prefill(kv, "a", list(range(8)))  # 2 blocks
    seq = SequenceKV("b")
    hit = kv.find_prefix(seq, list(range(20)), 20)
    assert hit.num_blocks == 2
    assert not kv.admit(seq, hit, 20)  # needs 3 more, 1 free
    assert seq.block_ids == [] and kv.gpu.blocks[0].ref_cnt == 1 and kv.gpu.num_free_blocks == 1


def test_cpu_write_through_store_rules_and_events():
    kv = make_manager(num_gpu_blocks=8, num_cpu_blocks=3)
    prompt = list(range(8))
    a, _ = run_prefill(kv, "a", prompt)
    stores, restores = kv.take_copies()
    assert restores == () and len(stores) == 1
    assert stores[0].src_block_ids == (0, 1) and stores[0].dst_block_ids == (0, 1)
    # rule 1: an identical store in flight is skipped (duplicate blocks computed by another request)
    b = SequenceKV("b")
    b.block_ids = kv.gpu.allocate(2)
    kv.cache_computed(b, prompt, 8, 8)
    assert kv.take_copies() == ((), ())
    assert kv.cpu is not None and kv.cpu.num_stores_skipped_in_flight == 2
    # rule 3: the GPU copies are evicted before the store lands; the store still completes
    kv.free(a)
    kv.free(b)
    kv.reset_prefix_cache()
    kv.take_events()
    kv.complete_store(stores[0].job_id)
    h = eh(prompt)
    assert kv.take_events() == [
        BlockStored(
            block_hashes=(h[0], h[1]), parent_block_hash=None, token_ids=tuple(prompt), block_size=BS, medium=Medium.CPU
        )
    ]
    # rule 2: blocks already stored are not stored again
    c, cached = run_prefill(kv, "c", prompt + [8])  # CPU hit of 2 blocks -> restore
    assert cached == 8
    assert kv.cpu.num_stores_skipped_stored == 0
    (restore,) = kv.take_copies()[1]
    kv.complete_restore(restore.job_id)
    kv.take_events()
    e = SequenceKV("e")
    e.block_ids = kv.gpu.allocate(2)
    e.num_cached_blocks = 0
    kv.cache_computed(e, prompt, 8, 8)  # GPU duplicate of prompt blocks: already stored on CPU
    assert kv.cpu.num_stores_skipped_stored == 2
    assert kv.take_copies() == ((), ())


def test_cpu_restore_then_next_turn_served_from_gpu():
    kv = make_manager(num_gpu_blocks=5, num_cpu_blocks=16)
    prompt = list(range(12))  # 3 blocks
    a, _ = run_prefill(kv, "a", prompt)
    (store,), _ = kv.take_copies()
    kv.complete_store(store.job_id)
    kv.free(a)
    # evict the prompt from GPU with other traffic
    x, _ = run_prefill(kv, "x", [500 + i for i in range(20)])
    kv.free(x)
    assert all(kv.gpu.get_cached_block(h) is None for h in a.block_hashes[:3])
    stores, _ = kv.take_copies()
    for s in stores:
        kv.complete_store(s.job_id)
    kv.take_events()
    # turn 2: prompt + 4 tokens: 3 blocks continue on CPU
    turn2 = prompt + [1, 2, 3, 4, 5]
    seq = SequenceKV("t2")
    hit = kv.find_prefix(seq, turn2, len(turn2))
    assert (hit.gpu_block_ids, hit.num_cpu_blocks, hit.num_cached_tokens) == ((), 3, 12)
    assert kv.admit(seq, hit, len(turn2))
    _, (restore,) = kv.take_copies()
    assert restore.dst_block_ids == tuple(seq.block_ids[:3])
    assert kv.cpu is not None and kv.cpu.pin_count(seq.block_hashes[0]) == 1
    # allocation evicted x's blocks (tail first); nothing is registered on GPU before the copy lands
    assert kv.take_events() == [BlockRemoved(block_hashes=(to_engine_hash(h),)) for h in reversed(x.block_hashes)]
    kv.complete_restore(restore.job_id)
    ev = kv.take_events()[-1]
    assert isinstance(ev, BlockStored) and ev.medium == Medium.GPU
    assert ev.block_hashes == tuple(eh(prompt)) and ev.token_ids == tuple(prompt)
    kv.cache_computed(seq, turn2, len(turn2), len(turn2))
    kv.free(seq)
    kv.take_copies()
    # turn 3: served from GPU, no restore
    seq3 = SequenceKV("t3")
    hit3 = kv.find_prefix(seq3, turn2 + [9], len(turn2) + 1)
    assert hit3.num_cpu_blocks == 0 and len(hit3.gpu_block_ids) == 4


def test_free_during_restore_keeps_blocks_until_copy_lands():
    kv = make_manager(num_gpu_blocks=4, num_cpu_blocks=4)
    a, _ = run_prefill(kv, "a", list(range(8)))
    (store,), _ = kv.take_copies()
    kv.complete_store(store.job_id)
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    a2, _ = run_prefill(kv, "a2", list(range(8)))
    (store2,), _ = kv.take_copies()
    kv.complete_store(store2.job_id)
    kv.free(a2)
    kv.gpu.reset()
    seq = SequenceKV("r")
    hit = kv.find_prefix(seq, list(range(9)), 9)
    assert hit.num_cpu_blocks == 2
    assert kv.admit(seq, hit, 9)
    _, (restore,) = kv.take_copies()
    kv.free(seq)
    assert kv.gpu.num_free_blocks == 1  # three blocks still held by the in-flight restore
    assert kv.cpu is not None and kv.cpu.pin_count(seq.block_hashes[0]) == 1
    kv.complete_restore(restore.job_id)
    assert kv.gpu.num_free_blocks == 4
    assert kv.cpu.pin_count(seq.block_hashes[0]) == 0


def test_reset_refused_while_in_use_then_clears_all_tiers():
    kv = make_manager(num_gpu_blocks=4, num_cpu_blocks=4)
    a, _ = run_prefill(kv, "a", list(range(8)))
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    kv.take_events()
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.gpu.num_cached_blocks == 0


def test_cpu_tier_evicts_lru_unpinned():
    kv = make_manager(num_gpu_blocks=8, num_cpu_blocks=2)
    a, _ = run_prefill(kv, "a", list(range(8)))
    (s1,), _ = kv.take_copies()
    kv.complete_store(s1.job_id)
    kv.take_events()
    b, _ = run_prefill(kv, "b", [50 + i for i in range(4)])
    (s2,), _ = kv.take_copies()
    hb = eh([50 + i for i in range(4)])
    # slot came from evicting the least recently used block (a's block 0)
    assert kv.take_events()[-1] == BlockRemoved(block_hashes=(eh(list(range(8)))[0],), medium=Medium.CPU)
    kv.complete_store(s2.job_id)
    assert kv.cpu is not None and kv.cpu.lru_order() == [a.block_hashes[1], b.block_hashes[0]]
    assert to_engine_hash(b.block_hashes[0]) == hb[0]


def test_snapshot_reproduces_cache():
    kv = make_manager(num_gpu_blocks=8)
    a, _ = run_prefill(kv, "a", list(range(12)))
    b, _ = run_prefill(kv, "b", list(range(8)) + [70, 71, 72, 73, 74])
    snap = kv.snapshot_events()
    assert snap[0] == AllBlocksCleared()
    hashes = [h for ev in snap[1:] if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert sorted(hashes) == sorted({to_engine_hash(h) for h in a.block_hashes + b.block_hashes})
    first = snap[1]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
