"""``extend_state`` over more than ``HASH_SLICE_TOKENS`` tokens (hashed slice by slice) gives exactly the state of
the one-pass rule: the chained hashes of the whole token run recomputed with ``hash_token_blocks``, and its tail."""

from __future__ import annotations

import random

import pytest

from router.block_hash import hash_token_blocks, make_namespace
from router.prompt_state import EMPTY_STATE, HASH_SLICE_TOKENS, extend_state

pytestmark = pytest.mark.unit

NS = make_namespace("adapter", "salt")


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_tokens", [HASH_SLICE_TOKENS + 1, 2 * HASH_SLICE_TOKENS + 7, 3 * HASH_SLICE_TOKENS])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_long_run_is_hashed_as_in_one_pass(block_size: int, num_tokens: int, as_tuple: bool) -> None:
    rng = random.Random(num_tokens + block_size)
    head = [rng.randrange(128_256) for _ in range(3 * block_size + 2)]  # a state with hashes and a tail
    run = [rng.randrange(128_256) for _ in range(num_tokens)]
    start = extend_state(EMPTY_STATE, head, block_size, NS)
    assert len(start.tail) == 2
    got = extend_state(start, tuple(run) if as_tuple else run, block_size, NS)
    everything = head + run
    num_full = len(everything) // block_size
    assert got.num_tokens == len(everything)
    assert list(got.block_hashes) == hash_token_blocks(everything, block_size, NS)
    assert len(got.block_hashes) == num_full
    assert got.tail == tuple(everything[num_full * block_size:])
    # The same state as extending in two short steps (each under the slice size: the one-pass path).
    half = len(run) // 2
    stepwise = EMPTY_STATE
    for part in (head, run[:half // 2], run[half // 2:half], run[half:half + half // 2], run[half + half // 2:]):
        stepwise = extend_state(stepwise, part, block_size, NS)
    assert stepwise == got
