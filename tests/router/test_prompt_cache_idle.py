"""The prompt caches keep the live sessions' entries up to ``prompt_cache_max_bytes`` and idle ones up to
``prompt_cache_idle_max_bytes`` (``router.prompt_state.over_budget``): exact entries and byte totals under an injected
clock, a chat's superseded state evicted first, and the model's split of both budgets."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest

from router.block_hash import BlockHash
from router.config import ModelConfig
from router.prompt_state import IDLE_S, PromptState, over_budget, state_size_bytes
from router.request_view import ModelTokenizer, PrefixStateCache, parse_request
from router.text_prefix import TextCheckpoint, TextPrefixCache

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _state(num_blocks: int, first: int = 0) -> PromptState:
    return PromptState(16 * num_blocks, tuple(BlockHash(first + i) for i in range(num_blocks)), ())


ONE = state_size_bytes(_state(10))  # 680 bytes


def test_over_budget_rule():
    assert over_budget(101, 100, 50, oldest_used_s=0.0, now_s=0.0, idle_s=10.0)  # over the cap: always
    assert not over_budget(100, 100, 50, oldest_used_s=0.0, now_s=10.0, idle_s=10.0)  # live (10 s is not idle)
    assert over_budget(51, 100, 50, oldest_used_s=0.0, now_s=10.5, idle_s=10.0)  # idle and over the idle budget
    assert not over_budget(50, 100, 50, oldest_used_s=0.0, now_s=99.0, idle_s=10.0)


def test_live_states_are_kept_up_to_the_cap_and_idle_ones_down_to_the_idle_budget():
    clock = _Clock()
    cache = PrefixStateCache(100, max_bytes=6 * ONE, idle_max_bytes=2 * ONE, idle_s=60.0, clock=clock)
    for key in range(8):  # all live: the cap (6) holds
        clock.now_s += 1.0
        cache.put(key, _state(10, 1000 * key))
    assert list(cache._entries) == [2, 3, 4, 5, 6, 7] and cache.num_bytes == 6 * ONE
    clock.now_s += 55.0  # keys 2..7 were put at 1003..1008 s; 4 is used again at 1063 s
    assert cache.get(4) is not None
    clock.now_s += 4.0  # at 1067 s: 2 goes for the cap, 3 and 5 (63 and 61 s unused) as idle; 6 (60 s) is live
    cache.put(8, _state(10, 8000))
    assert list(cache._entries) == [6, 7, 4, 8] and cache.num_bytes == 4 * ONE
    clock.now_s += 59.0  # at 1126 s: 6, 7 and 4 (63 s) idle, 8 (59 s) live
    cache.put(9, _state(10, 9000))
    assert list(cache._entries) == [8, 9] and cache.num_bytes == 2 * ONE


def test_a_superseded_state_is_evicted_first():
    clock = _Clock()
    cache = PrefixStateCache(100, max_bytes=3 * ONE, idle_max_bytes=3 * ONE, idle_s=60.0, clock=clock)
    cache.put(1, _state(10))
    cache.put(2, _state(10, 2000))
    assert cache.get(1) is not None  # session 1 takes its turn: its state 1 continues as 11
    cache.put(11, _state(10, 1000), superseded=1)
    assert list(cache._entries) == [1, 2, 11]
    cache.put(3, _state(10, 3000))  # over 3: the superseded 1 goes, not session 2's state
    assert list(cache._entries) == [2, 11, 3]
    cache.put(4, _state(10, 4000), superseded=99)  # an unknown key is no error
    assert list(cache._entries) == [11, 3, 4]


def test_text_checkpoints_follow_the_same_rule():
    clock = _Clock()
    prefix = "x" * 999 + "\n"
    one = sys.getsizeof(prefix) + state_size_bytes(_state(60))
    cache = TextPrefixCache(100, max_bytes=4 * one, anchor_chars=64, idle_max_bytes=one, idle_s=30.0, clock=clock)
    for key in range(5):
        clock.now_s += 1.0
        cache.put(key, TextCheckpoint(prefix, _state(60)))
    assert list(cache._buckets) == [1, 2, 3, 4] and cache.num_bytes == 4 * one
    clock.now_s += 29.0  # at 1034 s, buckets 1..4 put at 1002..1005 s; 3 is used again
    assert cache.find(3, prefix + "more") is not None
    cache.put(5, TextCheckpoint(prefix, _state(60)))  # 1 goes for the cap, 2 (31 s unused) as idle; 4 (29 s) is live
    assert [e.key for e in cache._entries.values()] == [4, 3, 5] and cache.num_bytes == 3 * one
    assert (cache.num_hits, cache.num_misses) == (1, 0)


def test_model_splits_both_budgets_and_a_chat_turn_supersedes_its_previous_state():
    config = ModelConfig(name="m", block_size=16, prompt_cache_max_bytes=800_000, prompt_cache_idle_max_bytes=80_000,
                         prompt_cache_idle_s=5.0)
    model = ModelTokenizer(config)
    assert (model.prefixes._max_bytes, model.texts._max_bytes, model._prompts._max_bytes) == (400_000, 300_000,
                                                                                             100_000)
    assert (model.prefixes._idle_max_bytes, model.texts._idle_max_bytes, model._prompts._idle_max_bytes) == (
        40_000, 30_000, 10_000)
    assert model.prefixes._idle_s == model.texts._idle_s == model._prompts._idle_s == 5.0
    turn = [{"role": "user", "content": "a" * 300}]
    body = b'{"model": "m", "messages": %s}'
    model.view(parse_request("chat", body % json.dumps(turn).encode()))
    turn += [{"role": "assistant", "content": "b" * 300}, {"role": "user", "content": "c" * 300}]
    view = model.view(parse_request("chat", body % json.dumps(turn).encode()))
    assert view.num_reused_blocks > 0
    first, second = list(model.prefixes._entries.values())
    assert first.used_s == float("-inf") and second.used_s > 0  # the first turn's state: superseded, first to go
    assert second.state.num_tokens > first.state.num_tokens


def test_config_defaults_and_bounds():
    config = ModelConfig(name="m")
    assert (config.prompt_cache_max_bytes, config.prompt_cache_idle_max_bytes, config.prompt_cache_idle_s) == (
        1 << 30, 64 << 20, IDLE_S)
    # an idle budget over the cap is the cap (a configuration from before the idle budget keeps its behaviour)
    small = ModelTokenizer(ModelConfig(name="m", prompt_cache_max_bytes=8 << 20))
    assert small.prefixes._idle_max_bytes == small.prefixes._max_bytes == 4 << 20
    for field, value in (("prompt_cache_idle_max_bytes", 0), ("prompt_cache_idle_s", 0.0)):
        with pytest.raises(ValueError, match=field):
            ModelConfig(name="m", **{field: value})


def test_config_keys_decode_typed_and_bounded():
    config = msgspec.convert({"name": "m", "prompt_cache_max_bytes": 256 << 20, "prompt_cache_idle_max_bytes": 1 << 20,
                              "prompt_cache_idle_s": 30.0}, ModelConfig)
    assert (config.prompt_cache_max_bytes, config.prompt_cache_idle_max_bytes, config.prompt_cache_idle_s) == (
        256 << 20, 1 << 20, 30.0)
    for bad in ({"prompt_cache_idle_s": -1.0}, {"prompt_cache_idle_max_bytes": 0}, {"prompt_cache_idle_s": "5m"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"name": "m", **bad}, ModelConfig)
