"""Random interleavings of events for several workers, checked after every step against a brute-force model.

The model keeps, per (worker, dp_rank), a count per (medium, prefix tuple) and the engine hash -> prefix map,
and answers ``match`` by trying every prefix length.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Medium, Resync
from router.block_hash import hash_token_blocks
from router.index import IndexConfig, PrefixIndex

pytestmark = pytest.mark.unit

BLOCK_SIZE = 2
WORKERS = ("w0", "w1", "w2")
POOL_MEMBERS = frozenset({"w0", "w1"})
OWN = (Medium.GPU, Medium.CPU, Medium.DISK)

Prefix = tuple[tuple[int, ...], ...]


def engine_hash(prefix: Prefix) -> int:
    """Same for every worker, like an engine with a fixed seed."""
    return xxhash.xxh64_intdigest(repr(prefix).encode())


class Model:
    def __init__(self) -> None:
        self.held: dict[tuple[str, int], dict[tuple[Medium, Prefix], int]] = defaultdict(dict)
        self.engine: dict[tuple[str, int], dict[int, Prefix]] = defaultdict(dict)
        self.parked: dict[tuple[str, int], list[tuple[int, Prefix, int, int]]] = defaultdict(list)
        self.known: list[tuple[str, int]] = []  # slots that published a batch, in first-seen order

    def holds_any(self, slot, prefix) -> bool:
        return any(self.held[slot].get((m, prefix), 0) for m in Medium)

    def store(self, slot, chain: Prefix, start: int, end: int) -> None:
        if start > 0:
            parent = engine_hash(chain[:start])
            if parent not in self.engine[slot]:
                self.parked[slot].append((parent, chain, start, end))
                return
        todo = [(chain, start, end)]
        while todo:
            chain, start, end = todo.pop()
            mapped = []
            for i in range(start, end):
                prefix = chain[: i + 1]
                key = (Medium.GPU, prefix)
                self.held[slot][key] = self.held[slot].get(key, 0) + 1
                self.engine[slot][engine_hash(prefix)] = prefix
                mapped.append(engine_hash(prefix))
            still = []
            for item in self.parked[slot]:
                if item[0] in mapped:
                    todo.append(item[1:])
                else:
                    still.append(item)
            self.parked[slot] = still

    def offload(self, slot, medium, hashes) -> None:
        for eh in hashes:
            prefix = self.engine[slot].get(eh)
            if prefix is not None:
                key = (medium, prefix)
                self.held[slot][key] = self.held[slot].get(key, 0) + 1

    def remove(self, slot, medium, hashes) -> None:
        for eh in hashes:
            prefix = self.engine[slot].get(eh)
            if prefix is None:
                continue
            key = (medium, prefix)
            if self.held[slot].get(key, 0):
                self.held[slot][key] -= 1
            if not self.holds_any(slot, prefix):
                del self.engine[slot][eh]

    def clear(self, slot, media) -> None:
        for key in list(self.held[slot]):
            if key[0] in media:
                del self.held[slot][key]
        self.engine[slot] = {eh: p for eh, p in self.engine[slot].items() if self.holds_any(slot, p)}

    def match(self, blocks: Prefix) -> dict[str, tuple[int, int, int, int]]:
        best: dict[str, tuple[int, int, int, int]] = {}
        for slot in self.known:
            worker, rank = slot

            def depth(ok) -> int:
                n = 0
                while n < len(blocks) and ok(blocks[: n + 1]):
                    n += 1
                return n

            def own(p, media, slot=slot):
                return any(self.held[slot].get((m, p), 0) for m in media)

            def pool(p, slot=slot, worker=worker):
                if self.held[slot].get((Medium.MOONCAKE, p), 0):
                    return True
                return worker in POOL_MEMBERS and any(
                    s[0] in POOL_MEMBERS and self.held[s].get((Medium.MOONCAKE, p), 0) for s in self.known
                )

            g = depth(lambda p: own(p, (Medium.GPU,)))
            o = depth(lambda p: own(p, OWN))
            t = depth(lambda p: own(p, OWN) or pool(p))
            if not t:
                continue
            found = (t, g, -rank, o)
            if worker not in best or found[:3] > best[worker][:3]:
                best[worker] = found
        return {w: (-v[2], v[1], v[3] - v[1], v[0] - v[3]) for w, v in best.items()}


blocks_st = st.tuples(st.integers(0, 1), st.integers(0, 1))
chain_st = st.lists(blocks_st, min_size=1, max_size=5).map(tuple)
slot_st = st.tuples(st.sampled_from(WORKERS), st.sampled_from([0, 0, 0, 1]))

ref_st = st.tuples(st.integers(0, 2), st.sampled_from([1, 2, 3, 5, 5, 5]))
"""A chain of the example's small set (so ops collide), cut to a length."""

