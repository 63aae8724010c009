"""Build a policy from its config through a registry (config type -> builder), composing wrappers.

``build_policy(config)`` is the one entry point the gateway and the admin's hot reload use. A hot reload passes
the running policy as ``previous`` so the online TTFT calibration (per-worker speed factors) carries over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from policies.base import Policy, RequestView, Snapshot
from policies.baselines import LeastLoadedPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from policies.cache_aware import CacheAwarePolicy, CostTerms
from policies.config import (
    CacheAwareConfig,
    ConsistentHashConfig,
    LeastLoadedConfig,
    PolicyConfig,
    PowerOfTwoConfig,
    RandomConfig,
    RoundRobinConfig,
    SessionStickyConfig,
)
from policies.consistent_hash import ConsistentHashPolicy
from policies.cost_model import TTFTCalibrator
from policies.errors import PolicyConfigError
from policies.sticky import SessionStickyPolicy

logger = logging.getLogger(__name__)

__all__ = ["POLICY_BUILDERS", "build_policy", "find_calibrator"]

PolicyBuilder = Callable[[Any, dict[str, float]], Policy]
"""``(config, learned speed factors) -> policy``; the config is the struct type the builder is registered for."""


def _build_cache_aware(config: CacheAwareConfig, speed_factors: dict[str, float]) -> Policy:
    calibrator = TTFTCalibrator(config, speed_factors) if config.enable_calibration else None
    return CacheAwarePolicy(config, calibrator)


def _build_sticky(config: SessionStickyConfig, speed_factors: dict[str, float]) -> Policy:
    return SessionStickyPolicy(config, _build(config.inner, speed_factors))


POLICY_BUILDERS: Mapping[type, PolicyBuilder] = MappingProxyType(
    {
        RoundRobinConfig: lambda config, _: RoundRobinPolicy(config),
        RandomConfig: lambda config, _: RandomPolicy(config),
        LeastLoadedConfig: lambda config, _: LeastLoadedPolicy(config),
        PowerOfTwoConfig: lambda config, _: PowerOfTwoPolicy(config),
        ConsistentHashConfig: lambda config, _: ConsistentHashPolicy(config),
        CacheAwareConfig: _build_cache_aware,
        SessionStickyConfig: _build_sticky,
    }
)
"""Config struct type -> builder. Read-only."""


def _build(config: PolicyConfig, speed_factors: dict[str, float]) -> Policy:
    builder = POLICY_BUILDERS.get(type(config))
    if builder is None:
        raise PolicyConfigError("name", f"no builder registered for {type(config).__name__}")
    return builder(config, speed_factors)


def find_calibrator(policy: object) -> TTFTCalibrator | None:
    """The ``TTFTCalibrator`` of ``policy``, or ``None`` if it has none: ``CacheAwarePolicy.calibrator``, seen
    through ``SessionStickyPolicy.inner`` (the one wrapper).

    The gateway's request lifecycle (``router.lifecycle``) feeds it each request's observed TTFT.
    """
    while isinstance(policy, SessionStickyPolicy):
        policy = policy.inner
    return policy.calibrator if isinstance(policy, CacheAwarePolicy) else None


def cost_terms(policy: object, view: RequestView, snapshot: Snapshot) -> dict[str, CostTerms]:
    """Every candidate's ranking cost term by term under ``policy`` (``CacheAwarePolicy.cost_terms``, seen
    through ``SessionStickyPolicy.inner``); empty for a policy that ranks by no cost (the baselines)."""
    while isinstance(policy, SessionStickyPolicy):
        policy = policy.inner
    return policy.cost_terms(view, snapshot) if isinstance(policy, CacheAwarePolicy) else {}


def build_policy(config: PolicyConfig, *, previous: object | None = None) -> Policy:
    """A ready policy for ``config``.

    Args:
        config: a decoded config (``policies.config.decode_policy_config``).
        previous: the policy being replaced, if any; its learned speed factors seed the new calibrator.

    Returns:
        The policy (``session_sticky`` wraps the policy built from ``config.inner``).

    Raises:
        PolicyConfigError: no builder is registered for the config's type (a programming error).
    """
    old = find_calibrator(previous) if previous is not None else None
    policy = _build(config, old.speed_factors() if old is not None else {})
    logger.info("policy built: %s", policy.name)
    return policy
