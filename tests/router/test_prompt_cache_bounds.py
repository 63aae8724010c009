"""The gateway's prompt caches are bounded in bytes (``ModelConfig.prompt_cache_max_bytes``, estimated by
``router.prompt_state.state_size_bytes``): exact entry counts and byte totals after N inserts, least recently used
evicted first, an entry larger than the budget not kept, and the budget split between the three caches."""

from __future__ import annotations

import sys

import pytest

from router.block_hash import BlockHash
from router.config import ModelConfig
from router.prompt_state import BYTES_PER_BLOCK_HASH, BYTES_PER_TAIL_TOKEN, STATE_BYTES, PromptState, state_size_bytes
from router.request_view import ModelTokenizer, PrefixStateCache, parse_request
from router.text_prefix import TextCheckpoint, TextPrefixCache

pytestmark = pytest.mark.unit


def _state(num_blocks: int, num_tail: int = 0, first: int = 0) -> PromptState:
    hashes = tuple(BlockHash(first + i) for i in range(num_blocks))
    return PromptState(16 * num_blocks + num_tail, hashes, tuple(range(num_tail)))


def test_state_size_is_the_documented_estimate():
    assert state_size_bytes(_state(10, 3)) == STATE_BYTES + 10 * BYTES_PER_BLOCK_HASH + 3 * BYTES_PER_TAIL_TOKEN
    assert state_size_bytes(_state(0)) == STATE_BYTES == 120


def test_prefix_state_cache_keeps_the_newest_states_within_its_bytes():
    one = state_size_bytes(_state(10))  # 680 bytes
    cache = PrefixStateCache(max_entries=100, max_bytes=3 * one + one // 2)
    for key in range(7):
        cache.put(key, _state(10, first=1000 * key))
    assert len(cache) == 3 and cache.num_bytes == 3 * one
    assert [cache.get(k) is not None for k in range(7)] == [False] * 4 + [True] * 3
    cache.get(4)  # now the most recent: 5 goes next
    cache.put(7, _state(10))
    assert [k for k in range(8) if cache.get(k) is not None] == [4, 6, 7]
    cache.put(4, _state(20))  # replacing an entry counts its new size (1,240 bytes) only: 6 goes to make room
    assert list(cache._entries) == [7, 4] and cache.num_bytes == one + state_size_bytes(_state(20)) == 1920
    cache.put(99, _state(1000))  # larger than the whole budget: not kept (it empties the cache on its way out)
    assert cache.get(99) is None and len(cache) == 0 and cache.num_bytes == 0
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0


def test_text_prefix_cache_counts_text_and_state_bytes():
    prefix = "x" * 5000
    one = sys.getsizeof(prefix) + state_size_bytes(_state(300))
    assert TextCheckpoint(prefix, _state(300)).size_bytes == one
    cache = TextPrefixCache(max_entries=100, max_bytes=2 * one + 10, anchor_chars=64)
    for key in range(5):
        cache.put(key, TextCheckpoint(prefix, _state(300)))
    assert len(cache) == 2 and cache.num_bytes == 2 * one and cache.num_chars == 2 * 5000
    assert [key for key in range(5) if key in cache._buckets] == [3, 4]
    cache.clear()
    assert (len(cache), cache.num_bytes, cache.num_chars, cache._buckets) == (0, 0, 0, {})


def test_model_budget_is_split_and_held_over_many_prompts():
    model = ModelTokenizer(ModelConfig(name="m", block_size=16, prompt_cache_max_bytes=400_000))
    assert (model.prefixes._max_bytes, model.texts._max_bytes, model._prompts._max_bytes) == (200_000, 150_000,
                                                                                             50_000)
    for i in range(40):  # distinct 4,000-token prompts (byte-level): 250 blocks, 14,120 bytes each
        body = ('{"model": "m", "prompt": "%s", "max_tokens": 1}' % (f"{i:04d}" * 1000)).encode()
        model.view(parse_request("completions", body))
    assert model._prompts.num_bytes == 3 * state_size_bytes(_state(250)) and len(model._prompts) == 3
    assert model.num_cached_bytes <= 400_000
    model.clear_caches()
    assert model.num_cached_bytes == 0 and len(model._prompts) == 0


def test_prompt_cache_budget_must_be_positive():
    with pytest.raises(ValueError, match="prompt_cache_max_bytes"):
        ModelConfig(name="m", prompt_cache_max_bytes=0)
