"""A routed request's entries inserted root-first in slices (``router.sliced_insert``): one slice at the decision,
one per turn of the event loop after it; a match between slices sees a prefix of the chain held; the result, its
expiry and its withdrawal are those of one whole insertion."""

from __future__ import annotations

import asyncio

import pytest

from router.block_hash import hash_token_blocks
from router.config import CircuitBreakerConfig, ModelConfig, WorkerConfig
from router.fleet import WorkerRuntime
from router.index import IndexConfig, PrefixIndex, UnknownWorkerError
from router.request_view import PromptView
from router.routing import IndexTicket
from router.sliced_insert import INSERT_SLICE_BLOCKS, SlicedInsert

pytestmark = pytest.mark.unit

BS = 2
TTL_S = 10.0


def chain(num_blocks: int, first_token: int = 0) -> tuple[int, ...]:
    return tuple(hash_token_blocks(range(first_token, first_token + num_blocks * BS), BS))


def make_index(**kwargs: float) -> PrefixIndex:
    return PrefixIndex(IndexConfig(block_size=BS, approx_ttl_s=TTL_S, **kwargs))  # type: ignore[arg-type]


def gpu_depth(index: PrefixIndex, hashes: tuple[int, ...], worker: str = "a") -> int:
    m = index.match(hashes).workers.get(worker)
    return m.num_gpu_blocks if m is not None else 0


def held(index: PrefixIndex, worker: str = "a") -> set[int]:
    """Every block hash ``worker`` holds (group 0, all its chains); empty for a worker the index does not know."""
    try:
        chains = index.dump_worker(worker)
    except UnknownWorkerError:
        return set()
    return {h for c in chains for h in c.block_hashes}


async def _turns(num_turns: int) -> None:
    for _ in range(num_turns):
        await asyncio.sleep(0)


def test_slices_grow_from_the_root_one_per_loop_turn_and_a_match_between_them_sees_a_held_prefix() -> None:
    index = make_index()
    hashes = chain(10)
    depths: list[int] = []

    async def main() -> SlicedInsert:
        inserted = SlicedInsert(index, "a", hashes, 0.0, slice_blocks=3)
        depths.append(gpu_depth(index, hashes))  # right after the decision: the first slice only
        for _ in range(5):
            await asyncio.sleep(0)
            depths.append(gpu_depth(index, hashes))
            index.check_invariants()
            # Every held block's parent is held: the worker holds exactly the first `depth` blocks of the chain.
            held = [gpu_depth(index, hashes[: i + 1]) == i + 1 for i in range(len(hashes))]
            assert held == [i < depths[-1] for i in range(len(hashes))]
        return inserted

    inserted = asyncio.run(main())
    assert depths == [3, 6, 9, 10, 10, 10]
    assert inserted.is_done
    assert index.stats().num_approx_blocks == 10
    assert index.stats().counters["num_approx_blocks_inserted"] == 10


def test_the_sliced_result_equals_one_whole_insertion_with_its_expiry_and_withdrawal() -> None:
    whole, sliced = make_index(), make_index()
    hashes = chain(10)
    one = whole.insert_approximate("a", hashes, now_s=1.0)
    assert one is not None

    async def main() -> SlicedInsert:
        inserted = SlicedInsert(sliced, "a", hashes, 1.0, slice_blocks=4)
        await _turns(3)
        return inserted

    inserted = asyncio.run(main())
    assert inserted.is_done
    for index in (whole, sliced):
        assert gpu_depth(index, hashes) == 10 and index.num_blocks() == 10
        index.check_invariants()
    assert sliced.expire(1.0 + TTL_S - 0.001) == 0  # every slice has the decision's expiry
    assert inserted.withdraw() == whole.withdraw_approximate(one) == 10
    for index in (whole, sliced):
        assert gpu_depth(index, hashes) == 0 and index.num_blocks() == 0
        assert index.stats().num_approx_blocks == 0
        index.check_invariants()


