"""``benchmarks.long_turns``'s event-loop part takes the gateway's view path: a prompt over
``router.api.OFF_LOOP_PLAN_CHARS`` is planned off the loop, a shorter one on it."""

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.long_turns import _body, _loop_point
from router.api import OFF_LOOP_PLAN_CHARS

pytestmark = pytest.mark.unit


class _RecordingTokenizer:
    """Records each ``view_async`` call's prompt length and ``plan_off_loop``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    async def view_async(self, parsed, off_loop_chars=0, *, plan_off_loop=False):
        self.calls.append((len(parsed.prompt), plan_off_loop))
        return SimpleNamespace(block_hashes=(7,))


class _NullIndex:
    def __init__(self):
        self.sliced_inserts = {}

    def match(self, block_hashes):
        return None

    def insert_approximate(self, worker_id, block_hashes, now_s, dp_rank=0, ttl_s=None, max_new_blocks=None):
        return None


def test_a_huge_prompt_is_planned_off_the_loop_as_in_the_gateway():
    tokenizer = _RecordingTokenizer()
    huge, edge = "x" * (OFF_LOOP_PLAN_CHARS + 1), "y" * OFF_LOOP_PLAN_CHARS
    first, following, _ = asyncio.run(
        _loop_point(tokenizer, _NullIndex(), "completions", [[_body(edge, False), _body(huge, False)]]))
    assert tokenizer.calls == [(OFF_LOOP_PLAN_CHARS, False), (OFF_LOOP_PLAN_CHARS + 1, True)]
    assert (len(first), len(following)) == (1, 1)
