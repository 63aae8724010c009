"""``benchmarks.routing``'s extra kvgate labels: each one is a policy section the gateway accepts."""

import pytest

from benchmarks.routing import EXTRA_POLICIES, _kvgate_policy
from loadgen.demo_config import DemoConfig
from policies.config import CacheAwareConfig, SessionStickyConfig, decode_policy_config

pytestmark = pytest.mark.unit


def _demo() -> DemoConfig:
    return DemoConfig(trace="trace.jsonl")


@pytest.mark.parametrize("label", sorted(EXTRA_POLICIES))
def test_every_extra_label_decodes_around_the_demos_cache_aware(label):
    config = decode_policy_config(_kvgate_policy(label, _demo()))
    assert isinstance(config, SessionStickyConfig)
    assert isinstance(config.inner, CacheAwareConfig)
    assert config.inner.prefill_linear_tokens_per_s == (
        CacheAwareConfig().prefill_linear_tokens_per_s / _demo().prefill_slowdown)


def test_the_unpriced_label_is_the_default_without_its_move_rule():
    default = SessionStickyConfig()
    config = decode_policy_config(_kvgate_policy("session_sticky_unpriced+cache_aware", _demo()))
    assert isinstance(config, SessionStickyConfig)
    assert (default.price_moves, config.price_moves) == (True, False)
    assert (config.max_extra_ttft_s, config.max_ttft_ratio) == (None, None)
    assert config.charge_returning_sessions == default.charge_returning_sessions