def test_a_following_turn_links_its_new_blocks_in_one_call() -> None:
    index = make_index()
    turn0, turn1 = chain(8), chain(10)
    index.insert_approximate("a", turn0, now_s=0.0)

    async def main() -> SlicedInsert:
        return SlicedInsert(index, "a", turn1, 1.0, slice_blocks=3)

    inserted = asyncio.run(main())
    assert inserted.is_done  # no slice was left for the loop
    assert gpu_depth(index, turn1) == 10
    assert inserted.withdraw() == 2  # its own 2 new blocks; turn 0's stay
    assert gpu_depth(index, turn1) == 8
    index.check_invariants()


def test_a_withdrawal_between_slices_cancels_the_rest_and_undoes_the_first() -> None:
    index = make_index()
    hashes = chain(10)

    async def main() -> tuple[int, int]:
        inserted = SlicedInsert(index, "a", hashes, 0.0, slice_blocks=3)
        await asyncio.sleep(0)  # the second slice: 6 blocks held
        depth = gpu_depth(index, hashes)
        num_dropped = inserted.withdraw()
        await _turns(4)
        return depth, num_dropped

    assert asyncio.run(main()) == (6, 6)
    assert gpu_depth(index, hashes) == 0 and index.num_blocks() == 0
    index.check_invariants()


def test_a_worker_removed_between_slices_does_not_come_back() -> None:
    index = make_index()
    hashes = chain(10)

    async def main() -> SlicedInsert:
        inserted = SlicedInsert(index, "a", hashes, 0.0, slice_blocks=3)
        index.remove_worker("a")
        await _turns(4)
        return inserted

    inserted = asyncio.run(main())
    assert inserted.is_done
    assert index.match(hashes).workers == {} and index.num_blocks() == 0
    assert inserted.withdraw() == 0
    index.check_invariants()


