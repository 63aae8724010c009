"""The policies package's exception hierarchy.

Policies never raise for an empty or unhealthy fleet (they return ``Decision(worker_id=None, ...)``); these
errors are for configuration and for misuse of the public API::

    PolicyError                   base of everything ``policies`` raises on purpose
    └── PolicyConfigError         a policy config is invalid (also a ``ValueError``); ``key`` names the bad key
        └── UnknownPolicyError    ``name`` is not a registered policy; ``known`` lists the registered ones

msgspec's ``ValidationError`` / ``DecodeError`` are translated at the boundary
(``policies.config.decode_policy_config``) with ``raise PolicyConfigError(...) from exc``.
"""

from __future__ import annotations


class PolicyError(Exception):
    """Base class of the policies package's errors."""


class PolicyConfigError(PolicyError, ValueError):
    """A policy configuration is invalid.

    Attributes:
        key: dotted path of the offending key relative to the policy mapping (``"inner.temperature"``), or
            ``""`` when the whole value is wrong.
        reason: what is wrong with it, without the path.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        where = f"policy.{key}" if key else "policy"
        super().__init__(f"{where}: {reason}")


class UnknownPolicyError(PolicyConfigError):
    """``name`` does not name a registered policy.

    Attributes:
        known: the registered policy names, sorted.
    """

    def __init__(self, key: str, name: object, known: tuple[str, ...]) -> None:
        self.known = known
        super().__init__(key, f"unknown policy {name!r}; expected one of {', '.join(known)}")
