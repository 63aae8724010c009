"""The jump search of ``match`` (binary search over positions for slots without gaps) against the linear walk.

Random fleets with branching chains, mid-chain removals (gaps), approximate inserts and expiry, pruning and
clears; after every step the gap counts are recomputed from scratch (``check_invariants``) and every query's GPU
depths are compared with a walk over every position (``prefix_depths``).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.types import BlockRemoved, BlockStored, EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex
from router.index.match import iter_bits, jump_depths, prefix_depths

pytestmark = pytest.mark.unit

BLOCK_SIZE = 2


def linear_gpu_depths(index: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """Best GPU depth per worker by reading every position (the reference)."""
    depths, _ = prefix_depths(map(index.holder_mask, hashes))
    best: dict[str, int] = {}
    for bit, depth in depths.items():
        worker = index.state.slots_by_bit[bit].worker_id
        best[worker] = max(best.get(worker, 0), depth)
    return best


def match_gpu_depths(index: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    return {w: m.num_gpu_blocks for w, m in index.match(hashes).workers.items() if m.num_gpu_blocks}


@settings(max_examples=200, deadline=None)
@given(depths=st.lists(st.integers(1, 300), min_size=1, max_size=70), num_blocks=st.integers(1, 300))
def test_jump_depths_agrees_with_walk_on_monotone_masks(depths: list[int], num_blocks: int) -> None:
    masks = [sum(1 << bit for bit, depth in enumerate(depths) if depth > pos) for pos in range(num_blocks)]
    hashes = list(range(num_blocks))
    held_at_root = masks[0]
    expected, _ = prefix_depths(masks)
    ids = {h: h + 1 for h in hashes}  # id 0 is the null id
    assert jump_depths(ids.get, [0, *masks], hashes, held_at_root) == expected
    assert set(expected) == set(iter_bits(held_at_root))


def chain_tokens(rng: random.Random, trunks: list[list[int]]) -> list[int]:
    """A conversation: a prefix of a trunk, then fresh tokens."""
    trunk = rng.choice(trunks)
    cut = rng.randrange(0, len(trunk) // BLOCK_SIZE + 1) * BLOCK_SIZE
    return trunk[:cut] + [rng.randrange(1000) for _ in range(BLOCK_SIZE * rng.randrange(1, 40))]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_workers", [5, 70])
def test_match_agrees_with_linear_walk_on_random_fleets(seed: int, num_workers: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE, max_blocks=3000, approx_max_blocks=400))
    trunks = [[rng.randrange(1000) for _ in range(BLOCK_SIZE * 60)] for _ in range(4)]
    stored: dict[str, list[list[int]]] = {f"w{i}": [] for i in range(num_workers)}
    queries: list[list[int]] = []
    num_jump_answers = 0
    now_s = 0.0
    for step in range(250):
        worker = f"w{rng.randrange(num_workers)}"
        roll = rng.random()
        if roll < 0.55:
            tokens = chain_tokens(rng, trunks)
            hashes = hash_token_blocks(tokens, BLOCK_SIZE)
            engine = [h ^ 0x5A5A for h in hashes]  # a stand-in engine hash, the same on every worker
            # Store turn by turn, chained by engine hash; sometimes a turn goes to CPU only (a GPU gap after it).
            start = 0
            while start < len(hashes):
                end = min(len(hashes), start + rng.randrange(1, 12))
                medium = Medium.CPU if rng.random() < 0.05 else Medium.GPU
                event = BlockStored(
                    block_hashes=tuple(engine[start:end]),
                    parent_block_hash=engine[start - 1] if start else None,
                    token_ids=tuple(tokens[start * BLOCK_SIZE : end * BLOCK_SIZE]),
                    block_size=BLOCK_SIZE,
                    medium=medium,
                )
                index.apply(EventBatch(worker, 0, step, 0.0, (event,)))
                start = end
            stored[worker].append(tokens)
            queries.append(tokens)
        elif roll < 0.75 and stored[worker]:
            tokens = rng.choice(stored[worker])
            hashes = hash_token_blocks(tokens, BLOCK_SIZE)
            picks = rng.sample(range(len(hashes)), k=min(len(hashes), rng.randrange(1, 4)))
            event = BlockRemoved(tuple(hashes[i] ^ 0x5A5A for i in picks), medium=Medium.GPU)
            index.apply(EventBatch(worker, 0, step, 0.0, (event,)))
        elif roll < 0.9 and queries:
            now_s += 1.0
            index.insert_approximate(worker, hash_token_blocks(rng.choice(queries), BLOCK_SIZE), now_s, ttl_s=20.0)
        elif roll < 0.95:
            now_s += 5.0
            index.expire(now_s)
        elif stored[worker]:
            index.clear_worker(worker, rng.choice([None, Medium.GPU, Medium.CPU]))
        index.check_invariants()
        for tokens in rng.sample(queries, k=min(len(queries), 4)):
            hashes = hash_token_blocks(tokens, BLOCK_SIZE)
            assert match_gpu_depths(index, hashes) == linear_gpu_depths(index, hashes), step
            first = index.holder_mask(hashes[0])
            num_jump_answers += bool(first & ~index.state.dirty_mask)
    assert num_jump_answers > 0


def store(index: PrefixIndex, worker: str, tokens: list[int], start: int, end: int) -> None:
    engine = [h ^ 0x5A5A for h in hash_token_blocks(tokens, BLOCK_SIZE)]
    event = BlockStored(
        block_hashes=tuple(engine[start:end]),
        parent_block_hash=engine[start - 1] if start else None,
        token_ids=tuple(tokens[start * BLOCK_SIZE : end * BLOCK_SIZE]),
        block_size=BLOCK_SIZE,
    )
    index.apply(EventBatch(worker, 0, 0, 0.0, (event,)))


def test_mid_chain_removal_makes_a_gap_and_restoring_the_block_closes_it() -> None:
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE))
    tokens = list(range(2 * 8))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    store(index, "a", tokens, 0, 8)
    store(index, "b", tokens, 0, 5)
    slot_a = index.state.slots[("a", 0)]
    assert slot_a.num_gaps == 0 and index.state.dirty_mask == 0
    assert match_gpu_depths(index, hashes) == {"a": 8, "b": 5}

    index.apply(EventBatch("a", 0, 1, 0.0, (BlockRemoved((hashes[3] ^ 0x5A5A,)),)))
    assert slot_a.num_gaps == 1  # block 4 is held, its parent (block 3) is not
    assert index.state.dirty_mask == slot_a.mask
    assert match_gpu_depths(index, hashes) == {"a": 3, "b": 5}
    index.check_invariants()

    store(index, "a", tokens, 3, 4)  # block 3 again, chained to block 2
    assert slot_a.num_gaps == 0 and index.state.dirty_mask == 0
    assert match_gpu_depths(index, hashes) == {"a": 8, "b": 5}
    index.check_invariants()


def test_store_under_a_parent_held_only_on_cpu_is_a_gap() -> None:
    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE))
    tokens = list(range(2 * 6))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    engine = [h ^ 0x5A5A for h in hashes]
    cpu = BlockStored(tuple(engine[:3]), None, tuple(tokens[:6]), BLOCK_SIZE, medium=Medium.CPU)
    index.apply(EventBatch("a", 0, 0, 0.0, (cpu,)))
    store(index, "a", tokens, 3, 6)
    assert index.state.slots[("a", 0)].num_gaps == 1
    result = index.match(hashes).workers["a"]
    assert (result.num_gpu_blocks, result.num_cpu_blocks) == (0, 6)  # GPU or CPU at every position
    index.check_invariants()