op_st = st.one_of(
    st.tuples(st.just("store"), slot_st, ref_st, st.sampled_from([0, 0, 0, 1, 2, 3]), st.sampled_from([1, 2, 5, 5])),
    st.tuples(st.just("offload"), slot_st, ref_st, st.sampled_from([Medium.CPU, Medium.DISK, Medium.MOONCAKE])),
    st.tuples(st.just("remove"), slot_st, ref_st, st.sampled_from([Medium.GPU, Medium.GPU, *Medium]), st.booleans()),
    st.tuples(st.just("clear"), slot_st, st.sampled_from([None, *Medium])),
    st.tuples(st.just("resync"), st.sampled_from(WORKERS)),
)


def index_match(index: PrefixIndex, blocks: Prefix) -> dict[str, tuple[int, int, int, int]]:
    tokens = [t for block in blocks for t in block]
    result = index.match(hash_token_blocks(tokens, BLOCK_SIZE))
    return {w: (m.dp_rank, m.num_gpu_blocks, m.num_cpu_blocks, m.num_pool_blocks) for w, m in result.workers.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=40), queries=st.lists(chain_st, min_size=1, max_size=3))
def test_index_agrees_with_brute_force_model(ops, queries):
    def pick(ref) -> Prefix:
        chain = queries[ref[0] % len(queries)]
        return chain[: ref[1]]

    index = PrefixIndex(IndexConfig(block_size=BLOCK_SIZE), pool_members={Medium.MOONCAKE: POOL_MEMBERS})
    model = Model()
    model.known.extend((worker, 0) for worker in sorted(POOL_MEMBERS))  # members reach the pool before any event
    seq = 0
    seen: list[Prefix] = list(queries)
    for op in ops:
        kind = op[0]
        seq += 1
        if kind != "resync" and op[1] not in model.known:
            model.known.append(op[1])
        if kind == "store":
            _, slot, ref, start, length = op
            chain = pick(ref)
            start = min(start, len(chain) - 1)
            end = min(len(chain), start + length)
            event = BlockStored(
                block_hashes=tuple(engine_hash(chain[: i + 1]) for i in range(start, end)),
                parent_block_hash=engine_hash(chain[:start]) if start else None,
                token_ids=tuple(t for block in chain[start:end] for t in block),
                block_size=BLOCK_SIZE,
            )
            index.apply(EventBatch(slot[0], slot[1], seq, 0.0, (event,)))
            model.store(slot, chain, start, end)
        elif kind == "offload":
            _, slot, ref, medium = op
            chain = pick(ref)
            hashes = tuple(engine_hash(chain[: i + 1]) for i in range(len(chain)))
            event = BlockStored(hashes, None, (), BLOCK_SIZE, medium=medium)
            index.apply(EventBatch(slot[0], slot[1], seq, 0.0, (event,)))
            model.offload(slot, medium, hashes)
        elif kind == "remove":
            _, slot, ref, medium, with_unknown = op
            chain = pick(ref)
            hashes = [engine_hash(chain)]
            if with_unknown:
                hashes.insert(0, 12345)  # never stored: counted and skipped, the rest still applies
            event = BlockRemoved(tuple(hashes), medium=medium)
            index.apply(EventBatch(slot[0], slot[1], seq, 0.0, (event,)))
            model.remove(slot, medium, hashes)
        elif kind == "clear":
            _, slot, medium = op
            index.apply(EventBatch(slot[0], slot[1], seq, 0.0, (AllBlocksCleared(medium),)))
            model.clear(slot, OWN if medium is None else (medium,))
            if medium is None:
                model.parked[slot] = []
        else:
            _, worker = op
            index.apply_resync(Resync(worker, "test"))
            for rank in (0, 1):
                if (worker, rank) not in model.known:
                    continue
                model.clear((worker, rank), OWN)
                model.parked[(worker, rank)] = []
        index.check_invariants()
        for blocks in seen:
            assert index_match(index, blocks) == model.match(blocks), (op, blocks)
    stats = index.stats()
    for worker in WORKERS:
        for medium in Medium:
            expected = sum(
                1
                for (w, _), held in model.held.items()
                if w == worker
                for (m, _), n in held.items()
                if m == medium and n
            )
            assert stats.num_blocks_by_worker.get(worker, {}).get(medium.value, 0) == expected
