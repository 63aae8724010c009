"""The index's bulk paths (chains of ids written by slices, removal events in one loop, holder-set segments) against
the block-by-block reference (``Holdings.bulk_paths = False``): after every operation the two indexes' full state is
equal (ids, parent links, kinds, children, free ids, every lane, the live eviction order, and per slot its counts,
gaps, engine hashes, copies and eviction journal), and so are their matches."""

from __future__ import annotations

import random

import pytest

from events.types import BlockRemoved, BlockStored, EventBatch, Medium
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex
from router.index.state import UNSTAMPED, IndexState
from tests.index.test_fuzz_upkeep import POOL_MEMBERS, Driver, make_config, make_prompts, random_ops

pytestmark = pytest.mark.unit

BS = 2


def full_state(state: IndexState) -> dict[str, object]:
    """Everything ``check_invariants`` reads, by block hash rather than by id (which free ids a chain takes is not
    part of the state: the per-block path reuses free ids one by one, a bulk chain takes fresh ones when there are
    too few), with the eviction log reduced to its live records in order."""
    kind = state.kind
    stamp = state.stamp
    hash_of = state.hash_of
    lanes = list(state.lanes.items())
    entries = {
        block_hash: (kind[i], hash_of[state.parent[i]], tuple(lane[i] for _, lane in lanes),
                     sorted(hash_of[c] for c in state.iter_children(i)))
        for block_hash, i in state.id_of.items()
    }
    live_log = [hash_of[i] for pos, i in enumerate(state.log) if kind[i] & 1 and stamp[i] in (pos, UNSTAMPED)]
    slots = {
        key: (slot.bit, dict(slot.num_held), slot.num_gaps, dict(slot.engine), dict(slot.copies),
              dict(slot.evicted), dict(slot.confirmed), set(slot.span_held), dict(slot.spans),
              {h: (r.hashes, r.start, r.expiry_s) for h, r in slot.approx.items()})
        for key, slot in state.slots.items()
    }
    return {
        "entries": entries, "lane_keys": [key for key, _ in lanes], "lane_sizes": dict(state.lane_sizes),
        "num_entries": state.num_entries, "num_dangling": state.num_dangling, "log": live_log,
        "slots": slots, "dirty": state.dirty_mask, "counters": dict(state.counters),
        "roster": {bit: (s.worker_id, s.dp_rank) for bit, s in state.slots_by_bit.items()},
    }


def assert_same(bulk: PrefixIndex, reference: PrefixIndex, label: str) -> None:
    got, want = full_state(bulk.state), full_state(reference.state)
    for key in want:
        assert got[key] == want[key], f"{label}: {key} differs"


@pytest.mark.parametrize("seed", range(30))
def test_fuzzed_operations_leave_the_same_state_as_block_by_block(seed: int) -> None:
    rng = random.Random(seed)
    prompts = make_prompts(rng)
    config = make_config(rng)
    ops = random_ops(rng, len(prompts), 200)
    bulk, reference = Driver(prompts, config), Driver(prompts, config)
    reference.index.holdings.bulk_paths = False
    for step, op in enumerate(ops):
        bulk.apply(op)
        reference.apply(op)
        assert_same(bulk.index, reference.index, f"seed {seed} step {step} {op!r}")
    for hashes in bulk.hashes:
        assert bulk.index.match(hashes) == reference.index.match(hashes)
    assert POOL_MEMBERS  # the fleet of the upkeep fuzz: pools, lower tiers, approximate workers


def engine_hash(tokens: list[int], num_blocks: int) -> int:
    return hash(tuple(tokens[: num_blocks * BS])) & ((1 << 64) - 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_workers", [3, 90])
def test_conversations_over_many_workers_leave_the_same_state(seed: int, num_workers: int) -> None:
    """GPU-only engines storing branching conversations turn by turn (others' blocks, then new ones), evicting
    least recently used blocks in batches (root-most first: gaps), with a block cap that prunes."""
    rng = random.Random(seed)
    config = IndexConfig(block_size=BS, max_blocks=rng.choice((400, 1500, 1 << 20)))
    bulk, reference = PrefixIndex(config), PrefixIndex(config)
    reference.holdings.bulk_paths = False
    trunks = [[rng.randrange(50) for _ in range(BS * 40)] for _ in range(3)]
    conversations: list[list[int]] = []
    held: dict[str, list[int]] = {}
    seq = 0
    for step in range(160):
        worker = f"w{rng.randrange(num_workers)}"
        if conversations and rng.random() < 0.5:
            tokens = rng.choice(conversations)
            tokens = tokens + [rng.randrange(50) for _ in range(BS * rng.randrange(1, 20))]
        else:
            trunk = rng.choice(trunks)
            tokens = trunk[: BS * rng.randrange(0, 40)] + [rng.randrange(50) for _ in range(BS * rng.randrange(1, 30))]
        conversations.append(tokens)
        num_blocks = len(tokens) // BS
        mine = held.setdefault(worker, [])
        start = 0
        while start < num_blocks and engine_hash(tokens, start + 1) in mine:
            start += 1
        events: list[BlockStored | BlockRemoved] = []
        if start < num_blocks:
            events.append(BlockStored(
                block_hashes=tuple(engine_hash(tokens, i + 1) for i in range(start, num_blocks)),
                parent_block_hash=engine_hash(tokens, start) if start else None,
                token_ids=tuple(tokens[start * BS: num_blocks * BS]), block_size=BS,
            ))
            mine.extend(engine_hash(tokens, i + 1) for i in range(start, num_blocks))
        if len(mine) > 60:
            num_evicted = rng.randrange(1, len(mine) - 40)
            evicted, held[worker] = mine[:num_evicted], mine[num_evicted:]
            events.append(BlockRemoved(block_hashes=(*evicted, rng.randrange(1 << 60))))  # and an unknown hash
        seq += 1
        batch = EventBatch(worker, 0, seq, 0.0, tuple(events))
        bulk.apply(batch)
        reference.apply(batch)
        assert_same(bulk, reference, f"seed {seed} step {step}")
        hashes = hash_token_blocks(tokens, BS)
        assert bulk.match(hashes) == reference.match(hashes)
    bulk.check_invariants()
    assert bulk.state.counters["num_blocks_removed"] > 0
    assert Medium.GPU