def test_another_request_inserting_between_slices_keeps_the_index_whole() -> None:
    """Request B (the same 5-block prefix, then its own blocks) is routed to the same worker between A's slices:
    A's slices go on from what the worker holds; withdrawing A leaves B's blocks."""
    index = make_index()
    a = chain(10)
    b = tuple(hash_token_blocks([*range(0, 5 * BS), *range(1000, 1000 + 3 * BS)], BS))
    assert b[:5] == a[:5] and not set(b[5:]) & set(a)

    async def main() -> tuple[SlicedInsert, SlicedInsert]:
        first = SlicedInsert(index, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(index, "a", b, 0.0, slice_blocks=3)  # 3 held, then 2 of A's and 3 of its own
        await _turns(4)
        return first, second

    first, second = asyncio.run(main())
    assert first.is_done and second.is_done
    assert gpu_depth(index, a) == 10 and gpu_depth(index, b) == 8
    index.check_invariants()
    assert first.withdraw() == 5  # A's own blocks; the prefix B shares stays, as for one whole insertion of A
    assert gpu_depth(index, a) == 5 and gpu_depth(index, b) == 8
    index.check_invariants()


def test_without_a_running_loop_the_whole_chain_is_inserted_at_once() -> None:
    index = make_index()
    hashes = chain(10)
    inserted = SlicedInsert(index, "a", hashes, 0.0, slice_blocks=3)
    assert inserted.is_done and gpu_depth(index, hashes) == 10
    assert inserted.withdraw() == 10


def test_bad_arguments_are_refused_before_anything_is_inserted() -> None:
    index = make_index()
    with pytest.raises(ValueError, match="slice_blocks must be positive"):
        SlicedInsert(index, "a", chain(4), 0.0, slice_blocks=0)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        SlicedInsert(index, "a", chain(4), 0.0, ttl_s=0.0)
    with pytest.raises(ValueError, match="max_new_blocks must be positive"):
        index.insert_approximate("a", chain(4), 0.0, max_new_blocks=0)
    assert index.num_blocks() == 0


@pytest.mark.parametrize("slice_blocks", [100, 3])
def test_withdrawing_a_request_that_interleaved_leaves_the_blocks_of_the_one_before(slice_blocks: int) -> None:
    """Requests A and B of one 10-block chain are routed to the same worker, B a second after A, between A's
    slices; B is withdrawn (refused, or served elsewhere) while A was served. One whole insertion of A, then one of
    B, leaves A's 10 blocks held after B's withdrawal (B added none); B's slices must not take those of A's that
    B happened to link before A's next slice did."""
    index = make_index()
    a = chain(10)

    async def main() -> SlicedInsert:
        SlicedInsert(index, "a", a, 0.0, slice_blocks=slice_blocks)
        second = SlicedInsert(index, "a", a, 1.0, slice_blocks=slice_blocks)
        await _turns(6)
        return second

    second = asyncio.run(main())
    assert second.is_done
    assert second.withdraw() == 0
    assert held(index) == set(a) and gpu_depth(index, a) == 10
    assert index.sliced_inserts == {}
    index.check_invariants()


def test_a_later_request_withdrawn_while_it_waits_leaves_the_earlier_one_going_on() -> None:
    """B (the same chain, the same worker) waits behind A's slices; withdrawn before its turn, it drops nothing
    and A's slices go on to the whole chain. Worker b's insertion of the chain, meanwhile, neither waits nor is
    touched (the registry is per worker)."""
    index = make_index()
    a = chain(10)
    steps: list[tuple[set[int], set[int]]] = []

    async def main() -> tuple[SlicedInsert, SlicedInsert, SlicedInsert]:
        first = SlicedInsert(index, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(index, "a", a, 1.0, slice_blocks=3)
        other = SlicedInsert(index, "b", a, 1.0, slice_blocks=4)
        assert second.is_waiting and not second.is_done and not other.is_waiting
        steps.append((held(index, "a"), held(index, "b")))
        assert second.withdraw() == 0
        assert second.is_done and not second.is_waiting
        for _ in range(4):
            await asyncio.sleep(0)
            steps.append((held(index, "a"), held(index, "b")))
            index.check_invariants()
        return first, second, other

    first, second, other = asyncio.run(main())
    assert steps == [(set(a[:3]), set(a[:4])), (set(a[:6]), set(a[:8])), (set(a[:9]), set(a)),
                     (set(a), set(a)), (set(a), set(a))]
    assert first.is_done and other.is_done and index.sliced_inserts == {}
    assert second.withdraw() == 0 and held(index, "a") == set(a)  # a second withdrawal: nothing
    assert other.withdraw() == 10
    assert held(index, "a") == set(a) and held(index, "b") == set()
    assert first.withdraw() == 10
    assert held(index, "a") == set() and index.num_blocks() == 0
    index.check_invariants()


def test_an_earlier_request_withdrawn_before_it_finished_hands_the_chain_to_the_one_waiting() -> None:
    """A withdrawn after its first slice drops its 3 blocks; B, waiting behind it, starts on the next turn of the
    loop and inserts the whole chain itself, slice by slice; B's withdrawal then drops all 10."""
    index = make_index()
    a = chain(10)
    steps: list[set[int]] = []

    async def main() -> tuple[SlicedInsert, SlicedInsert, int]:
        first = SlicedInsert(index, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(index, "a", a, 1.0, slice_blocks=3)
        steps.append(held(index))
        num_dropped = first.withdraw()
        steps.append(held(index))
        assert second.is_waiting  # its turn comes with the next turn of the loop
        for _ in range(5):
            await asyncio.sleep(0)
            steps.append(held(index))
            index.check_invariants()
        return first, second, num_dropped

    first, second, num_dropped = asyncio.run(main())
    assert num_dropped == 3
    assert steps == [set(a[:3]), set(), set(a[:3]), set(a[:6]), set(a[:9]), set(a), set(a)]
    assert second.is_done and not second.is_waiting and index.sliced_inserts == {}
    assert index.expire(1.0 + TTL_S - 0.001) == 0  # B's expiry: A's insertion is gone
    assert first.withdraw() == 0
    assert second.withdraw() == 10
    assert held(index) == set() and index.num_blocks() == 0
    index.check_invariants()


def test_both_requests_completed_equal_two_whole_insertions_in_routing_order() -> None:
    """A's slices, then B's (a refresh of the chain with B's later expiry): after every step and every withdrawal,
    the worker holds exactly what one whole insertion of A, then one of B, make it hold."""
    sliced, whole = make_index(), make_index()
    a = chain(10)
    steps: list[tuple[set[int], bool]] = []

    async def main() -> tuple[SlicedInsert, SlicedInsert]:
        first = SlicedInsert(sliced, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(sliced, "a", a, 1.0, slice_blocks=3)
        for _ in range(5):
            await asyncio.sleep(0)
            steps.append((held(sliced), second.is_waiting))
        return first, second

    first, second = asyncio.run(main())
    assert steps == [(set(a[:6]), True), (set(a[:9]), True), (set(a), True), (set(a), False), (set(a), False)]
    assert first.is_done and second.is_done and sliced.sliced_inserts == {}
    one = whole.insert_approximate("a", a, 0.0)
    two = whole.insert_approximate("a", a, 1.0)
    assert one is not None and two is not None
    assert held(sliced) == held(whole) == set(a)
    assert (second.withdraw(), whole.withdraw_approximate(two)) == (0, 0)  # B added no block
    assert held(sliced) == held(whole) == set(a)
    assert (first.withdraw(), whole.withdraw_approximate(one)) == (0, 0)  # B's refresh keeps them (B pending)
    assert held(sliced) == held(whole) == set(a)
    for index in (sliced, whole):
        assert index.expire(TTL_S + 0.5) == 0  # not at A's expiry: at B's
        assert index.expire(1.0 + TTL_S) == 10
        assert held(index) == set()
        index.check_invariants()


def test_a_third_request_waits_behind_both_and_a_withdrawal_between_them_keeps_the_order() -> None:
    """A (10 blocks), B (the same chain) and C (A's chain and 3 more blocks) are routed to one worker in that
    order while A's slices run. B is withdrawn while it waits; C starts after A finished and adds its 3 blocks in
    one call; withdrawing C, then A, leaves what whole insertions of A and C leave after the same withdrawals.
    A chain of another root (D) neither waits nor holds anyone up."""
    sliced, whole = make_index(), make_index()
    a, c, d = chain(10), chain(13), chain(4, first_token=5000)
    assert c[:10] == a and not set(d) & set(c)
    steps: list[tuple[set[int], bool]] = []

    async def main() -> tuple[SlicedInsert, SlicedInsert, SlicedInsert, SlicedInsert]:
        first = SlicedInsert(sliced, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(sliced, "a", a, 1.0, slice_blocks=3)
        third = SlicedInsert(sliced, "a", c, 2.0, slice_blocks=3)
        other = SlicedInsert(sliced, "a", d, 2.0, slice_blocks=3)
        assert second.is_waiting and third.is_waiting and not other.is_waiting
        assert len(sliced.sliced_inserts[("a", a[0])]) == 3 and ("a", d[0]) in sliced.sliced_inserts
        steps.append((held(sliced), third.is_waiting))
        assert second.withdraw() == 0
        for _ in range(5):
            await asyncio.sleep(0)
            steps.append((held(sliced), third.is_waiting))
            sliced.check_invariants()
        return first, second, third, other

    first, second, third, other = asyncio.run(main())
    dd = set(d)
    assert steps == [(set(a[:3]) | set(d[:3]), True), (set(a[:6]) | dd, True), (set(a[:9]) | dd, True),
                     (set(a) | dd, True), (set(c) | dd, False), (set(c) | dd, False)]
    assert first.is_done and third.is_done and other.is_done and sliced.sliced_inserts == {}
    one = whole.insert_approximate("a", a, 0.0)
    three = whole.insert_approximate("a", c, 2.0)
    four = whole.insert_approximate("a", d, 2.0)
    assert one is not None and three is not None and four is not None
    assert held(sliced) == held(whole) == set(c) | dd
    assert (third.withdraw(), whole.withdraw_approximate(three)) == (3, 3)
    assert held(sliced) == held(whole) == set(a) | dd
    assert (first.withdraw(), whole.withdraw_approximate(one)) == (10, 10)
    assert held(sliced) == held(whole) == dd
    assert (other.withdraw(), whole.withdraw_approximate(four)) == (4, 4)
    for index in (sliced, whole):
        assert held(index) == set() and index.num_blocks() == 0
        index.check_invariants()


@pytest.mark.parametrize("num_turns_before", [0, 3])
def test_the_ones_waiting_stop_when_the_worker_is_removed(num_turns_before: int) -> None:
    """The worker goes while A's slices run and B waits behind them (0 turns), or once A finished and B's first
    slice is due on the next turn (3): neither inserts again (the removed worker does not come back), and the
    registry is left empty."""
    index = make_index()
    a = chain(10)

    async def main() -> tuple[SlicedInsert, SlicedInsert]:
        first = SlicedInsert(index, "a", a, 0.0, slice_blocks=3)
        second = SlicedInsert(index, "a", a, 1.0, slice_blocks=3)
        await _turns(num_turns_before)
        assert held(index) == set(a[: min(10, 3 * (num_turns_before + 1))]) and second.is_waiting
        index.remove_worker("a")
        await _turns(5)
        return first, second

    first, second = asyncio.run(main())
    assert first.is_done and second.is_done and not second.is_waiting
    assert index.match(a).workers == {} and index.num_blocks() == 0 and index.sliced_inserts == {}
    assert (first.withdraw(), second.withdraw()) == (0, 0)
    index.check_invariants()


def test_a_queue_left_by_a_loop_that_ended_is_finished_by_the_next_insertion_of_its_key() -> None:
    """The loop that ran A's slices ended after A's first (B waiting behind it): a synchronous insertion of the
    chain's root for that worker first finishes A, then B, then itself, so no key stays waiting for ever."""
    index = make_index()
    a, c = chain(10), chain(12)

    async def main() -> tuple[SlicedInsert, SlicedInsert]:
        return SlicedInsert(index, "a", a, 0.0, slice_blocks=3), SlicedInsert(index, "a", a, 1.0, slice_blocks=3)

    loop = asyncio.new_event_loop()
    try:
        first, second = loop.run_until_complete(main())  # stops with A's slices still to come
    finally:
        loop.close()
    depth = gpu_depth(index, a)
    assert 3 <= depth < 10 and held(index) == set(a[:depth]) and second.is_waiting and not first.is_done
    third = SlicedInsert(index, "a", c, 2.0, slice_blocks=3)
    assert first.is_done and second.is_done and third.is_done and index.sliced_inserts == {}
    assert held(index) == set(c)
    assert third.withdraw() == 2 and second.withdraw() == 0
    assert held(index) == set(a)
    index.check_invariants()


def test_two_tickets_of_one_conversation_the_second_refused_while_the_first_slices_run() -> None:
    """The request path's use (``IndexTicket.insert_for`` at the decision, ``settle`` after the answer), with the
    gateway's slice size: A (2,500 blocks, three slices) is routed to the worker, then B (the same prompt); B is
    refused (settled unserved) before A's slices are in; the worker then holds A's whole chain, and A's own
    withdrawal (had it been refused too) drops all of it."""
    index = make_index()
    num_blocks = 2 * INSERT_SLICE_BLOCKS + 452
    hashes = chain(num_blocks)
    view = PromptView(num_tokens=num_blocks * BS + 1, block_hashes=hashes, block_size=BS)
    model = ModelConfig(name="m", block_size=BS)
    worker = WorkerRuntime(WorkerConfig(id="a", url="http://127.0.0.1:9000", model="m"), BS, CircuitBreakerConfig())
    assert worker.is_approximate
    memo: dict[tuple[str, int, int], float] = {}
    steps: list[int] = []

    async def main() -> tuple[IndexTicket, IndexTicket]:
        first, second = IndexTicket(index, model, view, memo), IndexTicket(index, model, view, memo)
        first.insert_for(worker, first.match(), 0.0)
        second.insert_for(worker, second.match(), 1.0)  # the index holds 1,024 of them: a new insertion
        steps.append(len(held(index)))
        second.settle(worker, None, False, 1.5)  # refused: its entries are withdrawn
        steps.append(len(held(index)))
        for _ in range(3):
            await asyncio.sleep(0)
            steps.append(len(held(index)))
        return first, second

    first, second = asyncio.run(main())
    assert steps == [INSERT_SLICE_BLOCKS, INSERT_SLICE_BLOCKS, 2 * INSERT_SLICE_BLOCKS, num_blocks, num_blocks]
    assert held(index) == set(hashes) and second.pending is None and index.sliced_inserts == {}
    first.settle(worker, None, False, 2.0)
    assert held(index) == set() and index.num_blocks() == 0
    index.check_invariants()
