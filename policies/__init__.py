"""Routing policies: pure, synchronous decisions over a snapshot, built from config through a registry.

Public API::

    decode_policy_config(obj) -> PolicyConfig           YAML/JSON -> frozen config (PolicyConfigError names the key)
    build_policy(config, previous=None) -> Policy       registry; ``previous`` carries learned speed factors over
    policy.select(view, snapshot) -> Decision           every policy (``policies.base``)
    find_calibrator(policy) -> TTFTCalibrator | None    the gateway reports observed TTFTs here
    cost_terms(policy, view, snapshot)                  each candidate's ranking cost term by term (admin)
    SessionStickyPolicy.select_inner / .resolve         the one-round-trip session flow (``policies.sticky``)
    derive_session_key(key_sources, headers, user, opening_hash) -> str | None
"""

from policies.base import Decision, Policy, RequestView, Snapshot, WorkerState
from policies.baselines import LeastLoadedPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from policies.cache_aware import CacheAwarePolicy
from policies.config import (
    CacheAwareConfig,
    ConsistentHashConfig,
    LeastLoadedConfig,
    PolicyConfig,
    PowerOfTwoConfig,
    RandomConfig,
    RoundRobinConfig,
    SessionStickyConfig,
    decode_policy_config,
    encode_policy_config,
)
from policies.consistent_hash import ConsistentHashPolicy
from policies.cost_model import TTFTBreakdown, TTFTCalibrator, TTFTCostModel
from policies.errors import PolicyConfigError, PolicyError, UnknownPolicyError
from policies.registry import build_policy, cost_terms, find_calibrator
from policies.sticky import SessionStickyPolicy, derive_session_key, resolve_sticky

__all__ = [
    "CacheAwareConfig",
    "CacheAwarePolicy",
    "ConsistentHashConfig",
    "ConsistentHashPolicy",
    "Decision",
    "LeastLoadedConfig",
    "LeastLoadedPolicy",
    "Policy",
    "PolicyConfig",
    "PolicyConfigError",
    "PolicyError",
    "PowerOfTwoConfig",
    "PowerOfTwoPolicy",
    "RandomConfig",
    "RandomPolicy",
    "RequestView",
    "RoundRobinConfig",
    "RoundRobinPolicy",
    "SessionStickyConfig",
    "SessionStickyPolicy",
    "Snapshot",
    "TTFTBreakdown",
    "TTFTCalibrator",
    "TTFTCostModel",
    "UnknownPolicyError",
    "WorkerState",
    "build_policy",
    "decode_policy_config",
    "derive_session_key",
    "encode_policy_config",
    "find_calibrator",
    "cost_terms",
    "resolve_sticky",
]
