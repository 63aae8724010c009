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
from router.index.match import iter_bits, jump_depths, prefix_depths, prefix_levels, walk_levels

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


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 700),
    run_cuts=st.lists(st.integers(1, 700), max_size=12),
    bits=st.lists(st.lists(st.integers(0, 699), max_size=6), min_size=1, max_size=8),
    unknown=st.one_of(st.none(), st.integers(0, 699)),
    seed=st.integers(0, 2**16),
)
def test_walk_levels_agrees_with_the_walk_on_masks_with_gaps(
    num_blocks: int, run_cuts: list[int], bits: list[list[int]], unknown: int | None, seed: int
) -> None:
    # Ids laid out in runs of consecutive ids, in shuffled order, so some runs break at every cut.
    rng = random.Random(seed)
    hashes = [1000 + pos for pos in range(num_blocks)]
    cuts = sorted({c for c in run_cuts if c < num_blocks})
    runs = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, num_blocks], strict=True)]
    rng.shuffle(runs)
    id_of: dict[int, int] = {}
    hash_of = [0]
    for run in runs:
        for pos in run:
            id_of[hashes[pos]] = len(hash_of)
            hash_of.append(hashes[pos])
    if unknown is not None and unknown < num_blocks:
        del id_of[hashes[unknown]]  # a block nobody holds, not indexed
    # Each slot holds position 0 and then a random set of positions (holes anywhere: slots with gaps).
    held = [{0, *(p for p in positions if p < num_blocks)} for positions in bits]
    masks = [0] * len(hash_of)
    for bit, positions in enumerate(held):
        for pos in positions:
            if hashes[pos] in id_of:
                masks[id_of[hashes[pos]]] |= 1 << bit
    along = [masks[id_of.get(h, 0)] for h in hashes]
    mask = along[0]
    expected, _ = prefix_levels(along)
    assert walk_levels(id_of.get, hash_of, masks, hashes, mask) == expected
    assert walk_levels(id_of.get, hash_of, masks, tuple(hashes), mask) == expected


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
