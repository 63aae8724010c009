"""Policy config decoding, errors naming the key, and the registry."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from policies import (
    CacheAwareConfig,
    CacheAwarePolicy,
    ConsistentHashConfig,
    PolicyConfigError,
    SessionStickyConfig,
    SessionStickyPolicy,
    UnknownPolicyError,
    build_policy,
    decode_policy_config,
    encode_policy_config,
    find_calibrator,
)
from policies.config import POLICY_NAMES
from policies.registry import POLICY_BUILDERS

pytestmark = pytest.mark.unit

GATEWAY_YAML = """
policy:
  name: session_sticky
  max_extra_ttft_s: 0.25
  max_ttft_ratio: null
  key_sources: [x-smg-routing-key, user]
  inner:
    name: cache_aware
    temperature: 0.5
    seed: 7
    max_kv_usage: 0.97
    max_running_requests: 64
"""


def test_yaml_decodes_to_nested_frozen_structs():
    config = decode_policy_config(yaml.safe_load(GATEWAY_YAML)["policy"])
    assert config == SessionStickyConfig(
        inner=CacheAwareConfig(temperature=0.5, seed=7, max_kv_usage=0.97, max_running_requests=64),
        key_sources=("x-smg-routing-key", "user"),
        max_extra_ttft_s=0.25,
        max_ttft_ratio=None,
    )
    with pytest.raises(AttributeError):
        config.max_extra_ttft_s = 1.0  # type: ignore[misc,unused-ignore]


def test_session_expiry_is_refused_in_the_policy_with_where_it_belongs():
    with pytest.raises(PolicyConfigError) as caught:
        decode_policy_config({"name": "session_sticky", "idle_timeout_s": 60})
    assert caught.value.key == "idle_timeout_s"
    assert caught.value.reason == (
        "unknown key; set sessions.idle_timeout_s (session expiry is the session store's, shared by replicas) instead")


def test_defaults_and_name_only():
    assert decode_policy_config({"name": "consistent_hash"}) == ConsistentHashConfig(num_virtual_nodes=160)
    sticky = decode_policy_config({"name": "session_sticky"})
    assert isinstance(sticky, SessionStickyConfig)
    assert sticky.inner == CacheAwareConfig()
    assert sticky.key_sources == ("x-session-id", "x-smg-routing-key", "user", "opening_blocks")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_encode_decode_round_trip_every_policy(name):
    config = decode_policy_config({"name": name})
    encoded = encode_policy_config(config)
    assert encoded["name"] == name
    assert decode_policy_config(encoded) == config
    assert decode_policy_config(msgspec.json.encode(encoded)) == config


@pytest.mark.parametrize(
    ("obj", "error", "key", "reason"),
    [
        ({"name": "fastest"}, UnknownPolicyError, "name", "unknown policy 'fastest'"),
        ({}, PolicyConfigError, "name", "required key is missing"),
        ({"name": "cache_aware", "temprature": 1}, PolicyConfigError, "temprature", "unknown key"),
        ({"name": "cache_aware", "temperature": -1}, PolicyConfigError, "temperature", "Expected `float` >= 0.0"),
        ({"name": "cache_aware", "max_kv_usage": 1.5}, PolicyConfigError, "max_kv_usage", "<= 1.0"),
        ({"name": "cache_aware", "recompute_penalty": -0.5}, PolicyConfigError, "recompute_penalty", ">= 0.0"),
        ({"name": "cache_aware", "recompute_penalty": "2"}, PolicyConfigError, "recompute_penalty", "got `str`"),
        ({"name": "cache_aware", "seed": "x"}, PolicyConfigError, "seed", "Expected `int`, got `str`"),
        ({"name": "cache_aware", "decode_penalty": -1}, PolicyConfigError, "decode_penalty", ">= 0.0"),
        ({"name": "cache_aware", "decode_horizon_tokens": 0}, PolicyConfigError, "decode_horizon_tokens", ">= 1"),
        ({"name": "cache_aware", "decode_horizon_tokens": 2.5}, PolicyConfigError, "decode_horizon_tokens",
         "Expected `int`, got `float`"),
        ({"name": "cache_aware", "decode_s_per_sequence": -1e-5}, PolicyConfigError, "decode_s_per_sequence",
         ">= 0.0"),
        ({"name": "cache_aware", "kv_read_bytes_per_s": 0}, PolicyConfigError, "kv_read_bytes_per_s", ">= 1.0"),
        ({"name": "cache_aware", "min_speed_factor": 2.0}, PolicyConfigError, "min_speed_factor", "<= 1.0"),
        ({"name": "consistent_hash", "num_virtual_nodes": 0}, PolicyConfigError, "num_virtual_nodes", ">= 1"),
        (
            {"name": "session_sticky", "inner": {"name": "session_sticky"}},
            UnknownPolicyError,
            "inner.name",
            "unknown policy 'session_sticky'",
        ),
        (
            {"name": "session_sticky", "inner": {"name": "cache_aware", "overhead_s": -0.1}},
            PolicyConfigError,
            "inner.overhead_s",
            ">= 0.0",
        ),
        (
            {"name": "session_sticky", "inner": {"name": "random", "sed": 1}},
            PolicyConfigError,
            "inner.sed",
            "unknown key",
        ),
        ({"name": "session_sticky", "key_sources": []}, PolicyConfigError, "key_sources", "at least one"),
        ({"name": "session_sticky", "key_sources": ["user", "user"]}, PolicyConfigError, "key_sources", "repeat"),
        ({"name": "session_sticky", "key_sources": ["cookie"]}, PolicyConfigError, "key_sources[0]", "'cookie'"),
        ({"name": "session_sticky", "max_ttft_ratio": 0.5}, PolicyConfigError, "max_ttft_ratio", ">= 1.0"),
        (None, PolicyConfigError, "", "Expected `object`, got `null`"),
        (b"{not json", PolicyConfigError, "", "invalid JSON"),
    ],
)
def test_bad_config_names_the_key(obj, error, key, reason):
    with pytest.raises(error) as info:
        decode_policy_config(obj)
    assert info.type is error
    assert info.value.key == key
    assert reason in info.value.reason
    assert str(info.value).startswith("policy." + key if key else "policy")
    assert isinstance(info.value, ValueError)


def test_unknown_name_lists_known_policies():
    with pytest.raises(UnknownPolicyError) as info:
        decode_policy_config({"name": "fastest"})
    assert info.value.known == (
        "cache_aware",
        "consistent_hash",
        "least_loaded",
        "power_of_two",
        "random",
        "round_robin",
        "session_sticky",
    )


def test_registry_covers_every_policy_and_builds_by_name():
    assert {str(t.__struct_config__.tag) for t in POLICY_BUILDERS} == set(POLICY_NAMES)
    for name in POLICY_NAMES:
        policy = build_policy(decode_policy_config({"name": name}))
        assert policy.name == name


def test_sticky_composes_inner_and_calibrator_is_found_through_it():
    policy = build_policy(decode_policy_config({"name": "session_sticky", "inner": {"name": "cache_aware"}}))
    assert isinstance(policy, SessionStickyPolicy)
    assert isinstance(policy.inner, CacheAwarePolicy)
    assert find_calibrator(policy) is policy.inner.calibrator
    assert find_calibrator(build_policy(decode_policy_config({"name": "round_robin"}))) is None
    no_calibration = build_policy(decode_policy_config({"name": "cache_aware", "enable_calibration": False}))
    assert find_calibrator(no_calibration) is None


def test_hot_reload_keeps_learned_speed_factors():
    old = build_policy(decode_policy_config({"name": "cache_aware"}))
    calibrator = find_calibrator(old)
    assert calibrator is not None
    assert calibrator.observe("w1", predicted_ttft_s=0.503, observed_ttft_s=1.003)
    learned = calibrator.speed_factor("w1")
    assert learned == pytest.approx(2.0**0.25)
    new = build_policy(decode_policy_config({"name": "session_sticky", "inner": {"name": "cache_aware"}}), previous=old)
    new_calibrator = find_calibrator(new)
    assert new_calibrator is not None and new_calibrator is not calibrator
    assert new_calibrator.speed_factor("w1") == pytest.approx(learned)
    assert new_calibrator.speed_factor("w2") == 1.0


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("prefill_linear_tokens_per_s", 1e-320, "Expected `float` >= 1.0"),
    ("prefill_quadratic_tokens_sq_per_s", 0.5, "Expected `float` >= 1.0"),
    ("host_bandwidth_bytes_per_s", 1e300, "Expected `float` <= 1e+18"),
    ("overhead_s", 1e308, "Expected `float` <= 86400.0"),
])
def test_cost_constants_that_would_overflow_an_estimate_are_refused(key: str, value: float, reason: str) -> None:
    with pytest.raises(PolicyConfigError) as caught:
        decode_policy_config({"name": "cache_aware", key: value})
    assert (caught.value.key, caught.value.reason) == (key, reason)
